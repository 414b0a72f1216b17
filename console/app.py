"""Provides the gpudeck console: a Textual app over the Fleet (hosts, GPUs, runs, output)."""

from __future__ import annotations

from collections.abc import Iterable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from agents.errors import AgentError
from console.fleet import Fleet, HostStatus
from console.messages import HostUpdated
from console.screens.fleet import FleetScreen
from console.screens.host import HostScreen
from console.screens.launch import LaunchDialog, LaunchRequest
from console.screens.run import RunScreen
from console.screens.runs import RunsScreen


class GpudeckApp(App):
    """The operator's console."""

    CSS_PATH = "app.tcss"
    TITLE = "gpudeck"
    SUB_TITLE = "who holds every GPU, every run supervised"
    BINDINGS = [
        Binding("f", "show_fleet", "Fleet", tooltip="every host"),
        Binding("r", "show_runs", "Runs", tooltip="every run on every host"),
        Binding("l", "launch", "Launch", tooltip="start a run"),
        Binding("question_mark", "show_help_panel", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, fleet: Fleet | None = None) -> None:
        super().__init__()
        self.fleet = fleet or Fleet()
        self._status: dict[str, HostStatus] = {}

    def fleet_status(self) -> dict[str, HostStatus]:
        """The latest state of every host."""
        return {name: link.status for name, link in self.fleet.links.items()}

    def on_mount(self) -> None:
        for link in self.fleet.links.values():
            link.subscribe(lambda st: self.post_message(HostUpdated(st)))
        self.fleet.start()
        self.push_screen(FleetScreen())

    async def on_unmount(self) -> None:
        await self.fleet.close()

    def on_host_updated(self, message: HostUpdated) -> None:
        for screen in self.screen_stack:
            handler = getattr(screen, "host_updated", None)
            if handler is not None:
                handler(message.status)

    # ------------------------------------------------------------------ navigation

    def _top_is(self, cls: type[Screen]) -> bool:
        return isinstance(self.screen, cls)

    def action_show_fleet(self) -> None:
        while len(self.screen_stack) > 2:
            self.pop_screen()

    def action_show_runs(self) -> None:
        if not self._top_is(RunsScreen):
            self.push_screen(RunsScreen())

    def open_host(self, host: str) -> None:
        """Show one host's GPUs and processes."""
        self.push_screen(HostScreen(host))

    def open_run(self, host: str, run_id: str) -> None:
        """Show one run's output and actions."""
        self.push_screen(RunScreen(host, run_id))

    def action_launch(self) -> None:
        self.launch_flow()

    @work(exclusive=True, group="launch")
    async def launch_flow(self) -> None:
        req: LaunchRequest | None = await self.push_screen_wait(LaunchDialog())
        if req is None:
            return
        try:
            reply = await self.fleet.launch(req.host, req.spec)
        except AgentError as exc:
            self.notify(exc.message, title="launch failed", severity="error", timeout=15)
            return
        self.notify(f"{reply.run.id} started on {req.host}", title="launched")
        self.open_run(req.host, reply.run.id)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Fleet", "Every host at a glance", self.action_show_fleet)
        yield SystemCommand("Runs", "Every run on every host", self.action_show_runs)
        yield SystemCommand("Launch", "Start a run (pre-flight, explicit start)", self.action_launch)
        if isinstance(screen, RunScreen):
            yield SystemCommand("Stop this run", "TERM, grace, KILL, verify GPU memory", screen.action_stop_run)


def run_console() -> int:
    """Open the console on the local host (its agent starts if needed)."""
    GpudeckApp().run()
    return 0
