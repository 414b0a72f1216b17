"""Provides the Runs screen: every run across the fleet — live ones from the snapshots, the rest from the history."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from gpudeck.agents.wire.protocol import TERMINAL_STATES, RunInfo
from gpudeck.console.core.fmt import duration, elapsed
from gpudeck.console.ops.errors import OpsError
from gpudeck.console.ops.readings import history_run_count, runs_changed_since
from gpudeck.console.present.views import (
    RunRow,
    merge_rows,
    run_from_record,
    run_row_from_history,
    run_row_from_info,
    stamp,
)
from gpudeck.console.tui.messages import HistoryLoaded
from gpudeck.console.tui.screens.base import LiveScreen, deck
from gpudeck.console.tui.screens.run import relaunch, stop_flow
from gpudeck.console.tui.widgets.cells import STATE_WORDS, alerts_text, sortable, sparkline, state_text
from gpudeck.console.tui.widgets.footer import DeckFooter
from gpudeck.console.tui.widgets.header import AppHeader
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable, cell_text, fit
from gpudeck.console.tui.widgets.progress import ProgressLine
from gpudeck.console.tui.widgets.steady import SteadyText

COLUMNS = [
    Col("id", "RUN", 10),
    Col("name", "NAME", 16, fold=1),
    Col("host", "HOST(S)", 10),
    Col("kind", "KIND", 7, fold=4),
    Col("state", "STATE", 16),
    Col("step", "STEP", 6, fold=2),
    Col("loss", "LOSS", 7),
    Col("tps", "TOK/S", 20, fold=5),
    Col("started", "STARTED", 12),
    Col("elapsed", "ELAPSED", 8, fold=3),
    Col("why", "ALERTS (live) / CAUSE (ended)", None),  # a live run has alerts, an ended one a cause: one column holds both
]
ENDED_WORDS = frozenset(STATE_WORDS.get(s, s).split(" ")[0] for s in TERMINAL_STATES)
HISTORY_LIMIT = 100_000  # the run records the screen reads (the filter looks through them all), newest first; past it: said on screen
HISTORY_MIN_INTERVAL_S = 2.0  # history changes arrive with every synced event; the table is re-read at most this often
AGENT_POLL_S = 5.0  # without a history: ask the agents for their runs this often
AGENT_POLL_CONCURRENCY = 16


def run_cells(r: RunRow) -> dict[str, object]:
    """The cells of one run's row."""
    tps: Text | str = "-"
    if r.tokens_per_s is not None:
        tps = Text(f"{r.tokens_per_s:>9,.0f} ")
        tps.append(sparkline(r.tps_history, width=10), style="cyan")
    hosts = r.hosts[0] if len(r.hosts) == 1 else f"{r.hosts[0]} +{len(r.hosts) - 1}"
    return {
        "id": r.id,
        "name": r.name or "-",
        "host": hosts,
        "kind": r.kind,
        "state": state_text(r.state),
        "step": "-" if r.step is None else str(r.step),
        "loss": "-" if r.loss is None else f"{r.loss:.4f}",
        "tps": tps,
        "started": sortable(stamp(r.started or r.created), r.started or r.created),
        "elapsed": duration(elapsed(r.started, r.ended)),
        "why": why_text(r),
    }


def runs_order(cells: Mapping[str, object]) -> tuple[bool, float]:
    """The Runs table's own order: live runs first, then the newest."""
    state = cell_text(cells.get("state", ""))
    started = getattr(cells.get("started"), "sort_value", None) or 0.0
    return (state.split(" ")[0] in ENDED_WORDS, -started)


def why_text(r: RunRow) -> Text:
    """Alerts of a live run, the cause of an ended one (its alerts were about it running: a stopped run's GPUs are idle
    by design; the Run screen's Alerts tab keeps them)."""
    if not r.ended_state:
        return alerts_text(r.alerts, r.critical, limit=3)
    return Text(r.cause or "", style="red" if r.state in ("failed", "lost", "preflight_failed") else "")


