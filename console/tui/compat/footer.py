"""Provides CoalescedFooter: Textual's Footer, recomposed once however many times the bindings changed before it got to it.

Textual's Footer remounts every key on each "bindings changed" signal. A screen opening sends several (its focus,
its tabs, each worker that answers): the Run screen's footer was rebuilt 9 times in its first ~1.5 s, and a key
pressed then (bench/tui.py part 2: the first press) waited behind those rebuilds. Here a signal that comes while a
rebuild is already due adds nothing; the rebuild reads the bindings as they are when it runs. Footer's own
``bindings_changed`` sets its private ``_bindings_ready`` (compose shows nothing until it is set), so the override
sets it too. README.md here lists the name; tests/unit/test_textual_compat.py fails when it moves.
"""

from __future__ import annotations

from textual.screen import Screen
from textual.widgets import Footer


class CoalescedFooter(Footer):
    """A Footer that coalesces bindings-changed signals into one recompose."""

    _rebuild_due = False
    rebuilds = 0  # how many times it was rebuilt (tests)

    def bindings_changed(self, screen: Screen) -> None:
        self._bindings_ready = True
        if not screen.app.app_focus:
            return
        if self.is_attached and screen is self.screen and not self._rebuild_due:
            self._rebuild_due = True
            self.call_after_refresh(self._rebuild)

    async def _rebuild(self) -> None:
        self._rebuild_due = False
        self.rebuilds += 1
        await self.recompose()
