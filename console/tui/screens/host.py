"""Provides the Host screen: its GPUs and every GPU process, attributed to runs (like nvitop, plus who), and reclaim."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from gpudeck.agents.wire.protocol import GpuProcess, Snapshot
from gpudeck.console.core.fmt import gib
from gpudeck.console.core.records import HostStatus
from gpudeck.console.core.sanitize import escape_controls
from gpudeck.console.ops.errors import OpsError
from gpudeck.console.ops.ledger import ledger_query
from gpudeck.console.present.formats import container_cell
from gpudeck.console.present.ledger import format_ledger
from gpudeck.console.present.views import LEFTOVER_HOLDERS, age, holder_label, unaccounted_holders, unaccounted_line
from gpudeck.console.tui.screens.base import LiveScreen, deck
from gpudeck.console.tui.screens.dialogs import ResultDialog
from gpudeck.console.tui.screens.fleet import state_cell
from gpudeck.console.tui.screens.reclaim import ReclaimItem, reclaim_flow
from gpudeck.console.tui.widgets.cells import SIMULATED, attribution_text, mem_bar, pct_bar, plain_markup
from gpudeck.console.tui.widgets.footer import DeckFooter
from gpudeck.console.tui.widgets.header import AppHeader
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable, fit
from gpudeck.console.tui.widgets.plots import MetricPlot, Series
from gpudeck.console.tui.widgets.progress import ProgressLine

MEM_WINDOW_S = 600  # the memory plot's last ten minutes
MEM_POINTS = MEM_WINDOW_S  # snapshots come once a second
MEM_PLOT_S = 2.0  # the plot is redrawn this often at most (a snapshot comes every second)

GPU_COLUMNS = [
    Col("idx", "GPU", 4),
    Col("name", "NAME", 26, fold=1),
    Col("mem", "MEMORY", 32),
    Col("util", "UTIL", 10),
    Col("temp", "TEMP", 6, fold=3),
    Col("power", "POWER", 12, fold=4),
    Col("unacc", "UNACCOUNTED", 12, fold=2),
    Col("holders", "HOLDERS", None),
]
PROC_COLUMNS = [
    Col("pid", "PID", 8),
    Col("gpu", "GPU", 4),
    Col("gib", "GiB", 6),
    Col("holder", "HOLDER", 16),
    Col("run", "RUN", 12),
    Col("rank", "RANK", 5, fold=1),
    Col("user", "USER", 10),
    Col("status", "STATUS", 11, fold=3),
    Col("age", "AGE", 8, fold=2),
    Col("cmd", "COMMAND", None),
]


class HostScreen(LiveScreen):
    """One host: GPUs, GPU processes with their runs, the link state; mark processes and reclaim them."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("space", "mark", "Mark", tooltip="mark or unmark the highlighted process (enter and click too)"),
        Binding("a", "mark_leftovers", "Mark leftovers", tooltip="mark every STALE, FOREIGN and NO SUCH PROCESS holder"),
        Binding("c", "clear_marks", "Clear marks", show=False),
        Binding("x", "reclaim", "Reclaim marked", tooltip="stop exactly the marked processes (confirm first), then verify through NVML"),
        Binding(
            "L", "leftovers", "Leftovers", tooltip="what reclaim offers on this host: orphans of ended runs, foreign and ghost holders"
        ),
        Binding("o", "open_run", "Open run", tooltip="the run of the highlighted process"),
        Binding("w", "gpu_ledger", "Who held it", tooltip="the GPU ledger of the highlighted process's GPU (else every GPU), last 24 h"),
    ]

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host
        # GPU index -> (snapshot time, GiB used), the last MEM_WINDOW_S seconds (since the screen opened)
        self._mem: dict[int, deque[tuple[float, float]]] = {}
        self._plotted_at = 0.0

    def compose(self) -> ComposeResult:
        yield AppHeader()
        yield Static(plain_markup(f"Host {self.host}"), id="host-title", classes="title")
        yield KeyedTable(fit(GPU_COLUMNS, self.app.size.width), id="gpu-table", zebra_stripes=False, fold_from=GPU_COLUMNS)
        yield MetricPlot(id="host-mem-plot")
        yield Static("GPU processes  (space/enter: mark, a: mark leftovers, x: reclaim marked)", classes="subtitle")
        yield KeyedTable(fit(PROC_COLUMNS, self.app.size.width, markable=True), id="proc-table", markable=True, fold_from=PROC_COLUMNS)
        yield ProgressLine(id="host-progress")
        yield Static("", id="host-note", classes="note")
        yield DeckFooter()

    def on_mount(self) -> None:
        self.query_one("#proc-table", KeyedTable).focus()
        self.hosts_changed({self.host})

    @property
    def status(self) -> HostStatus | None:
        link = deck(self).ops.links.get(self.host)
        return None if link is None else link.status

    def hosts_changed(self, names: set[str]) -> None:
        """Refresh both tables from the host's latest snapshot (only the cells that changed)."""
        if self.host not in names:
            return
        st = self.status
        if st is None:
            return
        title = Text.assemble(Text(f"Host {self.host}  ", style="bold"), state_cell(st))
        snap = st.snapshot
        if snap is not None and snap.simulated:
            title.append("  ")
            title.append_text(SIMULATED)
            title.append(" GPUs are simulated: memory is what processes declare, load their CPU", style="dim")
        if st.error and st.state != "up":
            title.append(f"\n{st.error}", style="red")
        if snap is not None and snap.gpu_error:
            title.append(f"\nNo GPUs: {snap.gpu_error}. Runs and processes are still supervised.", style="dim")
        if snap is not None and snap.journal_note:  # Text.append: shown as text, never parsed as markup
            title.append(f"\n{snap.journal_note}", style="yellow")
        self.query_one("#host-title", Static).update(title)
        note = self.query_one("#host-note", Static)
        if snap is None:
            note.update("waiting for the first snapshot ...")
            return
        gpu_rows: dict[str, dict[str, object]] = {}
        proc_rows: dict[str, dict[str, object]] = {}
        for g in snap.gpus:
            unacc = g.unaccounted_bytes or 0
            gpu_rows[str(g.index)] = {
                "idx": str(g.index),
                "name": g.name,
                "mem": mem_bar(g.memory_used, g.memory_total),
                "util": pct_bar(g.util_gpu),
                "temp": "-" if g.temperature_c is None else f"{g.temperature_c}°C",
                "power": "-"
                if g.power_w is None
                else (f"{g.power_w:.0f}/{g.power_limit_w:.0f} W" if g.power_limit_w else f"{g.power_w:.0f} W"),
                "unacc": Text(f"{gib(unacc)} GiB", style="bold yellow" if unacc > 2**30 else "dim"),
                "holders": self._holders(g.processes),
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
                    "age": age(p.create_time),
                    # the container (seen from the host) leads the command: a cell only where there is one
                    "cmd": (f"[{container_cell(p.container)}] " if p.container else "") + (" ".join(p.cmdline)[:120] or "-"),
                }
        self.query_one("#gpu-table", KeyedTable).sync(gpu_rows)
        self.query_one("#proc-table", KeyedTable).sync(proc_rows)
        self._plot_memory(snap)
        if snap.gpu_error:
            note.update(Text(f"{len(snap.runs)} live run(s)", style="dim"))
        else:
            leftovers = sum(1 for g in snap.gpus for p in g.processes if p.attribution in LEFTOVER_HOLDERS)
            t = Text(f"sampled in {snap.sample_ms:.2f} ms; {len(snap.runs)} live run(s)", style="dim")
            if leftovers:
                t.append(f"; {leftovers} GPU process(es) belong to no live run: a marks them, x reclaims", style="yellow")
            for u in unaccounted_holders(snap.unaccounted):  # Text.append: the agent's words shown as text, never markup
                t.append("\n" + unaccounted_line(u), style="bold yellow")
            if snap.namespace is not None and snap.namespace.pid_namespace == "isolated":
                t.append(f"\nPID namespace: {snap.namespace.label}", style="yellow")
            note.update(t)

    def _plot_memory(self, snap: Snapshot) -> None:
        """GPU memory used, one line per GPU, over the last minutes (redrawn every MEM_PLOT_S at most)."""
        for g in snap.gpus:
            ring = self._mem.setdefault(g.index, deque(maxlen=MEM_POINTS))
            if not ring or ring[-1][0] != snap.ts:
                ring.append((snap.ts, g.memory_used / 2**30))
        plot = self.query_one("#host-mem-plot", MetricPlot)
        plot.display = bool(snap.gpus)
        now = time.monotonic()
        if not snap.gpus or now - self._plotted_at < MEM_PLOT_S:
            return
        self._plotted_at = now
        latest = max((r[-1][0] for r in self._mem.values() if r), default=snap.ts)
        series = []
        for i, ring in sorted(self._mem.items()):
            points = [(ts, v) for ts, v in ring if ts >= latest - MEM_WINDOW_S]  # the window's minutes only
            if points:
                series.append(Series(f"GPU {i}", [(ts - latest) / 60 for ts, _ in points], [v for _, v in points]))
        # the axis ends at now: plotext would centre a lone first sample, drawing minutes that have not happened yet
        first = min((x for s in series for x in s.x), default=0.0)
        plot.show(series, xlabel="minutes (0 = now)", title="GPU memory used, GiB", xlim=(min(first, -1.0), 0.0))

    @staticmethod
    def _holders(procs: Sequence[GpuProcess]) -> Text:
        if not procs:
            return Text("free", style="dim")
        t = Text()
        for i, p in enumerate(procs[:3]):
            if i:
                t.append(", ")
            t.append_text(attribution_text(p.attribution))
            t.append(f" {p.pid}")
        if len(procs) > 3:
            t.append(f" +{len(procs) - 3}")
        return t

    # ------------------------------------------------------------------ marks and reclaim

    def action_mark(self) -> None:
        self.query_one("#proc-table", KeyedTable).toggle_mark_and_advance()

    def on_data_table_row_selected(self, event: KeyedTable.RowSelected) -> None:
        if event.data_table.id == "proc-table":
            self.query_one("#proc-table", KeyedTable).toggle_mark(str(event.row_key.value))

    def action_mark_leftovers(self) -> None:
        st = self.status
        if st is None or st.snapshot is None:
            return
        keys = [f"{p.gpu}:{p.pid}" for g in st.snapshot.gpus for p in g.processes if p.attribution in LEFTOVER_HOLDERS]
        self.query_one("#proc-table", KeyedTable).mark_all(keys)
        if not keys:
            self.notify("no STALE, FOREIGN or NO SUCH PROCESS holder here")

    def action_clear_marks(self) -> None:
        self.query_one("#proc-table", KeyedTable).mark_all([])

    def reclaim_items(self) -> list[ReclaimItem]:
        """The marked processes (every GPU each pid holds memory on), for the confirm dialog."""
        st = self.status
        table = self.query_one("#proc-table", KeyedTable)
        if st is None or st.snapshot is None:
            return []
        pids = {int(k.split(":", 1)[1]) for k in table.marks}
        items: dict[int, ReclaimItem] = {}
        for g in st.snapshot.gpus:
            for p in g.processes:
                if p.pid not in pids:
                    continue
                cur = items.get(p.pid)
                held = dict(cur.gpu_bytes) if cur else {}
                held[p.gpu] = p.used_bytes or 0
                items[p.pid] = ReclaimItem(
                    pid=p.pid,
                    who=holder_label(p),
                    user=p.user or "-",
                    command=" ".join(p.cmdline),
                    gpu_bytes=held,
                    live_run=p.run_id if p.attribution == "RUN" else None,
                    container=container_cell(p.container) if p.container else "",
                )
        return [items[p] for p in sorted(items)]

    def action_reclaim(self) -> None:
        self.reclaim()

    @work(exclusive=True, group="host-reclaim")
    async def reclaim(self) -> None:
        """Confirm the marked processes, reclaim them, show the verification."""
        st = self.status
        gpus = st.snapshot.gpus if st is not None and st.snapshot is not None else []
        res = await reclaim_flow(self, self.host, self.reclaim_items(), gpus, self.query_one("#host-progress", ProgressLine))
        if res is not None:
            self.action_clear_marks()

    def action_leftovers(self) -> None:
        from gpudeck.console.tui.screens.leftovers import LeftoversScreen

        self.app.push_screen(LeftoversScreen(self.host))

    def action_open_run(self) -> None:
        table = self.query_one("#proc-table", KeyedTable)
        key = table.cursor_key
        cells = table.cells_of(key) if key else None
        rid = str(cells.get("run", "-")) if cells else "-"
        if rid == "-":
            self.notify("this process belongs to no run", severity="warning")
            return
        deck(self).open_run(self.host, rid)

    def action_gpu_ledger(self) -> None:
        table = self.query_one("#proc-table", KeyedTable)
        key = table.cursor_key
        cells = table.cells_of(key) if key else None
        gpu = str(cells.get("gpu", "")) if cells else ""
        self.gpu_ledger(int(gpu) if gpu.isdigit() else None)

    @work(exclusive=True, group="host-ledger")
    async def gpu_ledger(self, gpu: int | None) -> None:
        """Who held the GPU over the last 24 h (``gpudeck ledger HOST:GPU --since -24h``), as a timeline in a dialog."""
        target = self.host if gpu is None else f"{self.host}:{gpu}"
        try:
            answer = await deck(self).ops.ledger(ledger_query(target, since="-24h"))
        except OpsError as exc:
            self.notify(escape_controls(exc.message), severity="error")
            return
        if self.is_attached:
            self.app.push_screen(ResultDialog(f"GPU ledger: {target}, last 24 h", Text(escape_controls(format_ledger(answer), keep="\n"))))