class RunsScreen(LiveScreen):
    """All runs across the fleet; enter opens one."""

    BINDINGS = [
        Binding("enter", "open_run", "Open run"),
        Binding("escape", "app.pop_screen", "Back"),
        Binding("s", "stop_run", "Stop", tooltip="stop the highlighted run (the Run screen's confirmation: its processes listed)"),
        Binding("t", "tail", "Tail", tooltip="the highlighted run's output, following its end"),
        Binding("R", "relaunch", "Relaunch", tooltip="the launch form filled from the highlighted run"),
        Binding("u", "reload", "Refresh", tooltip="read the history (or ask the agents) again now"),
    ]

    def compose(self) -> ComposeResult:
        yield AppHeader()
        yield Static("Runs", id="runs-title", classes="title")
        table = KeyedTable(
            fit(COLUMNS, self.app.size.width, least=24),
            id="runs-table",
            order=runs_order,
            order_columns=("state", "started"),
            fold_from=COLUMNS,
        )
        table.pin_top = True  # the cursor starts on the first row (a live run, else the newest) and stays there while rows come in
        yield table
        yield ProgressLine(id="runs-progress")
        yield SteadyText(id="runs-note", classes="note")  # changes with every delivery: lays out only when its size may
        yield DeckFooter()

    def on_mount(self) -> None:
        self._live: dict[str, dict[str, RunRow]] = {}  # host -> run id -> row, from its latest snapshot
        self._recorded: dict[str, RunRow] = {}  # run id -> row, from the history (or the agents' run lists)
        self._errors: dict[str, str] = {}
        self._history_due = True
        self._history_at = 0.0
        self._history_mark: int | None = None  # the newest history event read (None: read the whole history)
        self._history_total: int | None = None  # the runs the history held when it was read whole (read only past the limit)
        links = deck(self).ops.links
        self.hosts_changed(set(links))
        if deck(self).ops.history_path is not None:
            self.set_interval(0.5, self._maybe_load_history)
            self._maybe_load_history()
        else:
            self.poll_agents()

    # ------------------------------------------------------------------ sources

    def hosts_changed(self, names: set[str]) -> None:
        """Live runs of these hosts, from their snapshots."""
        links = deck(self).ops.links
        touched: set[str] = set()
        for name in names:
            link = links.get(name)
            if link is None:
                continue
            snap = link.status.snapshot if link.status.state == "up" else None
            if snap is None and link.status.state == "up":
                continue
            before = self._live.get(name, {})
            now_rows = {r.id: run_row_from_info(r, name) for r in snap.runs} if snap is not None else {}
            if set(before) - set(now_rows):
                self._history_due = True  # a run ended there: its final state comes with the history
                for rid in set(before) - set(now_rows):
                    if rid not in self._recorded:  # keep showing it until its record arrives
                        self._recorded[rid] = before[rid]
            self._live[name] = now_rows
            touched |= set(before) | set(now_rows)
        if touched:
            self._show(touched)

    def history_changed(self) -> None:
        self._history_due = True

    def _maybe_load_history(self) -> None:
        if self._history_due and self.app.screen is self and time.monotonic() - self._history_at >= HISTORY_MIN_INTERVAL_S:
            self._history_due = False
            self._history_at = time.monotonic()
            self.load_history()

    @work(thread=True, exclusive=True, group="runs-history")
    def load_history(self) -> None:
        """Read the history's newest runs (a thread: SQLite blocks)."""
        path = deck(self).ops.history_path
        if path is None:
            return
        t0 = time.monotonic()
        query = f"limit:{HISTORY_LIMIT}"
        try:
            first = self._history_mark is None
            rows, self._history_mark = runs_changed_since(path, query, self._history_mark)
            loaded = HistoryLoaded(query, rows, seconds=time.monotonic() - t0)
            if first and len(rows) >= HISTORY_LIMIT:  # the history may hold more than the screen reads: how many
                loaded.total = history_run_count(path)
            self.post_message(loaded)
        except Exception as exc:  # a locked or missing file (or a refused filter) must not kill the screen
            self.post_message(HistoryLoaded(query, [], error=f"history: {exc}"))

    @on(HistoryLoaded)
    def _history_loaded(self, message: HistoryLoaded) -> None:
        message.stop()
        if not self.is_attached:
            return
        if message.error:
            self._errors["history"] = message.error
        else:
            self._errors.pop("history", None)
        if message.total is not None:
            self._history_total = message.total
        changed: set[str] = set()
        fresh = merge_rows(run_row_from_history(d) for d in message.rows)
        for rid, row in fresh.items():
            if self._recorded.get(rid) != row:
                self._recorded[rid] = row
                changed.add(rid)
        if changed or message.error:
            self._show(changed, bulk=len(changed) > 200)

    @work(exclusive=True, group="runs-poll")
    async def poll_agents(self) -> None:
        """Without a history: ask every reachable agent for its runs, a few at a time."""
        ops = deck(self).ops
        sem = asyncio.Semaphore(AGENT_POLL_CONCURRENCY)

        async def one(host: str) -> None:
            async with sem:
                listed = await ops.fleet_runs([host], limit=500)  # the same read as `gpudeck runs`
                if host in listed.unanswered:
                    self._errors[host] = listed.unanswered[host]
                    return
                self._errors.pop(host, None)
                runs = [r for _h, r in listed.runs]
                if not self.is_attached:
                    return
                changed = set()
                for r in runs:
                    row = run_row_from_info(r, host)
                    if self._recorded.get(r.id) != row:
                        self._recorded[r.id] = row
                        changed.add(r.id)
                if changed:
                    self._show(changed)

        while True:
            up = [h for h, link in ops.links.items() if link.status.state in ("up", "connecting")]
            await asyncio.gather(*(one(h) for h in up))
            if not self.is_attached:
                return
            self._note()
            await asyncio.sleep(AGENT_POLL_S)

    def action_reload(self) -> None:
        if deck(self).ops.history_path is not None:
            self._history_due = True
            self._history_at = 0.0
            self._maybe_load_history()
        else:
            self.poll_agents()

    def refresh_now(self) -> None:
        """Re-read the run list at once (after a launch or stop)."""
        self.action_reload()

    # ------------------------------------------------------------------ table

    def _row(self, rid: str, live: list[RunRow] | None = None) -> RunRow | None:
        """``rid``'s row: its live rows (``live``, else looked up on every host) merged with its record."""
        if live is None:
            live = [rows[rid] for rows in self._live.values() if rid in rows]
        rec = self._recorded.get(rid)
        if not live:
            return rec
        merged = merge_rows([*live, *([rec] if rec else [])])
        return merged[rid]

    def _show(self, ids: set[str], bulk: bool = False) -> None:
        table = self.query_one("#runs-table", KeyedTable)
        rows: dict[str, dict[str, object]] = {}
        # the live rows of these ids from one pass over the hosts (a lookup per id and host was 4 million at 1,024 hosts
        # and 4,096 runs on the history's first read; issue 33)
        live: dict[str, list[RunRow]] = {}
        for host_rows in self._live.values():
            for rid, r in host_rows.items():
                if rid in ids:
                    live.setdefault(rid, []).append(r)
        for rid in ids:
            row = self._row(rid, live.get(rid, []))
            if row is None:
                table.drop(rid)
                continue
            rows[rid] = run_cells(row)
        if bulk:  # the first read of a large history: the table takes them in one go
            table.upsert_many(rows)
        else:
            for rid, cells in rows.items():
                table.upsert(rid, cells)
        self._note()

    def _note(self) -> None:
        table = self.query_one("#runs-table", KeyedTable)
        live = sum(len(v) for v in self._live.values())
        t = Text(f"{table.total_rows} run(s), {live} live", style="dim")
        if table.filter_text or table.sort_column:
            t.append(f"   {table.describe()}", style="bold")
        if table.row_count == 0 and not self._errors:
            t.append(" — none yet: l launches one (pre-flight first, nothing starts until you confirm)", style="dim")
        if self._history_total is not None and self._history_total > table.total_rows:
            t.append(
                f"; the history holds {self._history_total:,} runs: the newest {table.total_rows:,} are listed here,"
                " older ones: h (History) with until:DATE, or gpudeck history until:DATE",
                style="yellow",
            )
        if self._errors:
            t.append("; " + "; ".join(f"{k}: {v}" for k, v in list(self._errors.items())[:3]), style="red")
        self.query_one("#runs-note", SteadyText).show(t)

    def host_of(self, rid: str) -> str:
        """The host to open a run on."""
        row = self._row(rid)
        return row.host if row is not None else "local"

    def action_open_run(self) -> None:
        rid = self.query_one("#runs-table", KeyedTable).cursor_key
        if rid is not None:
            deck(self).open_run(self.host_of(rid), rid)

    def on_data_table_row_selected(self, event: KeyedTable.RowSelected) -> None:
        rid = str(event.row_key.value)
        deck(self).open_run(self.host_of(rid), rid)

    def on_keyed_table_reordered(self, event: KeyedTable.Reordered) -> None:
        self._note()

    # ------------------------------------------------------------------ actions on the highlighted run

    async def _selected(self) -> tuple[str, RunInfo] | None:
        """The highlighted run as its agent knows it now (else as the history recorded it)."""
        rid = self.query_one("#runs-table", KeyedTable).cursor_key
        if rid is None:
            self.notify("no run is highlighted", severity="warning")
            return None
        host = self.host_of(rid)
        try:
            got = await deck(self).ops.current_run(host, rid)
        except OpsError as exc:
            self.notify(f"{rid}: {exc.message}", title="cannot read the run", severity="error")
            return None
        info = got if isinstance(got, RunInfo) else run_from_record(got)
        if info is None:
            self.notify(
                f"{rid}: its agent cannot say and the history recorded no launch spec", title="cannot read the run", severity="error"
            )
            return None
        return host, info

    def action_stop_run(self) -> None:
        self.stop_selected()

    @work(exclusive=True, group="runs-stop")
    async def stop_selected(self) -> None:
        """Stop the highlighted run: the Run screen's flow (confirmation listing its processes, verified result)."""
        found = await self._selected()
        if found is not None:
            await stop_flow(self, found[0], found[1], self.query_one("#runs-progress", ProgressLine))
            self.refresh_now()

    def action_relaunch(self) -> None:
        self.relaunch_selected()

    @work(exclusive=True, group="runs-relaunch")
    async def relaunch_selected(self) -> None:
        """The launch form filled from the highlighted run (the Run screen's relaunch)."""
        found = await self._selected()
        if found is not None:
            relaunch(self, found[0], found[1])

    def action_tail(self) -> None:
        rid = self.query_one("#runs-table", KeyedTable).cursor_key
        if rid is not None:
            deck(self).open_run(self.host_of(rid), rid)  # the Run screen opens on its output, following the end
