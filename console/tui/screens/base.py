"""Provides Guarded, the one guard for work that outlives its screen, and LiveScreen: a screen the app feeds with
batched host and history changes.

Links call back on every snapshot (256 hosts: 256 calls a second). The app
collects the names of the hosts that changed and, a few times a second, hands
each screen the set inside one ``batch_update()``; a screen that is hidden
under another keeps its set until it is shown again, so work is done only for
what is on screen and only for what changed.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from textual.css.query import NoMatches
from textual.dom import DOMNode
from textual.screen import Screen
from textual.timer import Timer

from gpudeck.console.tui.compat.messages import MessageGuard

if TYPE_CHECKING:
    from gpudeck.agents.wire.protocol import RunInfo
    from gpudeck.console.ops import LaunchIntent
    from gpudeck.console.ops.context import Ops


class DeckApp(Protocol):
    """What the screens may ask of the gpudeck app (console/tui/app.py implements it)."""

    ops: Ops

    def open_run(self, host: str, run_id: str, run: RunInfo | None = None) -> None: ...

    def open_host(self, host: str) -> None: ...

    def launch_flow(self, prefill: LaunchIntent | None = None, host: str | None = None, title: str | None = None) -> Any: ...

    def visible_screens(self) -> list[Screen]: ...


def deck(node: DOMNode) -> DeckApp:
    """The gpudeck app a screen or widget runs in, typed (instead of ``self.app`` plus ``type: ignore``)."""
    return cast(DeckApp, node.app)


class Guarded(MessageGuard):
    """The one guard between a screen and the work that outlives it (mixed into every console screen).

    A worker, a queued message, a timer or a mount handler of a screen can still
    run after Escape took the screen off the stack (or before its widgets were
    composed): then it finds no widget to query. Here, and only here, that ends
    the piece of work quietly: a ``NoMatches`` raised while the screen is not
    mounted or not on the app's stack is swallowed; raised while the screen is
    shown, it is a bug and propagates. Messages and events (compat's MessageGuard),
    ``@work`` workers (``run_worker``), ``set_interval`` and ``set_timer``
    callbacks all pass through it.
    """

    def screen_gone(self) -> bool:
        """Whether this screen is no longer (or not yet) mounted on the app's screen stack."""
        screen = self if isinstance(self, Screen) else None  # Guarded is mixed into screens only (typed, not ignored)
        if screen is None:
            return True
        try:
            # is_running is False from the start of the app's shutdown (its screens are pruned while still on the
            # stack); display is False while the screen itself is closing or being pruned (its widgets go first)
            return (
                not screen.app.is_running
                or not screen.is_mounted
                or not screen.is_attached
                or not screen.display
                or screen not in screen.app.screen_stack
            )
        except Exception:
            return True

    def _guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "func", None)):

            @functools.wraps(fn)
            async def guarded_async(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await fn(*args, **kwargs)
                except NoMatches:
                    if self.screen_gone():
                        return None
                    raise

            return guarded_async

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                result = fn(*args, **kwargs)
            except NoMatches:
                if self.screen_gone():
                    return None
                raise
            if inspect.isawaitable(result):
                return self._guard_awaitable(result)
            return result

        return guarded

    async def _guard_awaitable(self, aw: Awaitable[Any]) -> Any:
        try:
            return await aw
        except NoMatches:
            if self.screen_gone():
                return None
            raise

    def run_worker(self, work: Any, *args: Any, **kwargs: Any) -> Any:
        work = self._guard_awaitable(work) if inspect.isawaitable(work) else self._guard(work)
        return super().run_worker(work, *args, **kwargs)  # type: ignore[misc]

    def set_interval(self, interval: float, callback: Any = None, *args: Any, **kwargs: Any) -> Timer:
        return super().set_interval(interval, self._guard(callback) if callback is not None else None, *args, **kwargs)  # type: ignore[misc]

    def set_timer(self, delay: float, callback: Any = None, *args: Any, **kwargs: Any) -> Timer:
        return super().set_timer(delay, self._guard(callback) if callback is not None else None, *args, **kwargs)  # type: ignore[misc]


class LiveScreen(Guarded, Screen):
    """A screen that redraws from host and history changes, only while visible.

    A delivery hands the screen at most ``DELIVER_SLICE`` hosts (in the config's order); the rest follow in turns of
    the event loop of their own, so a key pressed meanwhile is answered between two slices rather than after every
    host's row (1,024 hosts answering within the same 20 ms are one flush of them all; issue 33). 0: all at once."""

    DELIVER_SLICE = 128

    def __init__(self) -> None:
        super().__init__()
        self._pending_hosts: set[str] = set()
        self._pending_history = False
        self._more_due = False  # the rest of a sliced delivery is queued

    def queue(self, hosts: set[str], history: bool) -> None:
        """Remember what changed (called for every screen in the stack)."""
        self._pending_hosts |= hosts
        self._pending_history = self._pending_history or history

    def deliver(self) -> None:
        """Apply what changed since the last delivery."""
        if self.screen_gone():
            return
        try:
            if self._pending_hosts:
                names = self._take_slice()
                self.hosts_changed(names)
            if self._pending_history:
                self._pending_history = False
                self.history_changed()
        except NoMatches:
            pass  # the screen is being taken down (popped while the update was on its way)

    def _take_slice(self) -> set[str]:
        """The pending hosts to deliver now: all of them, or the first DELIVER_SLICE in the config's order (hosts no
        longer in it first) with the rest queued for a turn of their own."""
        pending = self._pending_hosts
        if not self.DELIVER_SLICE or len(pending) <= self.DELIVER_SLICE:
            self._pending_hosts = set()
            return pending
        links = deck(self).ops.links
        ordered = [n for n in pending if n not in links] + [n for n in links if n in pending]
        names = set(ordered[: self.DELIVER_SLICE])
        self._pending_hosts = pending - names
        if not self._more_due:
            self._more_due = True
            self.call_later(self._deliver_more)
        return names

    async def _deliver_more(self) -> None:
        # the loop's turn first: a callback queued on the screen's own pump runs as its next message without the pump
        # yielding, so every slice ran back to back and a key waited behind all of them (bench/RESULTS.md 35-phase)
        await asyncio.sleep(0)
        self._more_due = False
        if self._pending_hosts and self in deck(self).visible_screens():
            self.deliver()

    def hosts_changed(self, names: set[str]) -> None:
        """These hosts' link state or snapshot changed."""

    def history_changed(self) -> None:
        """New events reached the history."""

    def on_screen_resume(self) -> None:
        self.deliver()
