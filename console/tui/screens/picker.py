"""Provides RunPicker: choose one recorded run (the known-good run a rollback goes back to)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from gpudeck.console.core.records import RunRecord
from gpudeck.console.core.sanitize import one_line
from gpudeck.console.present.views import stamp
from gpudeck.console.tui.widgets.cells import plain_markup, sortable, state_text
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable

COLUMNS = [
    Col("id", "RUN", 12),
    Col("name", "NAME", 18),
    Col("host", "HOST", 12),
    Col("state", "STATE", 10),
    Col("started", "STARTED", 12),
    Col("torch", "TORCH", 16),
    Col("cause", "CAUSE", None),
]


class RunPicker(ModalScreen[RunRecord | None]):
    """A table of candidate runs; enter picks one, esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("enter", "pick", "Pick")]

    def __init__(self, title: str, hint: str, rows: list[RunRecord]) -> None:
        super().__init__()
        self._title = title
        self._hint = hint
        self._rows = {f"{r.host}/{r.id}": r for r in rows}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide", id="picker"):
            yield Static(plain_markup(one_line(self._title)), classes="dialog-title")
            yield Static(Text(self._hint, style="dim"), classes="hint")
            yield KeyedTable(COLUMNS, id="picker-table")

    def on_mount(self) -> None:
        table = self.query_one("#picker-table", KeyedTable)
        table.sync(
            {
                k: {
                    "id": r.id,
                    "name": r.name or "-",
                    "host": r.host,
                    "state": state_text(str(r.state)),
                    "started": sortable(stamp(r.started or r.created), r.started or r.created or 0.0),
                    "torch": r.env_torch or "-",
                    "cause": r.cause or "",
                }
                for k, r in self._rows.items()
            }
        )
        table.focus()

    def on_data_table_row_selected(self, event: KeyedTable.RowSelected) -> None:
        self.dismiss(self._rows.get(str(event.row_key.value)))

    def action_pick(self) -> None:
        key = self.query_one("#picker-table", KeyedTable).cursor_key
        self.dismiss(self._rows.get(key) if key else None)

    def action_cancel(self) -> None:
        self.dismiss(None)
