"""Provides the Fleet screen: one row per host, updated in place by row key."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from console.fleet import HostStatus
from console.fmt import ago
from console.widgets.cells import mem_bar, state_text

COLUMNS = [("host", "HOST"), ("state", "STATE"), ("gpus", "GPUs BUSY"), ("memory", "MEMORY"), ("util", "UTIL"), ("runs", "RUNS"), ("alerts", "ALERTS")]


def host_cells(st: HostStatus) -> dict[str, object]:
    """The cells of one host's row."""
    snap = st.snapshot
    if st.state == "unreachable":
        state = state_text("unreachable", f"since {ago(st.since)}")
    else:
        state = state_text(st.state)
    cells: dict[str, object] = {"host": Text(st.name, style="bold"), "state": state, "gpus": "-", "memory": "-", "util": "-", "runs": "-", "alerts": ""}
    if snap is not None:
        if snap.gpus:
            busy = sum(1 for g in snap.gpus if g.processes)
            used = sum(g.memory_used for g in snap.gpus)
            total = sum(g.memory_total for g in snap.gpus)
            utils = [g.util_gpu for g in snap.gpus if g.util_gpu is not None]
            cells["gpus"] = f"{busy}/{len(snap.gpus)}"
            cells["memory"] = mem_bar(used, total)
            cells["util"] = f"{sum(utils) / len(utils):.0f}%" if utils else "-"
        else:
            cells["gpus"] = Text("no GPU", style="dim")
            cells["memory"] = Text(snap.gpu_error or "", style="dim")
        cells["runs"] = str(len(snap.runs))
        stale = sum(1 for g in snap.gpus for p in g.processes if p.attribution in ("STALE", "NO_SUCH_PROCESS"))
        if stale:
            cells["alerts"] = Text(f"{stale} stale GPU process(es)", style="bold red")
    if st.error and st.state != "up":
        cells["alerts"] = Text(st.error[:80], style="red")
    return cells


class FleetScreen(Screen):
    """Every host at a glance; enter opens a host."""

    BINDINGS = [Binding("enter", "open_host", "Open host", show=True)]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Fleet", classes="title")
        table: DataTable = DataTable(id="fleet-table", cursor_type="row", zebra_stripes=True)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table
        yield Footer()

    def on_mount(self) -> None:
        for st in self.app.fleet_status().values():  # type: ignore[attr-defined]
            self.host_updated(st)

    def host_updated(self, st: HostStatus) -> None:
        """Update (or add) one host's row in place."""
        table = self.query_one("#fleet-table", DataTable)
        cells = host_cells(st)
        if st.name in table.rows:
            for key, _ in COLUMNS:
                table.update_cell(st.name, key, cells[key], update_width=True)
        else:
            table.add_row(*(cells[k] for k, _ in COLUMNS), key=st.name)

    def action_open_host(self) -> None:
        table = self.query_one("#fleet-table", DataTable)
        if table.row_count == 0:
            return
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        self.app.open_host(key)  # type: ignore[attr-defined]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.app.open_host(event.row_key.value)  # type: ignore[attr-defined]
