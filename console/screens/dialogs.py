"""Provides the console's dialogs: confirm a stop, show a stop's verified result."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from agents.protocol import StopResult
from console.fmt import gib


class ConfirmDialog(ModalScreen[bool]):
    """Yes/no with the facts the operator needs before saying yes."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("y", "confirm", "Yes")]

    def __init__(self, title: str, body: Text | str, confirm_label: str = "Stop") -> None:
        super().__init__()
        self._title = title
        self._body = body
        self._confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self._title, classes="dialog-title")
            yield Static(self._body, classes="dialog-body")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self._confirm_label, variant="error", id="confirm")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


def stop_result_text(res: StopResult) -> Text:
    """The verification of a stop, as the operator reads it."""
    t = Text()
    t.append(f"{res.state} in {res.seconds:.2f} s\n", style="bold")
    for p in res.stopped:
        style = "yellow" if p.how == "SIGKILL" else ""
        t.append(f"  ended    pid {p.pid:<7} {p.how:<12} {' '.join(p.cmdline)[:60]}\n", style=style)
    for p in res.survivors:
        t.append(f"  SURVIVED pid {p.pid:<7} {p.status or '?':<12} {' '.join(p.cmdline)[:60]}\n", style="bold red")
    for f in res.freed:
        t.append(f"  GPU {f.gpu}: {gib(f.before_bytes)} → {gib(f.after_bytes)} GiB used, {gib(f.freed_bytes)} GiB freed\n")
    if res.gpu_note:
        t.append(f"  {res.gpu_note}\n", style="green" if res.gpu_verified else "yellow")
    return t


class ResultDialog(ModalScreen[None]):
    """Shows a result until dismissed."""

    BINDINGS = [Binding("escape", "close", "Close"), Binding("enter", "close", "Close")]

    def __init__(self, title: str, body: Text | str) -> None:
        super().__init__()
        self._title = title
        self._body = body

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self._title, classes="dialog-title")
            yield Static(self._body, classes="dialog-body", id="result-body")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Close", id="close", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
