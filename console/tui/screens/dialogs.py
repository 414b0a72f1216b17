"""Provides the console's dialogs: confirm with the facts, show a verified result, choose one of several actions."""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from gpudeck.agents.wire.protocol import StopResult
from gpudeck.console.core.fmt import gib
from gpudeck.console.core.sanitize import one_line
from gpudeck.console.tui.widgets.cells import plain_markup


class ConfirmDialog(ModalScreen[bool]):
    """Yes/no with the facts the operator needs before saying yes."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("y", "confirm", "Yes")]

    def __init__(self, title: str, body: RenderableType, confirm_label: str = "Stop", variant: str = "error") -> None:
        super().__init__()
        self._title = title
        self.body = body
        self._confirm_label = confirm_label
        self._variant = variant

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(plain_markup(one_line(self._title)), classes="dialog-title")
            yield Static(plain_markup(self.body), classes="dialog-body", id="confirm-body")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self._confirm_label} (y)", variant=self._variant, id="confirm")  # type: ignore[arg-type]
                yield Button("Cancel (esc)", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


class ChoiceDialog(ModalScreen[str | None]):
    """Several ways to go on (buttons, each with a key); returns the chosen id or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, body: RenderableType, choices: list[tuple[str, str, str]]) -> None:
        """``choices``: (id, label, key) — the key chooses it too."""
        super().__init__()
        self._title = title
        self.body = body
        self._choices = choices

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Static(plain_markup(one_line(self._title)), classes="dialog-title")
            yield Static(plain_markup(self.body), classes="dialog-body", id="choice-body")
            with Horizontal(classes="dialog-buttons"):
                for i, (cid, label, key) in enumerate(self._choices):
                    yield Button(f"{label} ({key})", id=f"choice-{cid}", variant="primary" if i == 0 else "default")
                yield Button("Cancel (esc)", id="cancel")

    def on_key(self, event: events.Key) -> None:
        """A choice's key chooses it (the keys are the caller's, so they are not class BINDINGS)."""
        for cid, _, key in self._choices:
            if event.key == key:
                event.stop()
                self.dismiss(cid)
                return

    def on_button_pressed(self, event: Button.Pressed) -> None:
        bid = event.button.id or ""
        self.dismiss(bid[len("choice-") :] if bid.startswith("choice-") else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


def stop_result_text(res: StopResult) -> Text:
    """The verification of a stop or a reclaim, as the operator reads it."""
    t = Text()
    style = "bold green" if not res.survivors else "bold red"
    t.append(f"{res.state} in {res.seconds:.2f} s", style=style)
    if res.message:
        t.append(f": {one_line(res.message)}")
    t.append("\n")
    for p in res.stopped:
        t.append(
            f"  ended    pid {p.pid:<7} {p.how:<12} {one_line(' '.join(p.cmdline), 56)}\n", style="yellow" if p.how == "SIGKILL" else ""
        )
    for p in res.survivors:
        t.append(f"  SURVIVED pid {p.pid:<7} {p.status or '?':<12} {one_line(' '.join(p.cmdline), 56)}\n", style="bold red")
    for f in res.freed:
        if f.before_bytes == f.after_bytes and not f.freed_bytes:
            continue  # a GPU the stop did not touch
        t.append(f"  GPU {f.gpu}: {gib(f.before_bytes)} → {gib(f.after_bytes)} GiB used, {gib(f.freed_bytes)} GiB freed\n")
    if res.freed_bytes:
        t.append(f"  {gib(res.freed_bytes)} GiB freed in all\n", style="bold")
    for g in res.still_on_gpu:
        t.append(f"  still on GPU {g.gpu}: pid {g.pid} {one_line(g.attribution)} {gib(g.used_bytes)} GiB\n", style="bold red")
    if res.gpu_note and res.gpu_note not in (res.message or ""):
        t.append(f"  {one_line(res.gpu_note)}\n", style="green" if res.gpu_verified else "yellow")
    return t


class ResultDialog(ModalScreen[None]):
    """Shows a result until dismissed."""

    BINDINGS = [Binding("escape", "close", "Close"), Binding("enter", "close", "Close")]

    def __init__(self, title: str, body: RenderableType) -> None:
        super().__init__()
        self._title = title
        self.body = body

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(plain_markup(one_line(self._title)), classes="dialog-title")
            yield Static(plain_markup(self.body), classes="dialog-body", id="result-body")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Close", id="close", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
