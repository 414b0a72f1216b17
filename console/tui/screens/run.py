"""Provides the Run screen: live output (batched), metrics, the run's spec, environment fingerprint,
claims vs observed and alerts; actions stop (with its verification), relaunch and rollback.

The run comes from its agent (``GetRun``, once a second); when the agent
cannot be reached or no longer has it, the history's record stands in, so a
run from the History screen opens even when its host is down.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from rich.console import Group
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Input, Static, TabbedContent, TabPane

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import (
    TERMINAL_STATES,
    Alert,
    EnvFingerprint,
    LaunchSpec,
    PreflightResult,
    RunInfo,
    Snapshot,
    StopResult,
    VerifyReply,
)
from gpudeck.console.core.fmt import duration, elapsed, gib
from gpudeck.console.core.records import RunRecord
from gpudeck.console.core.sanitize import escape_controls, one_line, redact_env, redact_record
from gpudeck.console.ops import OpsError, relaunch_intent
from gpudeck.console.ops.ledger import ledger_query
from gpudeck.console.ops.relaunch import EnvironmentCheck
from gpudeck.console.ops.triage import format_triage
from gpudeck.console.present.ledger import format_ledger
from gpudeck.console.present.views import python_of, run_diff, run_from_record, series_points, series_summary, stamp, stamp_age
from gpudeck.console.tui.messages import RecordLoaded
from gpudeck.console.tui.screens.base import LiveScreen, deck
from gpudeck.console.tui.screens.dialogs import ChoiceDialog, ConfirmDialog, ResultDialog, stop_result_text
from gpudeck.console.tui.screens.launch import preflight_text
from gpudeck.console.tui.widgets.cells import SIMULATED, ok_text, shown, state_text
from gpudeck.console.tui.widgets.diff import diff_summary, diff_table
from gpudeck.console.tui.widgets.footer import DeckFooter
from gpudeck.console.tui.widgets.header import AppHeader
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable
from gpudeck.console.tui.widgets.output_view import OutputView
from gpudeck.console.tui.widgets.plots import MetricPlot, Series
from gpudeck.console.tui.widgets.progress import ProgressLine

FLUSH_S = 0.1  # output reaches the screen in batches, a few times a second at most
FLUSH_MAX_CHARS = 1 << 20  # per batch: 10 MB/s at most (50,000 log lines a second are ~3.5 MB/s)
STOP_GRACE_S = 30.0
STOP_LIST_MAX = 16  # processes the stop confirmation lists by name (the rest are counted)
STOP_CMD_MAX = 60
TABS = ("tab-output", "tab-spec", "tab-env", "tab-claims")
CLAIM_COLUMNS = [
    Col("ok", " ", 1),
    Col("what", "WHAT", 22),
    Col("claimed", "CLAIMED", 16),
    Col("observed", "OBSERVED", 16),
    Col("source", "SOURCE", 26),
    Col("detail", "DETAIL", None),
]
ALERT_COLUMNS = [
    Col("time", "RAISED", 10),
    Col("severity", "SEVERITY", 8),
    Col("kind", "KIND", 16),
    Col("where", "WHERE", 18),
    Col("cleared", "CLEARED", 10),
    Col("message", "MESSAGE", None),
]
PACKAGE_COLUMNS = [Col("name", "PACKAGE", 36), Col("version", "VERSION", None)]


def _fig(v: int | float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:,.1f}"
    n = int(v)
    if abs(n) >= 10**9:
        return f"{n / 10**9:.2f}B"
    if abs(n) >= 10**6:
        return f"{n / 10**6:.1f}M"
    return f"{n:,}"


def run_header(r: RunInfo, simulated: bool = False, host: str | None = None) -> Text:
    """The run's facts in a few lines: who, state, how long, what it is doing, its cause or alerts.

    ``host`` is the console's name for the host; the agent's own name for it follows when it differs.
    """
    t = Text()
    t.append(f"{r.id}", style="bold")
    if r.name:
        t.append(f" ({r.name})")
    where = host or r.host
    t.append(f" on {where}" + (f" ({r.host})" if r.host and r.host != where else "") + "  ")
    if simulated:
        t.append_text(SIMULATED)
        t.append("  ")
    t.append_text(state_text(r.state))
    t.append(f"  started {stamp_age(r.started or r.created)}  elapsed {duration(elapsed(r.started or r.created, r.ended))}")
    tel = r.telemetry
    if tel is not None and tel.step is not None:
        t.append(f"  step {tel.step}")
        if tel.loss is not None:
            t.append(f"  loss {tel.loss:.4f}")
        if tel.tokens_per_s is not None:
            t.append(f"  {tel.tokens_per_s:,.0f} tok/s")
    if r.cause:
        t.append(f"\ncause: {r.cause}", style="bold red" if r.state in ("failed", "lost", "preflight_failed") else "")
    elif r.state in ("starting", "running") and r.spec.kind != "command" and (tel is None or tel.step is None):
        # a trainer spends its first minutes loading the model: say so, with the clock, instead of looking stuck
        what = (
            "waiting for the first step (loading the model, building the optimizer)"
            if tel is None or tel.world_size is None
            else "manifest in, waiting for the first step"
        )
        t.append(f"\n⠿ {what} — {duration(elapsed(r.started or r.created, None))} so far", style="yellow")
    t.append(f"\n$ {shlex.join(r.spec.argv)}", style="dim")
    extras = []
    if r.spec.gpus is not None:
        extras.append(f"GPUs {','.join(map(str, r.spec.gpus))}")
    if r.spec.start:
        extras.append(f"start {r.spec.start}")
    if r.spec.parent:
        extras.append(f"parent {r.spec.parent}")
    if extras:
        t.append("   " + "   ".join(extras), style="dim")
    live = [a for a in r.alerts if a.cleared is None]
    if live and r.state in TERMINAL_STATES:  # what was true while it ran (an idle GPU, a slow rank) is not a warning now
        t.append(f"\n{len(live)} alert(s) while it ran: Claims & alerts (4)", style="dim")
    elif live:
        t.append(f"\n⚠ {len(live)} alert(s): ", style="bold red")
        t.append("; ".join(a.message for a in live[:2])[:300], style="red")
    return t


def spec_text(spec: LaunchSpec, preflight: PreflightResult | None, stop: StopResult | None, host: str) -> Group:
    """The Spec tab: every field of the launch spec, its pre-flight, the verified stop."""
    t = Text()
    rows: list[tuple[str, str]] = [
        ("kind", spec.kind),
        ("argv", shlex.join(spec.argv)),
        ("GPUs", ",".join(map(str, spec.gpus)) if spec.gpus is not None else "not set (CUDA_VISIBLE_DEVICES left alone)"),
        ("start", spec.start or ("-" if spec.kind == "command" else "NOT GIVEN")),
        ("python", spec.python or "-"),
        ("cwd", spec.cwd or "-"),
        ("checkpoints", spec.checkpoint_dir or "-"),
        ("env", " ".join(f"{k}={v}" for k, v in sorted((redact_env(spec.env) or {}).items())) or "-"),
        ("parent", spec.parent or "-"),
        ("operator", spec.operator or "-"),
        ("rank death", spec.on_rank_death),
    ]
    if spec.need_gib is not None:
        rows.append(("needs", f"{spec.need_gib:g} GiB per GPU"))
    if spec.expected_ranks is not None:
        rows.append(("ranks", str(spec.expected_ranks)))
    if spec.force:
        rows.append(("forced", "yes: launched past GPU holders (recorded)"))
    if spec.nodes:
        rows.append(("nodes", f"{', '.join(spec.nodes)} (node rank {spec.node_rank} of {spec.nnodes})"))
    if spec.claims is not None:
        c = spec.claims
        claimed = [
            f"{k} {v}"
            for k, v in (
                ("GPUs", c.gpus),
                ("params", c.params),
                ("world size", c.world_size),
                ("tokens/s", c.tokens_per_s),
                ("samples", c.dataset_samples),
            )
            if v is not None
        ]
        rows.append(("claims", ", ".join(claimed) + (f" — {c.note}" if c.note else "")))
    for k, v in rows:
        t.append(f"{k:<12}", style="bold")
        t.append(f"{v}\n", style="bold red" if v == "NOT GIVEN" else "")
    parts: list[Any] = [shown(t)]
    if preflight is not None:
        parts.append(Text("\npre-flight at launch", style="bold underline"))
        parts.append(preflight_text(preflight, None, host))
    if stop is not None:
        parts.append(Text("\nverified stop", style="bold underline"))
        parts.append(stop_result_text(stop))
    return Group(*parts)


def env_text(env: EnvFingerprint | None, why_none: str = "") -> Text:
    """The Environment tab's summary: the fields that decide whether a known-good configuration still works."""
    if env is None:
        return Text(
            "No environment fingerprint recorded for this run"
            + (f" ({why_none})" if why_none else " (it was launched before fingerprints were taken, or the agent has not sent it yet)"),
            style="yellow",
        )
    t = Text()
    core = [
        ("python", env.python_version),
        ("interpreter", env.python),
        ("environment", env.prefix),
        ("torch", env.torch),
        ("CUDA build", env.torch_cuda or ("none (CPU build)" if env.torch else None)),
        ("torch git", env.torch_git),
        ("NCCL", env.nccl),
        ("cuDNN", env.cudnn),
        ("transformers", env.transformers),
        ("driver", env.driver),
    ]
    for k, v in core:
        t.append(f"{k:<13}", style="bold")
        t.append(f"{v or '-'}\n")
    t.append(f"{'packages':<13}", style="bold")
    t.append(f"{len(env.packages)} installed, freeze sha256 {env.freeze_hash[:16] or '-'}, taken {stamp_age(env.taken)}\n")
    if env.error:
        t.append(f"incomplete: {env.error}\n", style="yellow")
    return t


