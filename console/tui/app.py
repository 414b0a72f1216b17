"""Provides the gpudeck console: a Textual app over the operations layer's long-lived :class:`Ops` (hosts, GPUs, runs,
output, the history).

Host links call back on every snapshot; the app only notes which hosts
changed and, four times a second, hands the changes to the screens inside one
``batch_update()`` — 256 hosts at 1 Hz cost a few table cells per tick, not a
repaint per snapshot. History syncs are noted the same way.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import platformdirs
from rich.terminal_theme import TerminalTheme
from textual import events, work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.notifications import SeverityLevel
from textual.screen import ModalScreen, Screen

from gpudeck.agents.wire import paths
from gpudeck.agents.wire.protocol import RunInfo
from gpudeck.console.core import gcpolicy
from gpudeck.console.core.config import ConfigError
from gpudeck.console.core.records import HostStatus
from gpudeck.console.core.sanitize import escape_controls
from gpudeck.console.ops import LaunchIntent
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.commands import GpudeckCommands
from gpudeck.console.tui.compat.ansi_theme import light_ansi
from gpudeck.console.tui.compat.textual_fixes import install as install_textual_fixes
from gpudeck.console.tui.screens.base import LiveScreen
from gpudeck.console.tui.screens.fleet import FleetScreen
from gpudeck.console.tui.screens.history import HistoryScreen
from gpudeck.console.tui.screens.host import HostScreen
from gpudeck.console.tui.screens.launch import LaunchDialog, LaunchOutcome
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.screens.runs import RunsScreen

install_textual_fixes()  # Strip.divide without its reference cycle: see textual_fixes.py

# Host changes reach the screens this often at most. A refresh costs the visible cells that changed
# (KeyedTable), so frequent small refreshes keep a key press from waiting behind a big one.
FLUSH_S = 0.25
CONFIG_POLL_S = 2.0  # how often the console looks whether `gpudeck hosts add/remove` changed the config file
THEMES = ("textual-dark", "textual-light")
QUIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _light_ansi() -> TerminalTheme:
    """Textual's light ANSI palette (Alabaster) with a darker yellow: 'changed' (diffs), 'connecting', FOREIGN are
    yellow, and Alabaster's rgb(203,144,0) has 2:1 contrast on the light background; this one has over 5:1 (WCAG AA)."""
    bg, fg, colors = light_ansi()  # 8 normal, then 8 bright
    colors[3] = colors[11] = LIGHT_YELLOW
    return TerminalTheme(bg, fg, colors[:8], colors[8:])


LIGHT_YELLOW = (115, 78, 0)


