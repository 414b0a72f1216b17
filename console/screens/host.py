"""Provides the Host screen: its GPUs and every GPU process, attributed to runs (like nvitop, plus who)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from console.fleet import HostStatus
from console.fmt import gib
from console.widgets.cells import attribution_text, mem_bar, state_text

GPU_COLUMNS = [("idx", "GPU"), ("name", "NAME"), ("mem", "MEMORY"), ("util", "UTIL"), ("temp", "TEMP"), ("power", "POWER"), ("unacc", "UNACCOUNTED")]
PROC_COLUMNS = [("pid", "PID"), ("gpu", "GPU"), ("gib", "GiB"), ("holder", "HOLDER"), ("run", "RUN"), ("rank", "RANK"), ("user", "USER"), ("status", "STATUS"), ("cmd", "COMMAND")]


def sync_rows(table: DataTable, columns: list[tuple[str, str]], rows: dict[str, dict[str, object]]) -> None:
    """Make ``table`` show ``rows`` (key -> cells) by updating in place: never clear a live table."""
    for stale in [k.value for k in table.rows if k.value not in rows]:
        table.remove_row(stale)
    for key, cells in rows.items():
        if key in table.rows:
            for col, _ in columns:
                table.update_cell(key, col, cells[col], update_width=True)
        else:
            table.add_row(*(cells[c] for c, _ in columns), key=key)


class HostScreen(Screen):
    """One host: GPUs, GPU processes with their runs, and the link state."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"Host {self.host}", id="host-title", classes="title")
        gpus: DataTable = DataTable(id="gpu-table", cursor_type="row")
        for key, label in GPU_COLUMNS:
            gpus.add_column(label, key=key)
        yield gpus
        yield Static("GPU processes", classes="subtitle")
        procs: DataTable = DataTable(id="proc-table", cursor_type="row", zebra_stripes=True)
        for key, label in PROC_COLUMNS:
            procs.add_column(label, key=key)
        yield procs
        yield Static("", id="host-note", classes="note")
        yield Footer()

    def on_mount(self) -> None:
        st = self.app.fleet_status().get(self.host)  # type: ignore[attr-defined]
        if st is not None:
            self.host_updated(st)

    def host_updated(self, st: HostStatus) -> None:
        """Refresh both tables from the host's latest snapshot."""
        if st.name != self.host:
            return
        title = self.query_one("#host-title", Static)
        title.update(Text.assemble(Text(f"Host {self.host}  ", style="bold"), state_text(st.state), Text(f"  {st.error or ''}", style="red")))
        snap = st.snapshot
        note = self.query_one("#host-note", Static)
        if snap is None:
            note.update("waiting for the first snapshot ...")
            return
        gpu_rows: dict[str, dict[str, object]] = {}
        proc_rows: dict[str, dict[str, object]] = {}
        for g in snap.gpus:
            gpu_rows[str(g.index)] = {
                "idx": str(g.index),
                "name": g.name,
                "mem": mem_bar(g.memory_used, g.memory_total),
                "util": "-" if g.util_gpu is None else f"{g.util_gpu}%",
                "temp": "-" if g.temperature_c is None else f"{g.temperature_c}°C",
                "power": "-" if g.power_w is None else f"{g.power_w:.0f} W",
                "unacc": Text(f"{gib(g.unaccounted_bytes)} GiB", style="yellow" if (g.unaccounted_bytes or 0) > 2**30 else "dim"),
            }
            for p in g.processes:
                proc_rows[f"{p.gpu}:{p.pid}"] = {
                    "pid": str(p.pid),
                    "gpu": str(p.gpu),
                    "gib": gib(p.used_bytes),
                    "holder": attribution_text(p.attribution),
                    "run": p.run_id or "-",
                    "rank": "-" if p.rank is None else str(p.rank),
                    "user": p.user or "-",
                    "status": p.status or "-",
                    "cmd": " ".join(p.cmdline)[:80] or "-",
                }
        sync_rows(self.query_one("#gpu-table", DataTable), GPU_COLUMNS, gpu_rows)
        sync_rows(self.query_one("#proc-table", DataTable), PROC_COLUMNS, proc_rows)
        if snap.gpu_error:
            note.update(Text(f"No GPUs: {snap.gpu_error}. Runs and processes are still supervised.", style="dim"))
        else:
            note.update(Text(f"sampled in {snap.sample_ms:.2f} ms; {len(snap.runs)} live run(s)", style="dim"))
