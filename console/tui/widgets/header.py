"""Provides AppHeader: Textual's Header, safe when its screen closes before the title is first drawn."""

from __future__ import annotations

from textual.css.query import NoMatches
from textual.events import Mount
from textual.widgets import Header
from textual.widgets._header import HeaderTitle


class AppHeader(Header):
    """The title bar of every screen.

    Textual's Header draws its title from a watcher that may run after the
    screen was popped (escape pressed right after opening it); its children are
    gone then and the stock one raises NoMatches, which ends the app.
    """

    def _on_mount(self, event: Mount) -> None:
        event.prevent_default()  # instead of Header's own (Textual calls every class's handler otherwise)

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