class RunScreen(LiveScreen):
    """One run: its output as it comes, its facts, and the stop / relaunch / rollback actions."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("s", "stop_run", "Stop", tooltip="SIGTERM every process, grace, SIGKILL, then verify GPU memory came back"),
        Binding("R", "relaunch", "Relaunch", tooltip="the launch form filled from this run; choose the start again"),
        Binding("b", "rollback", "Roll back", tooltip="relaunch with a known-good run's environment (diff shown first)"),
        Binding("v", "verify", "Verify", tooltip="claimed vs observed: parameters, world size, GPUs, dataset, tokens/s"),
        Binding(
            "T", "triage", "Triage", tooltip="every rank's stacks, state, CPU and GPU now, and the likely culprit (nothing is stopped)"
        ),
        Binding("w", "run_ledger", "GPUs held", tooltip="the GPU ledger: every GPU this run held on this host, peak, for how long"),
        Binding("f", "toggle_follow", "Follow"),
        Binding("g", "top", "Top"),
        Binding("G", "bottom", "Bottom"),
        Binding("slash", "search", "Search", key_display="/"),
        Binding("n", "next_match", "Next", show=False),
        Binding("N", "prev_match", "Prev", show=False),
        Binding("1", "tab('tab-output')", "Output", show=False),
        Binding("2", "tab('tab-spec')", "Spec", show=False),
        Binding("3", "tab('tab-env')", "Environment", show=False),
        Binding("4", "tab('tab-claims')", "Claims & alerts", show=False),
    ]

    def __init__(self, host: str, run_id: str, run: RunInfo | None = None) -> None:
        super().__init__()
        self.host = host
        self.run_id = run_id
        self.run: RunInfo | None = run  # what the launch reply said, until the agent is asked
        self.record: RunRecord | None = None  # the history's record (full), when there is a history
        self.verify_reply: VerifyReply | None = None
        self.agent_error: str | None = None
        self._pending: list[str] = []
        self._output_ended = False
        self._status_used = False  # the status line holds an operation's outcome (stop, rollback): output notes keep off it
        self._waiting_note = -1  # the second the 'no output yet' note last showed (-1: not showing)
        self._opened = time.monotonic()
        self._match_line: int | None = None
        self._shown_spec: bytes | None = None
        self._shown_env: bytes | None = None

    def compose(self) -> ComposeResult:
        yield AppHeader()
        yield Static(Text(f"{self.run_id} on {self.host}: asking its agent ...", style="dim"), id="run-header", classes="run-header")
        with TabbedContent(initial="tab-output", id="run-tabs"):
            with TabPane("Output (1)", id="tab-output"):
                with Horizontal(id="metrics"):
                    with Vertical(classes="metric"):
                        yield Static("loss", id="loss-label", classes="metric-label")
                        yield MetricPlot(id="loss-plot")
                    with Vertical(classes="metric"):
                        yield Static("tokens/s", id="tps-label", classes="metric-label")
                        yield MetricPlot(id="tps-plot")
                yield OutputView(id="run-log")
                yield Input(id="run-search", placeholder="search the output (enter: find, esc: close)", classes="search")
            with TabPane("Spec (2)", id="tab-spec"):
                with VerticalScroll():
                    yield Static("", id="run-spec")
            with TabPane("Environment (3)", id="tab-env"):
                yield Static("", id="run-env", classes="env-summary")
                yield KeyedTable(PACKAGE_COLUMNS, id="env-packages")
            with TabPane("Claims & alerts (4)", id="tab-claims"):
                yield Static("claimed vs observed (v: check again)", classes="subtitle")
                yield KeyedTable(CLAIM_COLUMNS, id="claims-table", zebra_stripes=False)
                yield Static("", id="claims-note", classes="note")
                yield Static("alerts", classes="subtitle")
                yield KeyedTable(ALERT_COLUMNS, id="alerts-table")
                yield Static("triage (T: gather one now)", classes="subtitle")
                with VerticalScroll(id="triage-scroll"):
                    yield Static("", id="triage-text")
        yield ProgressLine(id="run-status")
        yield DeckFooter()

    def on_mount(self) -> None:
        self.set_interval(FLUSH_S, self._flush)
        self.query_one("#run-log", OutputView).focus()
        if self.run is not None:
            self._show_facts()
        self.refresh_run()
        self.follow_output()
        self.refresh_metrics()
        self.load_record()
        self.verify()

    # ------------------------------------------------------------------ facts

    def _simulated(self) -> bool:
        link = deck(self).ops.links.get(self.host)
        snap = link.status.snapshot if link is not None else None
        return bool(snap is not None and snap.simulated)

    @work(exclusive=True, group="run-info")
    async def refresh_run(self) -> None:
        """Ask the agent for the run once a second (what the header and tabs show)."""
        ops = deck(self).ops
        while True:
            try:
                run = await ops.run(self.host, self.run_id)
                self.agent_error = None
                ended_now = self.run is not None and self.run.state not in TERMINAL_STATES and run.state in TERMINAL_STATES
                self.run = run
                if ended_now:
                    self.load_record()  # the final cause and stop result come into the history too
            except AgentError as exc:
                self.agent_error = exc.message
                if self.record is not None and self.run is None:
                    self.run = run_from_record(self.record)
            if not self.is_attached:
                return  # the screen was closed while the agent answered
            self._show_facts()
            await asyncio.sleep(1.0)

    @work(thread=True, exclusive=True, group="run-record")
    def load_record(self) -> None:
        """The history's row of this run (a thread: SQLite blocks)."""
        ops = deck(self).ops
        if ops.history is None:
            return
        try:
            rec = ops.find_now(self.run_id, self.host)
            self.post_message(RecordLoaded(self.host, self.run_id, rec))
        except Exception as exc:  # HistoryError: not recorded (yet); anything else is shown, not raised
            self.post_message(RecordLoaded(self.host, self.run_id, None, str(exc)))

    @on(RecordLoaded)
    def _record_loaded(self, message: RecordLoaded) -> None:
        if message.run_id != self.run_id or not self.is_attached:
            return
        self.record = message.record
        if self.run is None and self.record is not None:
            self.run = run_from_record(self.record)
        self._show_facts()

    def _env(self) -> EnvFingerprint | None:
        if self.run is not None and self.run.env is not None:
            return self.run.env
        return self.record.env_fingerprint() if self.record else None

    def _alerts(self) -> list[Alert]:
        seen: dict[tuple[str, float], Alert] = {}
        for a in [
            *(self.run.alerts if self.run else []),
            *(self.record.alert_list() if self.record else []),
            *(self.verify_reply.alerts if self.verify_reply else []),
        ]:
            seen.setdefault((a.kind, a.ts), a)
        return sorted(seen.values(), key=lambda a: a.ts, reverse=True)

    def _show_facts(self) -> None:
        header = self.query_one("#run-header", Static)
        r = self.run
        if r is None:
            header.update(
                Text(
                    f"{self.run_id} on {self.host}: {self.agent_error or 'asking its agent ...'}",
                    style="red" if self.agent_error else "dim",
                )
            )
            return
        t = run_header(r, self._simulated(), self.host)
        if self.agent_error:
            t.append(f"\nits agent cannot say now ({self.agent_error}): showing the history's record", style="yellow")
        header.update(shown(t))
        rec = self.record
        spec_key = msgspec.json.encode([r.spec, r.preflight, rec.stop if rec else None, rec.preflight if rec else None])
        if spec_key != self._shown_spec:
            self._shown_spec = spec_key
            pre = r.preflight
            if pre is None and rec is not None:
                pre = rec.preflight_result()
            self.query_one("#run-spec", Static).update(spec_text(r.spec, pre, rec.stop_result() if rec else None, self.host))
        env = self._env()
        env_key = msgspec.json.encode(env)
        if env_key != self._shown_env:
            self._shown_env = env_key
            plain = r.spec.kind == "command" and python_of(r.spec) is None
            self.query_one("#run-env", Static).update(
                shown(env_text(env, "a plain command: no python environment to fingerprint" if plain else ""))
            )
            pkgs = self.query_one("#env-packages", KeyedTable)
            pkgs.display = env is not None and bool(env.packages)
            if env is not None:
                pkgs.sync({name: {"name": name, "version": ver} for name, ver in sorted(env.packages.items())})
        self._show_alerts()

    def _show_alerts(self) -> None:
        rows: dict[str, dict[str, object]] = {}
        for a in self._alerts():
            where = (
                ", ".join(
                    x
                    for x in (
                        f"rank {a.rank}" if a.rank is not None else "",
                        f"GPU {a.gpu}" if a.gpu is not None else "",
                        f"pid {a.pid}" if a.pid is not None else "",
                    )
                    if x
                )
                or "-"
            )
            rows[f"{a.kind}:{a.ts}"] = {
                "time": stamp(a.ts),
                "severity": Text(a.severity, style="bold red" if a.severity == "critical" else "yellow"),
                "kind": a.kind.replace("_", " "),
                "where": where,
                "message": Text(a.message, style="" if a.cleared else "red"),
                "cleared": stamp(a.cleared) if a.cleared else Text("active", style="bold red"),
            }
        self.query_one("#alerts-table", KeyedTable).sync(rows)

    def action_verify(self) -> None:
        self.verify()
        self.action_tab("tab-claims")

    def action_triage(self) -> None:
        self.triage()
        self.action_tab("tab-claims")

    @work(exclusive=True, group="run-ledger")
    async def action_run_ledger(self) -> None:
        """The run's GPU footprint over its life on this host (``gpudeck ledger HOST --run RUN``), as a timeline."""
        try:
            answer = await deck(self).ops.ledger(ledger_query(self.host, run=self.run_id))
        except OpsError as exc:
            self.notify(escape_controls(exc.message), severity="error")
            return
        if self.is_attached:
            title = f"GPU ledger: run {self.run_id} on {self.host}"
            self.app.push_screen(ResultDialog(title, Text(escape_controls(format_ledger(answer), keep="\n"))))

    @work(exclusive=True, group="run-triage")
    async def triage(self) -> None:
        """Every node's triage of the run now (``gpudeck triage``'s operation), shown as text: never parsed as markup."""
        box = self.query_one("#triage-text", Static)
        if self.run is None:
            box.update(Text("the run is not known yet", style="yellow"))
            return
        box.update(Text("gathering every rank's stacks, state, CPU and GPU (up to 30 s) ...", style="dim"))
        ops = deck(self).ops
        try:
            got, failed = await ops.triage(await ops.nodes_of(self.host, self.run))
        except (AgentError, OpsError) as exc:
            if self.is_attached:
                box.update(Text(f"no triage: {exc.message}", style="bold red"))
            return
        if not self.is_attached:
            return
        body = Text(escape_controls("\n\n".join(format_triage(t, h) for h, t in got), keep="\n"))
        for h, why in failed:
            body.append(f"\n{h}: no triage: {escape_controls(why)}", style="bold red")
        box.update(body)

    @work(exclusive=True, group="run-verify")
    async def verify(self) -> None:
        """Claimed vs observed, from the agent (which sees the manifest and which GPUs the pids hold)."""
        note = self.query_one("#claims-note", Static)
        note.update(Text("asking the agent to check the claims ...", style="dim"))
        try:
            reply = await deck(self).ops.verify(self.host, self.run_id)
        except AgentError as exc:
            if self.is_attached:
                note.update(Text(f"claims could not be checked: {exc.message}", style="yellow"))
            return
        if not self.is_attached:
            return
        self.verify_reply = reply
        rows: dict[str, dict[str, object]] = {}
        for i, c in enumerate(reply.rows):
            style = "bold red" if c.ok is False else ""
            rows[f"{i}:{c.what}"] = {
                "ok": ok_text(c.ok),
                "what": Text(c.what, style=style),
                "claimed": Text(_fig(c.claimed), style=style),
                "observed": Text(_fig(c.observed), style=style),
                "source": c.source or "-",
                "detail": c.detail or "",
            }
        self.query_one("#claims-table", KeyedTable).sync(rows)
        bad = [c.what for c in reply.rows if c.ok is False]
        if bad:
            note.update(Text(f"claims differ from what is observed: {', '.join(bad)}", style="bold red"))
        elif not any(c.ok for c in reply.rows):
            note.update(
                Text(
                    "nothing to check: this run claims nothing (claims come from its spec, its --gpus and a size in its name such as 'llama-1b')",
                    style="dim",
                )
            )
        else:
            note.update(Text("every claim that can be checked matches what is observed", style="green"))
        self._show_alerts()

    # ------------------------------------------------------------------ metrics and output

    @work(exclusive=True, group="run-metrics")
    async def refresh_metrics(self) -> None:
        ops = deck(self).ops
        panel = self.query_one("#metrics")
        panel.display = False
        while True:
            series = await ops.metrics(self.host, self.run_id, max_points=200)  # the agent's, else the history's
            steps, loss, tps = series.steps, series.loss, series.tokens_per_s
            if not self.is_attached:
                return
            if steps:
                panel.display = True
                self._show_series("loss", "#loss-label", "#loss-plot", steps, loss)
                self._show_series("tokens/s", "#tps-label", "#tps-plot", steps, tps)
            ended = self.run is not None and self.run.ended is not None
            await asyncio.sleep(10.0 if ended else 2.0)

    def _show_series(self, name: str, label_id: str, plot_id: str, steps: list[int], values: list[float | None]) -> None:
        """One figure's plot and label (present.views.series_summary: what `gpudeck metrics` prints)."""
        summary = series_summary(name, steps, values)
        label = self.query_one(label_id, Static)
        if summary is None:
            label.update(Text(f"{name}: not reported", style="dim"))
            return
        pts = series_points(steps, values)
        self.query_one(plot_id, MetricPlot).show([Series(name, [float(s) for s, _ in pts], [v for _, v in pts])], xlabel="step")
        label.update(Text.assemble((f"{name} ", "bold"), summary.text()))

    @work(exclusive=True, group="run-output")
    async def follow_output(self) -> None:
        ops = deck(self).ops
        status = self.query_one("#run-status", ProgressLine)
        try:
            async for chunk in ops.output(self.host, self.run_id, offset=0, follow=True):
                if chunk.data:
                    self._pending.append(chunk.data)
            self._pending.append("")
            self._output_ended = True
            if self.is_attached and not status.running and not self._status_used:
                status.update(Text("— end of output: the run has ended —", style="dim"))
        except AgentError as exc:
            if self.is_attached and not status.running and not self._status_used:
                status.update(Text(f"output stream lost: {exc.message}", style="red"))

    def _flush(self) -> None:
        if not self.is_attached:
            return
        if not self._pending:
            self._note_no_output()
            return
        data = "".join(self._pending)
        self._pending.clear()
        if len(data) > FLUSH_MAX_CHARS:
            # catching up on a backlog: a bounded slice per tick keeps every tick short (keys stay responsive)
            self._pending.append(data[FLUSH_MAX_CHARS:])
            data = data[:FLUSH_MAX_CHARS]
        self.query_one("#run-log", OutputView).append(data)
        if self._waiting_note >= 0 and data:
            self._waiting_note = -1
            self.query_one("#run-status", ProgressLine).update("")

    def _note_no_output(self) -> None:
        """A run that has printed nothing says so (sleep 600 looks like a broken screen otherwise)."""
        status = self.query_one("#run-status", ProgressLine)
        waited = int(time.monotonic() - self._opened)
        if self._output_ended or self._status_used or status.running or waited < 2 or waited == self._waiting_note:
            return
        if self.query_one("#run-log", OutputView).bytes_received == 0:
            self._waiting_note = waited
            status.update(Text(f"no output yet: the run has written nothing to its stdout or stderr ({waited} s)", style="dim"))

    def action_tab(self, tab: str) -> None:
        self.query_one("#run-tabs", TabbedContent).active = tab
        if tab == "tab-output":
            self.query_one("#run-log", OutputView).focus()

    def action_toggle_follow(self) -> None:
        view = self.query_one("#run-log", OutputView)
        if view.follow:
            view.follow = False
        else:
            view.go_bottom()
        self.notify(f"follow {'on' if view.follow else 'off'}")

    def action_top(self) -> None:
        self.query_one("#run-log", OutputView).go_top()

    def action_bottom(self) -> None:
        self.query_one("#run-log", OutputView).go_bottom()

    def action_search(self) -> None:
        tabs = self.query_one("#run-tabs", TabbedContent)
        if tabs.active != "tab-output":
            tabs.active = "tab-output"
        box = self.query_one("#run-search", Input)
        box.display = True
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "run-search":
            return
        view = self.query_one("#run-log", OutputView)
        view.search_term = event.value or None
        view.current_match = None
        self._match_line = None
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
        found = view.find_wrapping(view.search_term, start, forward)
        if found is None:
            self.app.call_from_thread(self.notify, f"{view.search_term!r} not found", severity="warning")
            return
        line, wrapped = found
        self._match_line = line
        self.app.call_from_thread(view.show_match, line)
        if wrapped:
            self.app.call_from_thread(self.notify, f"search wrapped to the {'top' if forward else 'bottom'}: line {line + 1}")

    # ------------------------------------------------------------------ relaunch and rollback

    def action_relaunch(self) -> None:
        if self.run is None:
            self.notify("the run is not known yet", severity="warning")
            return
        relaunch(self, self.host, self.run)

    def action_rollback(self) -> None:
        self.rollback_flow()

    @work(exclusive=True, group="run-rollback")
    async def rollback_flow(self) -> None:
        """Pick a known-good run, read the diff, then ``ops.prepare_rollback`` (its environment proved or rebuilt) and
        the launch form with an explicit start: the same flow as ``gpudeck rollback``."""
        from gpudeck.console.tui.screens.picker import RunPicker

        if self.run is None:
            self.notify("the run is not known yet", severity="warning")
            return
        run = self.run
        ops = deck(self).ops
        try:
            candidates = await ops.rollback_candidates(self.host, run)
        except OpsError as exc:
            self.notify(exc.message, title="no runs to roll back to", severity="error")
            return
        if not candidates:
            self.notify(f"no ended {run.spec.kind} run to roll back to", severity="warning")
            return
        pick = await self.app.push_screen_wait(
            RunPicker(f"Roll back {run.id}: pick the known-good run", "succeeded runs first; enter picks, esc cancels", candidates)
        )
        if pick is None:
            return
        try:
            # the same records and step metrics as History -> Diff and `gpudeck diff` (ops.compare)
            pair = await ops.compare_runs((self.host, run.id), (pick.host, pick.id), live_a=run)
        except OpsError as exc:
            self.notify(exc.message, title=f"cannot read {pick.id}", severity="error")
            return
        cur, good = redact_record(pair.a), pair.b
        diff = run_diff(cur, redact_record(good), pair.a_metrics, pair.b_metrics)
        body = Group(diff_summary(diff), Text(""), diff_table(diff, cur.label(), good.label(), only_differences=True, limit=30))
        how = await self.app.push_screen_wait(
            ChoiceDialog(
                f"Roll back {run.id} to {good.id}",
                body,
                [("env", "Its environment, this run's config", "e"), ("all", "Its environment and config", "c")],
            )
        )
        if how is None:
            return
        self._status_used = True
        try:
            intent = await ops.prepare_rollback(
                run.spec,
                run.id,
                good,
                self.host,
                None,
                how == "all",
                _ScreenRollback(self, self.query_one("#run-status", ProgressLine)),
            )
        except OpsError as exc:
            self.query_one("#run-status", ProgressLine).finish(exc.message.split("\n", 1)[0], style="bold red")
            await self.app.push_screen_wait(ResultDialog("Not rolled back", Text(f"{exc.message}\n\nnothing was started", style="red")))
            return
        deck(self).launch_flow(
            prefill=intent,
            host=self.host,
            title=f"Roll back {run.id} to {good.id}'s environment{' and config' if how == 'all' else ''}: choose the start",
        )

    # ------------------------------------------------------------------ stop

    def action_stop_run(self) -> None:
        self.stop_flow()

    @work(exclusive=True, group="run-stop")
    async def stop_flow(self) -> None:
        if self.run is None:
            return
        self._status_used = True
        await stop_flow(self, self.host, self.run, self.query_one("#run-status", ProgressLine))


