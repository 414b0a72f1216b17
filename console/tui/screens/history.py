"""Provides the History screen: every recorded run, filtered with ``gpudeck history``'s language; open one, or mark two and diff them."""

from __future__ import annotations

import time
from collections.abc import Mapping

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.timer import Timer
from textual.widgets import Input, Static

from gpudeck.console.core.fmt import duration
from gpudeck.console.core.records import RunRecord
from gpudeck.console.ops.errors import QueryRefused
from gpudeck.console.ops.figures import run_figures, tokens_text
from gpudeck.console.ops.readings import find_runs
from gpudeck.console.present.views import run_row_from_history, stamp
from gpudeck.console.tui.messages import HistoryLoaded
from gpudeck.console.tui.screens.base import LiveScreen, deck
from gpudeck.console.tui.screens.runs import why_text
from gpudeck.console.tui.widgets.cells import sortable, state_text
from gpudeck.console.tui.widgets.footer import DeckFooter
from gpudeck.console.tui.widgets.header import AppHeader
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable, fit

COLUMNS = [
    Col("id", "RUN", 10),
    Col("name", "NAME", 16, fold=1),
    Col("host", "HOST", 10),
    Col("kind", "KIND", 7, fold=4),
    Col("state", "STATE", 16),
    Col("started", "STARTED", 12),
    Col("elapsed", "ELAPSED", 8, fold=3),
    Col("step", "STEP", 6, fold=2),
    Col("loss", "LOSS", 7),
    Col("tps", "TOK/S", 8, fold=5),
    Col("torch", "TORCH", 14, fold=6),
    Col("why", "CAUSE / ALERTS", None),
]
PLACEHOLDER = "filter: state:failed host:gpu1 kind:dflash since:7d name:~drafter cause:oom torch:2.7 alert:any   (enter applies)"
RELOAD_MIN_S = 2.0
TYPE_DELAY_S = 0.4


def history_cells(d: RunRecord) -> dict[str, object]:
    """One recorded run's row."""
    r = run_row_from_history(d)
    fig = run_figures(d)  # the figures the CLI and the Diff screen show too
    return {
        "id": r.id,
        "name": r.name or "-",
        "host": r.host,
        "kind": r.kind,
        "state": state_text(r.state),
        "started": sortable(stamp(r.started or r.created), r.started or r.created),
        "elapsed": duration(fig.elapsed_s) if fig.elapsed_s is not None else "-",
        "step": "-" if fig.last_step is None else str(fig.last_step),
        "loss": "-" if r.loss is None else f"{r.loss:.4f}",
        "tps": tokens_text(fig.tokens_per_s),
        "torch": r.torch or "-",
        "why": why_text(r),
    }


def newest_first(cells: Mapping[str, object]) -> float:
    """The History table's own order: the newest run first."""
    return -(getattr(cells.get("started"), "sort_value", None) or 0.0)


