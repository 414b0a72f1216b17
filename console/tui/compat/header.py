"""Provides SafeTitleHeader: Textual's Header whose title update survives its screen closing first.

Textual's Header draws its title from a watcher set up in its private ``_on_mount``; that watcher may run after the
screen was popped (escape pressed right after opening it), when the Header's children are gone, and the stock one
raises NoMatches, which ends the app. Here ``_on_mount`` is replaced (Textual calls every class's handler otherwise,
hence ``prevent_default``) and the title widget is found by its class from the private ``textual.widgets._header``.
README.md here lists both names; tests/unit/test_textual_compat.py fails when either moves.
"""

from __future__ import annotations

from textual.css.query import NoMatches
from textual.events import Mount
from textual.widgets import Header
from textual.widgets._header import HeaderTitle


class SafeTitleHeader(Header):
    """Header whose title watcher does nothing once the screen is gone."""

    def _on_mount(self, event: Mount) -> None:
        event.prevent_default()  # instead of Header's own

        async def set_title() -> None:
            try:
                self.query_one(HeaderTitle).update(self.format_title())
            except NoMatches:
                pass  # the screen is gone, and with it the title to draw
            except Exception as exc:  # NoScreen lives in a private module; anything else is the same case
                if type(exc).__name__ != "NoScreen":
                    raise

        self.watch(self.app, "title", set_title)
        self.watch(self.app, "sub_title", set_title)
        self.watch(self.screen, "title", set_title)
        self.watch(self.screen, "sub_title", set_title)
