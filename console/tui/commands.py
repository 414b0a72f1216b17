"""Provides the command palette's gpudeck commands: every action of the current screen and of the app, and every host."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from rich.text import Text
from textual.app import App
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.markup import escape
from textual.widget import Widget

from gpudeck.console.tui.screens.base import deck


class GpudeckCommands(Provider):
    """What the operator can do from here: the screen's keys, the app's keys, the themes, 'open host X'."""

    def _commands(self) -> list[tuple[str, str, Callable[[], object]]]:
        app = self.app
        screen = self.screen
        out: list[tuple[str, str, Callable[[], object]]] = []
        seen: set[str] = set()

        def add_bindings(owner: App[Any] | Widget, bindings: list[object]) -> None:
            for b in bindings:
                if not isinstance(b, Binding) or not b.description or b.action in seen:
                    continue
                seen.add(b.action)
                key = b.key_display or b.key
                help_text = (b.tooltip or b.description) + f"  [{key}]"
                out.append((b.description, help_text, partial(owner.run_action, b.action)))

        add_bindings(screen, list(getattr(screen, "BINDINGS", [])))
        add_bindings(app, list(getattr(app, "BINDINGS", [])))
        out.append(("Theme: dark", "switch to the dark theme", partial(setattr, app, "theme", "textual-dark")))
        out.append(("Theme: light", "switch to the light theme", partial(setattr, app, "theme", "textual-light")))
        ops = getattr(app, "ops", None)
        if ops is not None:
            for name, link in ops.links.items():
                out.append((f"Open host {name}", f"GPUs and processes of {name} ({link.status.state})", partial(deck(app).open_host, name)))
        return out

    async def discover(self) -> Hits:
        for name, help_text, fn in self._commands():
            if name.startswith("Open host "):
                continue  # hundreds of them: found by typing, not listed
            yield DiscoveryHit(
                Text(name), fn, text=name, help=escape(help_text)
            )  # both are markup: '[/]' (the search key) would end the app

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, fn in self._commands():
            score = matcher.match(name)
            if score > 0:
                shown = matcher.highlight(name) if "[" not in name else Text(name)
                yield Hit(score, shown, fn, text=name, help=escape(help_text))