class HistoryScreen(LiveScreen):
    """The history: filter, open a run, mark two and diff them."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("slash", "focus_filter", "Filter", key_display="/"),
        Binding("enter", "open_run", "Open run"),
        Binding("space", "mark", "Mark", tooltip="mark a run to diff (two at most)"),
        Binding(
            "d",
            "diff",
            "Diff marked",
            tooltip="two marked runs side by side: environment (torch, CUDA, driver, NCCL first), config, outcome",
        ),
        Binding("u", "reload", "Refresh"),
    ]

    def __init__(self, query: str = "") -> None:
        super().__init__()
        self.query_text = query
        self.rows: dict[str, RunRecord] = {}
        self._loaded_at = 0.0
        self._due = False
        self._typing: Timer | None = None
        self._took = 0.0

    def compose(self) -> ComposeResult:
        yield AppHeader()
        yield Static("History", id="history-title", classes="title")
        yield Input(self.query_text, id="history-filter", placeholder=PLACEHOLDER)
        # its filter is the query box above (the history's own language, run in SQLite); sorting is the tables' own
        yield KeyedTable(
            fit(COLUMNS, self.app.size.width, markable=True, least=24),
            id="history-table",
            markable=True,
            filterable=False,
            order=newest_first,
            order_columns=("started",),
            fold_from=COLUMNS,
        )
        yield Static("", id="history-note", classes="note")
        yield DeckFooter()

    def on_mount(self) -> None:
        self.query_one("#history-table", KeyedTable).focus()
        if deck(self).ops.history_path is None:
            self.query_one("#history-note", Static).update(
                Text("this console runs without a history database (`gpudeck` opens one by default)", style="yellow")
            )
            return
        self.set_interval(0.5, self._maybe_reload)
        self.reload()

    # ------------------------------------------------------------------ loading

    def history_changed(self) -> None:
        self._due = True

    def _maybe_reload(self) -> None:
        if self._due and self.app.screen is self and time.monotonic() - self._loaded_at >= RELOAD_MIN_S:
            self._due = False
            self.reload()

    def action_reload(self) -> None:
        self.reload()

    def reload(self) -> None:
        """Run the filter again (in a thread)."""
        self._loaded_at = time.monotonic()
        self._load(self.query_text)

    @work(thread=True, exclusive=True, group="history-query")
    def _load(self, text: str) -> None:
        path = deck(self).ops.history_path
        assert path is not None  # loads are started only with a history (on_mount)
        t0 = time.monotonic()
        try:
            rows = find_runs(path, text)
        except QueryRefused as exc:
            self.post_message(HistoryLoaded(text, [], error=str(exc)))
            return
        except Exception as exc:  # a missing or locked file: say so, keep the screen
            self.post_message(HistoryLoaded(text, [], error=f"the history cannot be read: {exc}"))
            return
        self.post_message(HistoryLoaded(text, rows, seconds=time.monotonic() - t0))

    @on(HistoryLoaded)
    def _loaded(self, message: HistoryLoaded) -> None:
        message.stop()
        if not self.is_attached:
            return
        note = self.query_one("#history-note", Static)
        if message.error:
            note.update(Text(message.error, style="bold red"))
            return
        if message.query != self.query_text:
            return  # an older filter's answer
        table = self.query_one("#history-table", KeyedTable)
        self.rows = {f"{d.host}/{d.id}": d for d in message.rows}
        table.sync({k: history_cells(d) for k, d in self.rows.items()})
        self._took = message.seconds
        self._note()

    def on_keyed_table_reordered(self, event: KeyedTable.Reordered) -> None:
        self._note()

    def _note(self) -> None:
        table = self.query_one("#history-table", KeyedTable)
        t = Text(f"{len(self.rows)} run(s)" + (f" matching {self.query_text!r}" if self.query_text else ""), style="dim")
        if self._took >= 0.5:
            t.append(f" (the query took {self._took:.1f} s)", style="yellow")
        if table.sort_column:
            t.append(f"   {table.describe()}", style="bold")
        if table.marks:
            t.append(f"   {len(table.marks)} marked: " + ", ".join(sorted(k.split("/", 1)[1] for k in table.marks)), style="bold")
        self.query_one("#history-note", Static).update(t)

    # ------------------------------------------------------------------ filter

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id != "history-filter":
            return
        if self._typing is not None:
            self._typing.stop()
        self._typing = self.set_timer(TYPE_DELAY_S, lambda: self._apply(event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "history-filter":
            return
        self._apply(event.value)
        self.query_one("#history-table", KeyedTable).focus()

    def _apply(self, text: str) -> None:
        if text != self.query_text or not self.rows:
            self.query_text = text
            if deck(self).ops.history_path is not None:
                self.reload()

    def action_focus_filter(self) -> None:
        self.query_one("#history-filter", Input).focus()

    def action_back(self) -> None:
        box = self.query_one("#history-filter", Input)
        if box.has_focus:
            self.query_one("#history-table", KeyedTable).focus()
        else:
            self.app.pop_screen()

    # ------------------------------------------------------------------ open, mark, diff

    def action_open_run(self) -> None:
        key = self.query_one("#history-table", KeyedTable).cursor_key
        if key is not None and key in self.rows:
            d = self.rows[key]
            deck(self).open_run(d.host, d.id)

    def on_data_table_row_selected(self, event: KeyedTable.RowSelected) -> None:
        d = self.rows.get(str(event.row_key.value))
        if d is not None:
            deck(self).open_run(d.host, d.id)

    def action_mark(self) -> None:
        table = self.query_one("#history-table", KeyedTable)
        key = table.cursor_key
        if key is None:
            return
        if key not in table.marks and len(table.marks) >= 2:
            self.notify("two runs are marked already: d diffs them, space on a marked run unmarks it", severity="warning")
            return
        table.toggle_mark_and_advance()

    def action_diff(self) -> None:
        table = self.query_one("#history-table", KeyedTable)
        keys = [k for k in table.keys() if k in table.marks]
        if len(keys) == 1 and table.cursor_key not in (None, keys[0]):
            keys.append(table.cursor_key)
        if len(keys) != 2:
            self.notify("mark two runs with space (or one, and highlight the other), then d", severity="warning")
            return
        self.open_diff(self.rows[keys[0]], self.rows[keys[1]])

    @work(exclusive=True, group="history-diff")
    async def open_diff(self, a: RunRecord, b: RunRecord) -> None:
        """Read both runs' full rows (environment included) in a thread, then show them side by side."""
        from gpudeck.console.tui.screens.diff import DiffScreen

        try:  # the same records and step metrics as `gpudeck diff` and the Roll back dialog (ops.compare)
            pair = await deck(self).ops.compare_runs((a.host, a.id), (b.host, b.id))
        except Exception as exc:
            self.notify(str(exc), title="cannot diff", severity="error")
            return
        self.app.push_screen(DiffScreen(pair.a, pair.b, pair.a_metrics, pair.b_metrics))
