"""Provides LiveScreen: a screen the app feeds with batched host and history changes.

Links call back on every snapshot (256 hosts: 256 calls a second). The app
collects the names of the hosts that changed and, a few times a second, hands
each screen the set inside one ``batch_update()``; a screen that is hidden
under another keeps its set until it is shown again, so work is done only for
what is on screen and only for what changed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from textual.css.query import NoMatches
from textual.dom import DOMNode
from textual.screen import Screen

if TYPE_CHECKING:
    from agents.protocol import RunInfo
    from console.fleet import Fleet
    from console.ops import LaunchIntent

F = TypeVar("F", bound=Callable[..., Any])


class DeckApp(Protocol):
    """What the screens may ask of the gpudeck app (console/app.py implements it)."""

    fleet: Fleet

    def open_run(self, host: str, run_id: str, run: RunInfo | None = None) -> None: ...

    def open_host(self, host: str) -> None: ...

    def launch_flow(self, prefill: LaunchIntent | None = None, host: str | None = None, title: str | None = None) -> Any: ...


def deck(node: DOMNode) -> DeckApp:
    """The gpudeck app a screen or widget runs in, typed (instead of ``self.app`` plus ``type: ignore``)."""
    return cast(DeckApp, node.app)


def tolerant(fn: F) -> F:
    """Let a screen method end quietly when the screen was closed under it (its widgets are gone).

    Escape pressed right after a screen opens removes its widgets while its
    ``on_mount``, a worker or a queued message handler is still to run; those
    find nothing to query, which is not an error. Only NoMatches is swallowed,
    and only once the screen is no longer on the stack.
    """

    def gone(self: Screen) -> bool:
        try:
            return self not in self.app.screen_stack
        except Exception:
            return True

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(self: Screen, *args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(self, *args, **kwargs)
            except NoMatches:
                if gone(self):
                    return None
                raise

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(self: Screen, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except NoMatches:
            if gone(self):
                return None
            raise

    return wrapper  # type: ignore[return-value]


class LiveScreen(Screen):
    """A screen that redraws from host and history changes, only while visible."""

    def __init__(self) -> None:
        super().__init__()
        self._pending_hosts: set[str] = set()
        self._pending_history = False

    def queue(self, hosts: set[str], history: bool) -> None:
        """Remember what changed (called for every screen in the stack)."""
        self._pending_hosts |= hosts
        self._pending_history = self._pending_history or history

    def deliver(self) -> None:
        """Apply what changed since the last delivery."""
        if not self.is_mounted or not self.is_attached:
            return
        try:
            if self._pending_hosts:
                names, self._pending_hosts = self._pending_hosts, set()
                self.hosts_changed(names)
            if self._pending_history:
                self._pending_history = False
                self.history_changed()
        except NoMatches:
            pass  # the screen is being taken down (popped while the update was on its way)

    def hosts_changed(self, names: set[str]) -> None:
        """These hosts' link state or snapshot changed."""

    def history_changed(self) -> None:
        """New events reached the history."""

    def on_screen_resume(self) -> None:
        self.deliver()
