"""Provides the Run screen: live output (batched), the run's facts, and stop with its verification."""

from __future__ import annotations

import asyncio
import shlex
import time

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input, Sparkline, Static

from agents.errors import AgentError
from agents.protocol import RunInfo
from console.fmt import duration, elapsed, when
from console.screens.dialogs import ConfirmDialog, ResultDialog, stop_result_text
from console.widgets.cells import state_text
from console.widgets.output_view import OutputView

FLUSH_S = 0.1  # output reaches the screen in batches, a few times a second at most


def run_header(r: RunInfo) -> Text:
    """The run's facts in two lines."""
    t = Text()
    t.append(f"{r.id}", style="bold")
    if r.name:
        t.append(f" ({r.name})")
    t.append(f" on {r.host}  ")
    t.append_text(state_text(r.state))
    t.append(f"  started {when(r.started)}  elapsed {duration(elapsed(r.started, r.ended))}")
    if r.cause:
        t.append(f"\ncause: {r.cause}", style="red" if r.state in ("failed", "lost") else "")
    t.append(f"\n$ {shlex.join(r.spec.argv)}", style="dim")
    if r.spec.gpus is not None:
        t.append(f"   GPUs {','.join(map(str, r.spec.gpus))}", style="dim")
    return t


class RunScreen(Screen):
    """One run: its output as it comes, and the stop action."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("s", "stop_run", "Stop run"),
        Binding("R", "relaunch", "Relaunch"),
        Binding("f", "toggle_follow", "Follow"),
        Binding("g", "top", "Top"),
        Binding("G", "bottom", "Bottom"),
        Binding("slash", "search", "Search", key_display="/"),
        Binding("n", "next_match", "Next", show=False),
        Binding("N", "prev_match", "Prev", show=False),
    ]

    def __init__(self, host: str, run_id: str) -> None:
        super().__init__()
        self.host = host
        self.run_id = run_id
        self.run: RunInfo | None = None
        self._pending: list[str] = []
        self._match_line: int | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="run-header", classes="run-header")
        with Horizontal(id="metrics"):
            with Vertical(classes="metric"):
                yield Static("loss", id="loss-label", classes="metric-label")
                yield Sparkline([], id="loss-spark")
            with Vertical(classes="metric"):
                yield Static("tokens/s", id="tps-label", classes="metric-label")
                yield Sparkline([], id="tps-spark")
        yield OutputView(id="run-log")
        yield Input(id="run-search", placeholder="search the output (enter: find, esc: close)", classes="search")
        yield Static("", id="run-status", classes="note")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(FLUSH_S, self._flush)
        self.refresh_run()
        self.follow_output()
        self.refresh_metrics()

    @work(exclusive=True, group="run-info")
    async def refresh_run(self) -> None:
        fleet = self.app.fleet  # type: ignore[attr-defined]
        while True:
            try:
                self.run = await fleet.run(self.host, self.run_id)
                self.query_one("#run-header", Static).update(run_header(self.run))
            except AgentError as exc:
                self.query_one("#run-header", Static).update(Text(f"{self.run_id} on {self.host}: {exc.message}", style="red"))
            await asyncio.sleep(1.0)

    @work(exclusive=True, group="run-metrics")
    async def refresh_metrics(self) -> None:
        fleet = self.app.fleet  # type: ignore[attr-defined]
        panel = self.query_one("#metrics")
        panel.display = False
        while True:
            try:
                m = await fleet.metrics(self.host, self.run_id, max_points=200)
            except AgentError:
                m = None
            if m is not None and m.steps:
                panel.display = True
                self._show_series("loss", "#loss-label", "#loss-spark", m.steps, m.loss, "{:.4f}")
                self._show_series("tokens/s", "#tps-label", "#tps-spark", m.steps, m.tokens_per_s, "{:,.0f}")
            ended = self.run is not None and self.run.ended is not None
            await asyncio.sleep(10.0 if ended else 2.0)

    def _show_series(self, name: str, label_id: str, spark_id: str, steps: list[int], values: list[float | None], fmt: str) -> None:
        pts = [(s, v) for s, v in zip(steps, values) if v is not None]
        label = self.query_one(label_id, Static)
        if not pts:
            label.update(Text(f"{name}: not reported", style="dim"))
            return
        data = [v for _, v in pts]
        self.query_one(spark_id, Sparkline).data = data
        label.update(Text.assemble((f"{name} ", "bold"), f"step {pts[-1][0]}: {fmt.format(data[-1])}   min {fmt.format(min(data))}  max {fmt.format(max(data))}"))

    @work(exclusive=True, group="run-output")
    async def follow_output(self) -> None:
        fleet = self.app.fleet  # type: ignore[attr-defined]
        try:
            async for chunk in fleet.output(self.host, self.run_id, offset=0, follow=True):
                if chunk.data:
                    self._pending.append(chunk.data)
            self._pending.append("")
            self.query_one("#run-status", Static).update(Text("— end of output: the run has ended —", style="dim"))
        except AgentError as exc:
            self.query_one("#run-status", Static).update(Text(f"output stream lost: {exc.message}", style="red"))

    def _flush(self) -> None:
        if not self._pending:
            return
        data = "".join(self._pending)
        self._pending.clear()
        self.query_one("#run-log", OutputView).append(data)

    def action_toggle_follow(self) -> None:
        view = self.query_one("#run-log", OutputView)
        view.follow = not view.follow
        if view.follow:
            view.scroll_end(animate=False)
        self.notify(f"follow {'on' if view.follow else 'off'}")

    def action_top(self) -> None:
        view = self.query_one("#run-log", OutputView)
        view.follow = False
        view.scroll_home(animate=False)

    def action_bottom(self) -> None:
        view = self.query_one("#run-log", OutputView)
        view.follow = True
        view.scroll_end(animate=False)

    def action_search(self) -> None:
        box = self.query_one("#run-search", Input)
        box.display = True
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "run-search":
            return
        view = self.query_one("#run-log", OutputView)
        view.search_term = event.value or None
        event.input.display = False
        view.focus()
        if view.search_term:
            if view.follow:  # at the live end: the newest match, searching back
                self._jump(forward=False, start=view.line_count)
            else:  # reading: the next match from the top of the screen down
                self._jump(forward=True, start=view.scroll_offset.y - 1)

    def action_back(self) -> None:
        box = self.query_one("#run-search", Input)
        if box.display:
            box.display = False
            self.query_one("#run-log", OutputView).focus()
        else:
            self.app.pop_screen()

    def action_next_match(self) -> None:
        view = self.query_one("#run-log", OutputView)
        self._jump(forward=True, start=self._match_line if self._match_line is not None else view.scroll_offset.y)

    def action_prev_match(self) -> None:
        view = self.query_one("#run-log", OutputView)
        self._jump(forward=False, start=self._match_line if self._match_line is not None else view.scroll_offset.y)

    @work(exclusive=True, group="run-search", thread=True)
    def _jump(self, forward: bool, start: int) -> None:
        view = self.query_one("#run-log", OutputView)
        if not view.search_term:
            return
        found = view.find(view.search_term, start, forward)
        if found is None:
            self.app.call_from_thread(self.notify, f"{view.search_term!r} not found {'below' if forward else 'above'}")
            return
        self._match_line = found
        self.app.call_from_thread(view.go_to_line, found)

    def action_relaunch(self) -> None:
        self.relaunch_flow()

    @work(exclusive=True, group="run-relaunch")
    async def relaunch_flow(self) -> None:
        from console.screens.launch import LaunchDialog

        if self.run is None:
            return
        req = await self.app.push_screen_wait(LaunchDialog(prefill=self.run.spec, parent=self.run.id, host=self.host))
        if req is None:
            return
        try:
            reply = await self.app.fleet.launch(req.host, req.spec)  # type: ignore[attr-defined]
        except AgentError as exc:
            self.notify(exc.message, title="relaunch failed", severity="error", timeout=15)
            return
        self.notify(f"{reply.run.id} started on {req.host} (relaunch of {self.run.id}, {req.spec.start or 'command'})", title="relaunched")
        self.app.open_run(req.host, reply.run.id)  # type: ignore[attr-defined]

    def action_stop_run(self) -> None:
        self.stop_flow()

    @work(exclusive=True, group="run-stop")
    async def stop_flow(self) -> None:
        r = self.run
        if r is None:
            return
        held = 0
        st = self.app.fleet_status().get(self.host)  # type: ignore[attr-defined]
        if st is not None and st.snapshot is not None:
            held = sum(p.used_bytes or 0 for g in st.snapshot.gpus for p in g.processes if p.run_id == r.id)
        members = [m for m in r.members if m.role != "shim"]
        body = Text()
        body.append(f"Stop run {r.id} on {r.host}?\n\n")
        body.append(f"{len(members)} process(es): SIGTERM now, SIGKILL after 30 s.\n")
        body.append(f"GPU memory they hold: {held / 2**30:.1f} GiB\n" if held else "No GPU memory held by it right now.\n")
        ok = await self.app.push_screen_wait(ConfirmDialog("Stop run", body))
        if not ok:
            return
        status = self.query_one("#run-status", Static)
        t0 = time.monotonic()
        ticker = self.set_interval(0.5, lambda: status.update(Text(f"stopping {r.id} ... {time.monotonic() - t0:.0f} s (grace 30 s)", style="yellow")))
        try:
            res = await self.app.fleet.stop(self.host, r.id, 30.0)  # type: ignore[attr-defined]
        except AgentError as exc:
            ticker.stop()
            status.update(Text(f"stop failed: {exc.message}", style="red"))
            return
        ticker.stop()
        status.update(Text(f"stop finished: {res.message or res.state}", style="green" if not res.survivors else "red"))
        await self.app.push_screen_wait(ResultDialog(f"Stopped {r.id}", stop_result_text(res)))
