"""Provides the Leftovers screen: what reclaim offers on one host (orphans of ended runs, foreign, zombie and ghost holders)."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Static

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Gpu, Leftover, LeftoverList
from gpudeck.console.core.fmt import gib
from gpudeck.console.present.formats import container_cell
from gpudeck.console.present.views import age, unaccounted_holders, unaccounted_line
from gpudeck.console.tui.screens.base import Guarded, deck
from gpudeck.console.tui.screens.reclaim import ReclaimItem, reclaim_flow
from gpudeck.console.tui.widgets.cells import leftover_text, plain_markup
from gpudeck.console.tui.widgets.footer import DeckFooter
from gpudeck.console.tui.widgets.header import AppHeader
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable, fit
from gpudeck.console.tui.widgets.progress import ProgressLine

COLUMNS = [
    Col("pid", "PID", 8),
    Col("kind", "KIND", 16),
    Col("gpu", "GPU MEMORY", 18),
    Col("run", "RUN", 12),
    Col("run_state", "RUN STATE", 26, fold=3),
    Col("user", "USER", 10, fold=1),
    Col("status", "STATUS", 11, fold=4),
    Col("cmd", "COMMAND", 40, fold=2),
    Col("note", "WHAT TO DO", None),
]


def leftover_cells(lo: Leftover) -> dict[str, object]:
    """One leftover's row."""
    held = sum(lo.gpu_bytes.values())
    gpu = Text(f"{gib(held)} GiB on {','.join(map(str, sorted(lo.gpu_bytes)))}" if lo.gpu_bytes else "-", style="bold" if held else "dim")
    run_state = "-"
    if lo.run_id:
        run_state = lo.run_state or "?"
        if lo.run_ended:
            run_state += f", ended {age(lo.run_ended)}"
    return {
        "pid": str(lo.pid),
        "kind": leftover_text(lo.kind),
        "gpu": gpu,
        "run": lo.run_id or "-",
        "run_state": Text(run_state, style="red" if lo.run_state in ("failed", "lost") else ""),
        "user": lo.user or "-",
        "status": lo.status or "-",
        "cmd": " ".join(lo.cmdline)[:80] or "-",
        "note": Text(lo.note, style="dim"),
    }


def leftover_item(lo: Leftover) -> ReclaimItem:
    """A leftover as the reclaim dialog lists it."""
    who = lo.kind.replace("_", " ").upper()
    if lo.run_id:
        who += f" {lo.run_id}" + (f" rank {lo.rank}" if lo.rank is not None else "")
    return ReclaimItem(
        pid=lo.pid,
        who=who,
        user=lo.user or "-",
        command=" ".join(lo.cmdline),
        gpu_bytes=dict(lo.gpu_bytes),
        live_run=lo.run_id if lo.kind == "live" else None,
        container=container_cell(lo.container) if lo.container else "",
    )


class LeftoversScreen(Guarded, Screen):
    """The host's leftovers, asked of its agent; mark and reclaim them."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("space", "mark", "Mark"),
        Binding("a", "mark_all", "Mark all", tooltip="mark every leftover listed (never members of live runs)"),
        Binding("x", "reclaim", "Reclaim marked", tooltip="stop exactly the marked processes, then verify through NVML"),
        Binding("u", "reload", "Refresh", tooltip="ask the agent again"),
        Binding("i", "toggle_live", "Include live runs", tooltip="also list members of live runs (reclaiming one breaks its run)"),
    ]

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host
        self.include_live = False
        self.reply: LeftoverList | None = None

    def compose(self) -> ComposeResult:
        yield AppHeader()
        yield Static(plain_markup(f"Leftovers on {self.host}"), id="leftovers-title", classes="title")
        yield KeyedTable(fit(COLUMNS, self.app.size.width, markable=True), id="leftovers-table", markable=True, fold_from=COLUMNS)
        yield ProgressLine(id="leftovers-progress")
        yield Static("", id="leftovers-note", classes="note")
        yield DeckFooter()

    def on_mount(self) -> None:
        self.query_one("#leftovers-table", KeyedTable).focus()
        self.reload()

    def action_reload(self) -> None:
        self.reload()

    def action_toggle_live(self) -> None:
        self.include_live = not self.include_live
        self.notify("members of live runs are listed too" if self.include_live else "members of live runs are not listed")
        self.reload()

    @work(exclusive=True, group="leftovers")
    async def reload(self) -> None:
        """Ask the host's agent what is left over."""
        progress = self.query_one("#leftovers-progress", ProgressLine)
        note = self.query_one("#leftovers-note", Static)
        progress.start(f"asking {self.host} for its leftovers")
        try:
            reply = await deck(self).ops.leftovers(self.host, include_live=self.include_live)
        except AgentError as exc:
            if self.is_attached:
                progress.finish(f"{self.host} could not list its leftovers: {exc.message}", style="bold red")
            return
        if not self.is_attached:
            return
        self.reply = reply
        took = progress.finish("")
        rows = {str(lo.pid): leftover_cells(lo) for lo in reply.leftovers}
        self.query_one("#leftovers-table", KeyedTable).sync(rows)
        held = sum(sum(lo.gpu_bytes.values()) for lo in reply.leftovers)
        t = Text(
            f"{len(reply.leftovers)} leftover(s) holding {gib(held)} GiB of GPU memory"
            + (f" (the agent took {took:.1f} s)" if took >= 1 else ""),
            style="bold",
        )
        hidden = unaccounted_holders(reply.unaccounted)
        if not reply.leftovers:
            t = (
                Text(f"no leftover process on {self.host}", style="bold")
                if hidden
                else Text(f"nothing left over on {self.host}: every process is a member of a live run or holds no GPU", style="green")
            )
        for u in hidden:  # no row to mark: nothing here can signal it
            t.append("\n" + unaccounted_line(u), style="bold yellow")
        if reply.gpu_error:
            t.append(f"; no GPUs: {reply.gpu_error}", style="dim")
        note.update(t)

    def action_mark(self) -> None:
        self.query_one("#leftovers-table", KeyedTable).toggle_mark_and_advance()

    def on_data_table_row_selected(self, event: KeyedTable.RowSelected) -> None:
        self.query_one("#leftovers-table", KeyedTable).toggle_mark(str(event.row_key.value))

    def action_mark_all(self) -> None:
        if self.reply is None:
            return
        self.query_one("#leftovers-table", KeyedTable).mark_all(str(lo.pid) for lo in self.reply.leftovers if lo.kind != "live")

    def action_reclaim(self) -> None:
        self.reclaim()

    @work(exclusive=True, group="leftovers-reclaim")
    async def reclaim(self) -> None:
        """Reclaim the marked leftovers, then list again."""
        if self.reply is None:
            return
        marks = self.query_one("#leftovers-table", KeyedTable).marks
        items = [leftover_item(lo) for lo in self.reply.leftovers if str(lo.pid) in marks]
        gpus: list[Gpu] = self.reply.gpus
        res = await reclaim_flow(self, self.host, items, gpus, self.query_one("#leftovers-progress", ProgressLine))
        if res is not None:
            self.query_one("#leftovers-table", KeyedTable).mark_all([])
            self.reload()
