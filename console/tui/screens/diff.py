"""Provides the Diff screen: two runs side by side — environment (core first), configuration, outcome — differences highlighted."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Static

from gpudeck.console.core.records import MetricPoint, RunRecord
from gpudeck.console.core.sanitize import one_line, redact_record
from gpudeck.console.present.views import run_diff
from gpudeck.console.tui.screens.base import Guarded
from gpudeck.console.tui.widgets.cells import shown
from gpudeck.console.tui.widgets.diff import LABEL_LIMIT, diff_rows, diff_summary
from gpudeck.console.tui.widgets.footer import DeckFooter
from gpudeck.console.tui.widgets.header import AppHeader
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable
from gpudeck.console.tui.widgets.plots import MetricPlot, Series


def columns(width: int) -> list[Col]:
    """The diff's columns; A and B share what the terminal has left."""
    side = max(24, (width - 60) // 2)
    return [Col("mark", " ", 1), Col("section", "", 11), Col("key", "FIELD", 30), Col("a", "A", side), Col("b", "B", side)]


class DiffScreen(Guarded, Screen):
    """Two recorded runs compared; d shows only the differences."""

    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("d", "toggle_same", "Only differences", tooltip="hide or show the fields that are the same"),
        Binding("w", "swap", "Swap A/B"),
    ]

    def __init__(
        self,
        a: RunRecord,
        b: RunRecord,
        a_metrics: list[MetricPoint] | None = None,
        b_metrics: list[MetricPoint] | None = None,
    ) -> None:
        super().__init__()
        self.a, self.b = redact_record(a), redact_record(b)  # --env secrets never shown
        self.ma, self.mb = a_metrics, b_metrics
        self.only_differences = False

    def compose(self) -> ComposeResult:
        yield AppHeader()
        yield Static("", id="diff-title", classes="title")
        yield Static("", id="diff-summary", classes="note")
        yield KeyedTable(columns(self.app.size.width), id="diff-table", zebra_stripes=False)
        with Horizontal(id="diff-plots"):
            yield MetricPlot(id="diff-loss")
            yield MetricPlot(id="diff-tps")
        yield Static(
            Text(
                "● changed and decides whether a known-good setup still works (torch, CUDA, driver, NCCL, cuDNN, transformers, python)   • changed",
                style="dim",
            ),
            classes="note",
        )
        yield DeckFooter()

    def on_mount(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        diff = run_diff(self.a, self.b, self.ma, self.mb)
        a_label, b_label = one_line(self.a.label(), LABEL_LIMIT), one_line(self.b.label(), LABEL_LIMIT)  # run names: one row
        self.query_one("#diff-title", Static).update(
            shown(Text.assemble(("Diff  ", "bold"), ("A ", "dim"), a_label, ("   B ", "dim"), b_label))
        )
        self.query_one("#diff-summary", Static).update(diff_summary(diff))
        table = self.query_one("#diff-table", KeyedTable)
        table.columns[table.cols[3].key].label = shown(Text(f"A  {a_label}"))  # type: ignore[index]
        table.columns[table.cols[4].key].label = shown(Text(f"B  {b_label}"))  # type: ignore[index]
        # a static comparison, not a live table: rebuilt in the diff's order (core first) on every toggle
        table.reset()
        table.sync(diff_rows(diff, self.only_differences, focus=True))  # one-line cells: show where long values differ
        self._plot(a_label, b_label)

    def _plot(self, a_label: str, b_label: str) -> None:
        """Loss and tokens/s of both runs by step, overlaid (hidden when neither recorded any)."""
        runs = [(f"A {a_label}", self.ma or []), (f"B {b_label}", self.mb or [])]
        self.query_one("#diff-plots").display = any(m for _, m in runs)
        for plot_id, title, field in (("#diff-loss", "loss", "loss"), ("#diff-tps", "tokens/s", "tokens_per_s")):
            series = [Series(label, [float(p.step) for p in m], [getattr(p, field) for p in m]) for label, m in runs]
            self.query_one(plot_id, MetricPlot).show(series, xlabel="step", title=title)

    def action_toggle_same(self) -> None:
        self.only_differences = not self.only_differences
        self._redraw()

    def action_swap(self) -> None:
        self.a, self.b = self.b, self.a
        self.ma, self.mb = self.mb, self.ma
        self._redraw()