class GpudeckApp(App):
    """The operator's console."""

    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute, so a subclass elsewhere (bench/tui.py) finds it
    TITLE = "gpudeck"
    SUB_TITLE = "who holds every GPU, every run supervised"
    COMMANDS = App.COMMANDS | {GpudeckCommands}
    BINDINGS = [
        Binding("f", "show_fleet", "Fleet", tooltip="every host"),
        Binding("r", "show_runs", "Runs", tooltip="every run on every host"),
        Binding("h", "show_history", "History", tooltip="every recorded run: filter, open, diff two"),
        Binding("l", "launch", "Launch", tooltip="start a run: pre-flight first, explicit start"),
        Binding("ctrl+t", "toggle_theme", "Theme", tooltip="dark / light"),
        Binding("question_mark", "toggle_help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, ops: Ops | None = None, *, freeze_gc: bool = False, quit_on_signals: bool = False) -> None:
        """``ops``: the console's operations (:meth:`Ops.console`; by default every configured host, no history);
        ``freeze_gc``: once connected, keep the start-up heap out of full collections (the real console does);
        ``quit_on_signals``: SIGTERM and SIGHUP quit as ``q`` does (the real console, which owns its process)."""
        super().__init__()
        self._quit_on_signals = quit_on_signals
        self.ops = ops or Ops.console()
        self._dirty_hosts: set[str] = set()
        self._history_dirty = False
        self._gc_frozen = not freeze_gc  # tests and embedders leave their process's collector alone
        self._mounted_at = time.monotonic()
        self._input_at = 0.0
        self._gc = gcpolicy.KeyAwareCollector()
        self.flushes = 0
        self.last_screenshot: Path | None = None

    def notify(
        self, message: str, *, title: str = "", severity: SeverityLevel = "information", timeout: float | None = None, markup: bool = False
    ) -> None:
        """A toast; its text often carries run names and agent messages, so it is never parsed as markup by default."""
        super().notify(escape_controls(message), title=escape_controls(title), severity=severity, timeout=timeout, markup=markup)

    def fleet_status(self) -> dict[str, HostStatus]:
        """The latest state of every host."""
        return {name: link.status for name, link in self.ops.links.items()}

    def _follow_link(self, name: str) -> None:
        link = self.ops.links[name]

        def mark_dirty(_st: HostStatus, name: str = name) -> None:
            self._dirty_hosts.add(name)

        link.subscribe(mark_dirty)
        link.on_synced(self._synced)

    def on_mount(self) -> None:
        if self._quit_on_signals:
            loop = asyncio.get_running_loop()
            for sig in QUIT_SIGNALS:
                if signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # started under nohup (or told to ignore it): keep ignoring it
                loop.add_signal_handler(sig, self._quit_on_signal, sig)
        self.theme = THEMES[0]
        self.ansi_theme_light = _light_ansi()
        for name in self.ops.links:
            self._follow_link(name)
        self.ops.start()
        self.set_interval(FLUSH_S, self.flush_updates)
        self._config_mtime = self._config_stamp()
        self.set_interval(CONFIG_POLL_S, self._check_config)
        self._mounted_at = time.monotonic()
        self.push_screen(FleetScreen())

    def _config_stamp(self) -> float | None:
        path = self.ops.config_path  # a fleet built without a config file has nothing to follow
        try:
            return path.stat().st_mtime_ns if path is not None else None
        except OSError:
            return None

    def _check_config(self) -> None:
        """``gpudeck hosts add/remove`` (or an edit) changed the config file: follow it without a restart."""
        stamp = self._config_stamp()
        if stamp == self._config_mtime:
            return
        self._config_mtime = stamp
        try:
            added, removed, changed = self.ops.reload_config()
        except ConfigError as exc:
            self.notify(str(exc), title="the config file changed and cannot be read", severity="error")
            return
        for name in [*added, *changed]:  # a changed host has a new link (its new settings), followed like a new one
            self._follow_link(name)
        if added or removed or changed:
            self._dirty_hosts |= {*added, *removed, *changed}
            said = [(added, "added"), (removed, "removed"), (changed, "reconnecting with new settings:")]
            self.notify("; ".join(f"{word} {', '.join(names)}" for names, word in said if names), title="hosts changed")

    def _synced(self, host: str, n: int) -> None:
        if n:
            self._history_dirty = True

    def _quit_on_signal(self, sig: int) -> None:
        """SIGTERM (a `kill`, a service stopping) or SIGHUP (the terminal or the SSH session carrying it went away):
        quit as ``q`` does, so the links close, the history's writer finishes what it holds, the terminal is given
        back and the per-host SSH config folder is removed; by default Python would die on the spot and leave them.
        The exit status says which signal (128 + its number, as a shell reports it)."""
        self.exit(return_code=128 + sig)

    async def on_unmount(self) -> None:
        self._gc.stop()
        if self._quit_on_signals:
            loop = asyncio.get_running_loop()
            for sig in QUIT_SIGNALS:
                loop.remove_signal_handler(sig)  # False (nothing done) for one left ignored
        await self.ops.close()

    def flush_updates(self) -> None:
        """Hand what changed since the last flush to the screens; the visible ones redraw it now, in one batch."""
        if not self._gc_frozen:
            self._maybe_freeze_gc()
        if not self._dirty_hosts and not self._history_dirty:
            return
        hosts, self._dirty_hosts = self._dirty_hosts, set()
        history, self._history_dirty = self._history_dirty, False
        self.flushes += 1
        with self.batch_update():
            for screen in self.screen_stack:
                if isinstance(screen, LiveScreen):
                    screen.queue(hosts, history)
            for screen in self.visible_screens():
                if isinstance(screen, LiveScreen):
                    screen.deliver()

    def _maybe_freeze_gc(self) -> None:
        """Once the fleet is connected, take what start-up built out of the cyclic collector's sight.

        The widgets, the links, hundreds of SSH connections live as long as the console; a full
        collection walks all of them (170 ms with 256 hosts, measured by bench/tui.py) and a key
        press waits behind it. Frozen objects are still freed by reference counting when they go.
        Then collections run as console/core/gcpolicy.py's KeyAwareCollector decides: young ones often,
        the middle and full ones when keys stop coming. Cycles are still found, a little later.
        """
        if gcpolicy.freeze_due((link.status.state for link in self.ops.links.values()), time.monotonic() - self._mounted_at):
            self._gc_frozen = True
            self._gc.start()
            self.set_interval(gcpolicy.CHECK_S, self._collect_when_due)

    def _collect_when_due(self) -> None:
        self._gc.check(self._input_at)

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, (events.Key, events.MouseDown, events.MouseScrollDown, events.MouseScrollUp, events.Paste)):
            self._input_at = time.monotonic()  # someone is waiting on the screen: collections wait (gcpolicy.due_collection)
        await super().on_event(event)

    def visible_screens(self) -> list[Screen]:
        """The top screen, and under a modal dialog the screens it lets show through."""
        out: list[Screen] = []
        for screen in reversed(self.screen_stack):
            out.append(screen)
            if not isinstance(screen, ModalScreen):
                break
        return out

    # ------------------------------------------------------------------ navigation

    def action_show_fleet(self) -> None:
        while len(self.screen_stack) > 2:
            self.pop_screen()

    def action_show_runs(self) -> None:
        if not isinstance(self.screen, RunsScreen):
            self.push_screen(RunsScreen())

    def action_show_history(self) -> None:
        if not isinstance(self.screen, HistoryScreen):
            self.push_screen(HistoryScreen())

    def open_host(self, host: str) -> None:
        """Show one host's GPUs and processes."""
        self.push_screen(HostScreen(host))

    def open_run(self, host: str, run_id: str, run: RunInfo | None = None) -> None:
        """Show one run's output, facts and actions (``run``: what is known of it already)."""
        self.push_screen(RunScreen(host, run_id, run))

    # ------------------------------------------------------------------ palette and screenshots

    # system commands gpudeck's own palette entries already give (its keys: q, ctrl+t, ?), or that it replaces
    _SYSTEM_DUPLICATES = frozenset({"Quit", "Theme", "Keys", "Screenshot"})

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Textual's own commands less those gpudeck lists already: the palette names each command once."""
        for command in super().get_system_commands(screen):
            if command.title not in self._SYSTEM_DUPLICATES:
                yield command
        yield SystemCommand("Screenshot", "Save an SVG of the screen (says where)", self.action_screenshot)

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        """Save an SVG of the screen where it can be written — ``path``, the Downloads folder (created if need be),
        else the state directory — and say where (Textual's own saves to a Downloads folder that may not exist)."""
        candidates = [Path(path).expanduser()] if path else []
        candidates += [Path(platformdirs.user_downloads_dir()), paths.state_dir() / "screenshots"]
        errors: list[str] = []
        for folder in candidates:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                saved = self.save_screenshot(filename, str(folder))
            except OSError as exc:
                errors.append(f"{folder}: {exc.strerror or exc}")
                continue
            self.last_screenshot = Path(saved)
            self.notify(f"saved to {saved}", title="screenshot")
            return
        self.notify("; ".join(errors), title="the screenshot could not be saved", severity="error")

    def action_toggle_theme(self) -> None:
        self.theme = THEMES[1] if self.theme == THEMES[0] else THEMES[0]

    def action_toggle_help(self) -> None:
        from textual.widgets import HelpPanel

        if self.screen.query(HelpPanel):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def action_launch(self) -> None:
        self.launch_flow()

    @work(exclusive=True, group="launch")
    async def launch_flow(self, prefill: LaunchIntent | None = None, host: str | None = None, title: str | None = None) -> None:
        """The launch dialog (pre-flight, confirm, launch), then the new run's screen (``prefill``: a relaunch's intent)."""
        parent = prefill.parent if prefill is not None else None
        outcome: LaunchOutcome | None = await self.push_screen_wait(LaunchDialog(prefill=prefill, host=host, title=title))
        if outcome is None:
            return
        run = outcome.run
        what = f" ({outcome.spec.start})" if outcome.spec.start else ""
        if run.state == "preflight_failed":
            self.notify(
                run.cause or "pre-flight failed on the host", title=f"{run.id} refused by {outcome.host}", severity="error", timeout=15
            )
        else:
            self.notify(f"{run.id} started on {outcome.host}{what}" + (f", relaunching {parent}" if parent else ""), title="launched")
        self.open_run(outcome.host, run.id, run)


def run_console() -> int:
    """Open the console on the fleet (this host, its agent started if needed, plus the configured hosts); the exit
    status is 0 after `q`, 128 + the signal's number after SIGTERM or SIGHUP."""
    ops = Ops.console(with_history=True)
    app = GpudeckApp(ops, freeze_gc=True, quit_on_signals=True)
    try:
        app.run()
    finally:
        ops.close_history()
    return app.return_code or 0