class _ScreenRollback:
    """The Run screen's answers to the rollback flow: steps on its status line, the rebuild asked in a dialog."""

    TONES = {"ok": "green", "warn": "bold yellow", "error": "bold red", "info": ""}

    def __init__(self, screen: Screen[Any], status: ProgressLine) -> None:
        self.screen, self.status = screen, status

    def say(self, text: str, tone: str = "info") -> None:
        self.status.finish(text, style=self.TONES.get(tone, ""))

    @contextmanager
    def waiting(self, text: str, detail: str = "") -> Iterator[None]:
        self.status.start(text, detail)
        yield

    async def rebuild(self, good_id: str, host: str, check: EnvironmentCheck) -> bool:
        self.status.finish(f"{one_line(check.python)} changed since {good_id}: {len(check.changes)} difference(s)", style="bold yellow")
        lines = "\n".join(one_line(line) for line in check.describe(20))  # package names and paths: the run's record
        dialog = ConfirmDialog(
            "The good environment changed",
            Text(
                f"{one_line(check.python)} no longer matches what the good run recorded:\n\n{lines}\n\nRebuild it from the recorded pip "
                "freeze into a new virtual environment (minutes; the result is checked against the record)? Nothing starts in "
                "the changed one."
            ),
            "Rebuild it",
        )
        ok = await self.screen.app.push_screen_wait(dialog)
        return bool(ok)


