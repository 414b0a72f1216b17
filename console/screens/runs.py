"""Provides the Runs screen: every run on every host, refreshed in place."""

from __future__ import annotations

import asyncio

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from agents.errors import AgentError
from agents.protocol import RunInfo
from console.fmt import duration, elapsed, when
from console.screens.host import sync_rows
from console.widgets.cells import sparkline, state_text

COLUMNS = [
    ("id", "RUN"),
    ("name", "NAME"),
    ("host", "HOST"),
    ("kind", "KIND"),
    ("state", "STATE"),
    ("step", "STEP"),
    ("loss", "LOSS"),
    ("tps", "TOK/S"),
    ("started", "STARTED"),
    ("elapsed", "ELAPSED"),
    ("cause", "CAUSE"),
]
REFRESH_S = 2.0


def run_cells(r: RunInfo) -> dict[str, object]:
    """The cells of one run's row."""
    tel = r.telemetry
    tps = Text("-")
    if tel is not None and tel.tokens_per_s is not None:
        tps = Text(f"{tel.tokens_per_s:,.0f} ")
        tps.append(sparkline(tel.tps_history), style="cyan")
    return {
        "step": "-" if tel is None or tel.step is None else str(tel.step),
        "loss": "-" if tel is None or tel.loss is None else f"{tel.loss:.4f}",
        "tps": tps,
        "id": r.id,
        "name": r.name or "-",
        "host": r.host,
        "kind": r.spec.kind,
        "state": state_text(r.state),
        "started": when(r.started or r.created),
        "elapsed": duration(elapsed(r.started, r.ended)),
        "cause": Text((r.cause or "")[:80], style="red" if r.state in ("failed", "lost") else ""),
    }


class RunsScreen(Screen):
    """All runs across the fleet; enter opens one, l launches."""

    BINDINGS = [Binding("enter", "open_run", "Open run"), Binding("escape", "app.pop_screen", "Back")]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Runs", classes="title")
        table: DataTable = DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield Static("", id="runs-note", classes="note")
        yield Footer()

    def on_mount(self) -> None:
        self._hosts: dict[str, str] = {}
        self.poll_runs()

    @work(exclusive=True, group="runs-poll")
    async def poll_runs(self) -> None:
        fleet = self.app.fleet  # type: ignore[attr-defined]
        while True:
            rows: dict[str, dict[str, object]] = {}
            errors: list[str] = []
            for host in list(fleet.links):
                try:
                    for r in await fleet.runs(host):
                        rows[r.id] = run_cells(r)
                        self._hosts[r.id] = host
                except AgentError as exc:
                    errors.append(f"{host}: {exc.message}")
            sync_rows(self.query_one("#runs-table", DataTable), COLUMNS, rows)
            note = f"{len(rows)} run(s)" + (f"; unreachable: {'; '.join(errors)}" if errors else "")
            self.query_one("#runs-note", Static).update(note)
            await asyncio.sleep(REFRESH_S)

    def refresh_now(self) -> None:
        """Re-read the run list at once (after a launch or stop)."""
        self.poll_runs()

    def action_open_run(self) -> None:
        table = self.query_one("#runs-table", DataTable)
        if table.row_count == 0:
            return
        rid = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        self.app.open_run(self._hosts.get(rid, "local"), rid)  # type: ignore[attr-defined]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        rid = event.row_key.value
        self.app.open_run(self._hosts.get(rid, "local"), rid)  # type: ignore[attr-defined]