def _same_start(a: float | None, b: float | None) -> bool:
    """Whether two readings of a process's start time are the same process (not a reused pid); unknown counts as same."""
    return a is None or b is None or abs(a - b) < 1.0


def stop_confirm_text(r: RunInfo, host: str, snap: Snapshot | None) -> Text:
    """What the stop confirmation says: the processes it will signal (pid, user, rank, command) and the memory they hold."""
    procs = {p.pid: p for g in snap.gpus for p in g.processes} if snap is not None else {}
    # a member's user: from the snapshot's process rows (every live member is there, on a GPU or not), else its GPU process
    users = {p.pid: p.user for p in snap.processes if p.user} if snap is not None else {}
    users.update({pid: p.user for pid, p in procs.items() if p.user and pid not in users})
    held = sum(p.used_bytes or 0 for g in (snap.gpus if snap is not None else []) for p in g.processes if p.run_id == r.id)
    members = [m for m in r.members if m.role != "shim"]
    body = Text()
    body.append(f"Stop run {r.id} on {host}?\n\n")
    if r.state in TERMINAL_STATES:
        # an ended run's recorded members are mostly dead: list only those the host's last snapshot still sees
        seen: dict[int, float | None] = {
            p.pid: None for g in (snap.gpus if snap is not None else []) for p in g.processes if p.run_id == r.id
        }
        seen.update({p.pid: p.create_time for p in (snap.processes if snap is not None else [])})
        members = [m for m in members if m.pid in seen and _same_start(seen[m.pid], m.create_time)]
        body.append(f"It has ended ({r.state}); this stops whatever of it is still alive (orphans).\n", style="yellow")
        if not members:
            body.append(
                "None of its processes is alive in the host's last snapshot: nothing is to be signalled (the agent checks again).\n"
            )
            return body
    body.append(f"{len(members)} process(es): SIGTERM now, SIGKILL after {STOP_GRACE_S:.0f} s.\n")
    if members:
        body.append(f"\n{'PID':>8}  {'USER':<10} {'RANK':>4}  COMMAND\n", style="bold")
        for m in members[:STOP_LIST_MAX]:
            user = users.get(m.pid) or "-"
            rank = "-" if m.rank is None else str(m.rank)
            body.append(f"{m.pid:>8}  {one_line(user, 10):<10} {rank:>4}  ")
            body.append(escape_controls(shlex.join(m.cmdline))[:STOP_CMD_MAX] or "-", style="dim")
            body.append("\n")
        if len(members) > STOP_LIST_MAX:
            body.append(f"… and {len(members) - STOP_LIST_MAX} more\n", style="dim")
        body.append("\n")
    body.append(f"GPU memory they hold: {gib(held)} GiB\n" if held else "No GPU memory held by it right now.\n")
    return body


async def stop_flow(screen: Screen[Any], host: str, r: RunInfo, status: ProgressLine) -> None:
    """Confirm (listing the processes), stop the run through ``ops.stop`` (every node of a multi-node run), show the
    verified result: the one stop flow of the Run and Runs screens."""
    ops = deck(screen).ops
    link = ops.links.get(host)
    snap = link.status.snapshot if link is not None else None
    ok = await screen.app.push_screen_wait(ConfirmDialog("Stop run", stop_confirm_text(r, host, snap)))
    if not ok:
        return
    status.start(f"stopping {r.id}: SIGTERM sent", f"grace {STOP_GRACE_S:.0f} s for the checkpoint, then SIGKILL, then NVML verifies")
    try:
        # every node of the run (a multi-node run is stopped on each host), as `gpudeck stop` does
        found = await ops.nodes_of(host, r)
        done = await ops.stop(found, STOP_GRACE_S)
    except (AgentError, OpsError) as exc:
        status.finish(f"stop failed: {exc.message}", style="bold red")
        return
    if not done.results:
        status.finish(f"{', '.join(done.pending)} did not answer: the stop is recorded and delivered when it is back", style="bold yellow")
        return
    res = done.results[0][1]
    more = f"; {', '.join(done.pending)} did not answer: its stop is recorded for later" if done.pending else ""
    status.finish(
        f"stop finished in {res.seconds:.1f} s: {res.message or res.state}{more}", style="green" if not done.survivors else "bold red"
    )
    body = Text()
    for i, (h, one) in enumerate(done.results):
        if len(done.results) > 1:
            body.append(("\n" if i else "") + f"[{h}]\n", style="bold")
        body.append_text(stop_result_text(one))
    await screen.app.push_screen_wait(ResultDialog(f"Stopped {r.id}", body))


def relaunch(screen: Screen[Any], host: str, r: RunInfo) -> None:
    """The launch form filled from ``r`` (``ops.relaunch_intent``): the one relaunch of the Run and Runs screens."""
    deck(screen).launch_flow(prefill=relaunch_intent(r.spec, r.id, host, None), host=host)
