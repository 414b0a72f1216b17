"""Provides the console's view models: what a table row or a diff shows, computed from snapshots and history rows.

Everything here is plain Python (no Textual), so it is tested on its own and
the screens stay thin: a screen turns these records into cells. Times go
through :func:`now`, which reads ``gpudeck.console.core.fmt``'s clock, so a test that pins
that clock pins every figure on screen.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast, get_args

from gpudeck.agents.wire import envdiff
from gpudeck.agents.wire.protocol import (
    TERMINAL_STATES,
    Alert,
    EnvFingerprint,
    Gpu,
    GpuProcess,
    LaunchSpec,
    RunInfo,
    RunState,
    Snapshot,
    UnaccountedMemory,
)
from gpudeck.console.core import fmt
from gpudeck.console.core.records import MetricPoint, Recorded, RunRecord
from gpudeck.console.ops.figures import run_figures
from gpudeck.console.present.rundiff import Row, RunDiff, diff_runs

LEFTOVER_HOLDERS = frozenset({"STALE", "FOREIGN", "NO_SUCH_PROCESS"})
ALERT_HOLDERS = frozenset({"STALE", "NO_SUCH_PROCESS"})  # a FOREIGN holder is someone's notebook, not a fault


def now() -> float:
    """The console's clock (``gpudeck.console.core.fmt``'s, so tests pin one clock for every screen)."""
    return fmt.time.time()


def stamp(ts: float | None) -> str:
    """The console's one way to show a time: '21:22:05' today, 'Nov 28 21:22' another day this year,
    '2025-11-28' before ('-' for none). Local time, as the operator's clock reads."""
    if not ts:
        return "-"
    t = dt.datetime.fromtimestamp(ts)
    today = dt.datetime.fromtimestamp(now()).date()
    if t.date() == today:
        return t.strftime("%H:%M:%S")
    if t.year == today.year:
        return t.strftime("%b %d %H:%M")
    return t.strftime("%Y-%m-%d")


def age(ts: float | None) -> str:
    """How long ago, where a relative age reads better than a time: '12s ago', '5m ago', '3h ago', '4d ago'."""
    if not ts:
        return "-"
    s = max(0, int(now() - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit} ago"
    return f"{s}s ago"


def stamp_age(ts: float | None) -> str:
    """Both: 'Nov 28 21:22 (3h ago)'."""
    return "-" if not ts else f"{stamp(ts)} ({age(ts)})"


def since(ts: float | None) -> str:
    """How long ago, without the word, to the second: '5m00s' (a count that ticks on screen)."""
    return fmt.duration(now() - ts) if ts else "-"


# ----------------------------------------------------------------------------- hosts


@dataclass(frozen=True)
class HostFigures:
    """One host's GPU totals and its problems, from its latest snapshot."""

    gpus: int = 0
    busy: int = 0
    used: int = 0
    total: int = 0
    util: float | None = None
    runs: int = 0
    alerts: tuple[str, ...] = ()
    critical: bool = False


def active_alerts(alerts: Iterable[Alert]) -> list[Alert]:
    """Alerts not cleared yet, newest first."""
    return sorted((a for a in alerts if a.cleared is None), key=lambda a: a.ts, reverse=True)


def host_figures(snap: Snapshot) -> HostFigures:
    """Totals and alerts of one snapshot: live-run alerts first, then STALE / ghost GPU holders."""
    gpus = snap.gpus
    utils = [g.util_gpu for g in gpus if g.util_gpu is not None]
    alerts: list[str] = []
    critical = False
    run_alerts = [(r, a) for r in snap.runs for a in active_alerts(r.alerts)]
    run_alerts.sort(key=lambda ra: ra[1].severity != "critical")  # critical first: the column is read left to right
    for r, a in run_alerts:
        alerts.append(f"{r.name or r.id}: {a.kind.replace('_', ' ')}")
        critical = critical or a.severity == "critical"
    stale = [p for g in gpus for p in g.processes if p.attribution in ALERT_HOLDERS]
    if stale:
        held = sum(p.used_bytes or 0 for p in stale)
        alerts.insert(0, f"{len(stale)} stale GPU holder(s) {fmt.gib(held)} GiB")
    hidden = unaccounted_holders(snap.unaccounted)
    if hidden:
        alerts.insert(0, f"{fmt.gib(sum(u.used_bytes for u in hidden))} GiB unaccounted on GPU {','.join(str(u.gpu) for u in hidden)}")
    return HostFigures(
        gpus=len(gpus),
        busy=sum(1 for g in gpus if g.processes),
        used=sum(g.memory_used for g in gpus),
        total=sum(g.memory_total for g in gpus),
        util=(sum(utils) / len(utils)) if utils else None,
        runs=len(snap.runs),
        alerts=tuple(alerts),
        critical=critical,
    )


def unaccounted_holders(items: Iterable[UnaccountedMemory]) -> list[UnaccountedMemory]:
    """The entries the agent counts as holders (over its threshold, every listed process's memory reported)."""
    return [u for u in items if u.holder]


def unaccounted_line(u: UnaccountedMemory) -> str:
    """One line for memory no visible process explains: the GiB, the GPU, and the agent's note (where, what to do)."""
    return f"GPU {u.gpu}: {fmt.gib(u.used_bytes)} GiB UNACCOUNTED, {u.note}"


def holder_label(p: GpuProcess) -> str:
    """Who a GPU process is, in a few words: 'RUN r-7f3a rank 0', 'STALE r-1b2c', 'FOREIGN bob'."""
    who = p.attribution.replace("_", " ")
    if p.run_id:
        who += f" {p.run_id}"
        if p.rank is not None:
            who += f" rank {p.rank}"
    elif p.user:
        who += f" {p.user}"
    return who


# ----------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunRow:
    """One run as the Runs and History tables show it, from a live snapshot or a history row."""

    id: str
    hosts: tuple[str, ...]
    state: str
    kind: str = "command"
    name: str | None = None
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    tps_history: tuple[float, ...] = ()
    created: float = 0.0
    started: float | None = None
    ended: float | None = None
    cause: str | None = None
    alerts: tuple[str, ...] = ()
    critical: bool = False
    torch: str | None = None
    parent: str | None = None
    live: bool = False  # from a snapshot (fresh) rather than the history

    @property
    def host(self) -> str:
        """The host to ask about this run (node rank 0's, the first one seen)."""
        return self.hosts[0]

    @property
    def ended_state(self) -> bool:
        return self.state in TERMINAL_STATES


def run_row_from_info(r: RunInfo, host: str | None = None) -> RunRow:
    """A run the agent reports (live from a snapshot, or from ListRuns); ``host`` is the console's name for
    the link it came over (``RunInfo.host`` is the agent's own host name, which may differ: ``local`` vs ``vm``)."""
    tel = r.telemetry
    act = active_alerts(r.alerts)
    return RunRow(
        id=r.id,
        hosts=(host or r.host,),
        state=r.state,
        kind=r.spec.kind,
        name=r.name,
        step=tel.step if tel else None,
        loss=tel.loss if tel else None,
        tokens_per_s=tel.tokens_per_s if tel else None,
        tps_history=tuple(tel.tps_history) if tel else (),
        created=r.created,
        started=r.started,
        ended=r.ended,
        cause=r.cause,
        alerts=tuple(a.kind.replace("_", " ") for a in act),
        critical=any(a.severity == "critical" for a in act),
        torch=r.env.torch if r.env else None,
        parent=r.spec.parent,
        live=r.state not in TERMINAL_STATES,
    )


def _alert_kinds(alerts: list[Recorded]) -> tuple[tuple[str, ...], bool]:
    kinds: list[str] = []
    critical = False
    for a in alerts or []:
        if not isinstance(a, dict) or a.get("cleared"):
            continue
        kinds.append(str(a.get("kind", "alert")).replace("_", " "))
        critical = critical or a.get("severity") == "critical"
    return tuple(dict.fromkeys(kinds)), critical


def run_row_from_history(d: RunRecord) -> RunRow:
    """A run as the history recorded it: tokens/s and the step as every view shows them (console/ops/figures.py: the
    median over the recorded steps, the trainer's final step), not the last value the history happened to keep."""
    alerts, critical = _alert_kinds(d.alerts)
    if not alerts and (d.alert_count or 0) > 0:
        alerts = (f"{d.alert_count} alert(s)",)
    fig = run_figures(d)
    return RunRow(
        id=str(d.id),
        hosts=(str(d.host),),
        state=str(d.state or "pending"),
        kind=str(d.kind or "command"),
        name=d.name,
        step=fig.last_step,
        loss=d.last_loss,
        tokens_per_s=fig.tokens_per_s,
        created=float(d.created or 0.0),
        started=d.started,
        ended=d.ended,
        cause=d.cause,
        alerts=alerts,
        critical=critical,
        torch=d.env_torch,
        parent=d.parent,
    )


def merge_rows(rows: Iterable[RunRow]) -> dict[str, RunRow]:
    """Runs by id: a multi-node run (one id on several hosts) becomes one row listing its hosts; live beats recorded."""
    # one pass, one new row per merged id: a run live on N hosts cost N rows built and N tuples of up to N hosts (O(N^2):
    # 512 hosts of one run, on the Runs screen at every refresh; issue 33)
    out: dict[str, RunRow] = {}
    hosts: dict[str, dict[str, None]] = {}  # only ids seen more than once: their hosts in first-seen order
    for r in rows:
        cur = out.get(r.id)
        if cur is None:
            out[r.id] = r
            continue
        seen = hosts.get(r.id)
        if seen is None:
            seen = hosts[r.id] = dict.fromkeys(cur.hosts)
        seen.update(dict.fromkeys(r.hosts))
        if r.live and not cur.live:
            out[r.id] = r
    for rid, seen in hosts.items():
        out[rid] = replace(out[rid], hosts=tuple(seen))
    return out


# ----------------------------------------------------------------------------- records


RECORD_FACTS = ("id", "host", "name", "cause", "exit_code", "signal", "started", "ended")  # the same name in a history row and a RunInfo


def _run_state(state: str | None) -> RunState:
    """A recorded state as RunInfo's literal (one it does not know reads as pending)."""
    return cast(RunState, state) if state in get_args(RunState) else "pending"  # checked against RunState's own literals


def run_from_record(record: RunRecord) -> RunInfo | None:
    """A history record as a RunInfo (what the Run screen shows when the agent cannot say); None without a spec."""
    spec = record.launch_spec_or_none()
    if spec is None:
        return None
    facts = {k: v for k in RECORD_FACTS if (v := getattr(record, k)) is not None}
    return RunInfo(
        **facts,
        state=_run_state(record.state),
        spec=spec,
        created=float(record.created or 0.0),
        alerts=record.alert_list(),
        env=record.env_fingerprint(),
    )


def python_of(spec: LaunchSpec, env: EnvFingerprint | None = None) -> str | None:
    """The interpreter a run used: its fingerprint's, the spec's, or argv[0] when that is a python."""
    if env is not None and env.python:
        return env.python
    if spec.python:
        return spec.python
    if spec.argv and Path(spec.argv[0]).name.startswith("python"):
        return spec.argv[0]
    return None


# ----------------------------------------------------------------------------- diffs

# console/present/rundiff.py compares two runs (the CLI's `gpudeck diff` too); the console adds one row per argument
# that differs, because a wide command line does not fit a table cell and the operator wants the flag that changed.


def argv_flags(argv: Sequence[str]) -> dict[str, str]:
    """An argv as ``{--flag: value}`` (``--flag=value`` too; a flag without a value is 'on'), positionals as ``argv[i]``."""
    out: dict[str, str] = {}
    i = 0
    pos = 0
    args = list(argv)
    while i < len(args):
        a = args[i]
        if a.startswith("--") and len(a) > 2:
            if "=" in a:
                k, v = a.split("=", 1)
                out[k] = v
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[a] = args[i + 1]
                i += 1
            else:
                out[a] = "on"
        else:
            out[f"argv[{pos}]"] = a
            pos += 1
        i += 1
    return out


def argv_rows(a: Sequence[str], b: Sequence[str]) -> list[Row]:
    """One row per argument that differs between two command lines (the flag, or the position)."""
    fa, fb = argv_flags(a), argv_flags(b)
    return [Row(k, fa.get(k, "-"), fb.get(k, "-")) for k in dict.fromkeys([*fa, *fb]) if fa.get(k) != fb.get(k)]


def run_diff(ra: RunRecord, rb: RunRecord, ma: list[MetricPoint] | None = None, mb: list[MetricPoint] | None = None) -> RunDiff:
    """Two runs' records (and their step metrics) compared by :func:`gpudeck.console.present.rundiff.diff_runs`, the differing arguments after the command."""
    diff = diff_runs(ra, rb, ma, mb)
    at = next((i + 1 for i, r in enumerate(diff.config) if r.key == "command"), len(diff.config))
    diff.config[at:at] = argv_rows(_argv(ra), _argv(rb))
    return diff


def _argv(record: RunRecord) -> list[str]:
    """The command a record holds: the history's ``argv`` column (what rundiff compares), else its spec's."""
    if record.argv:
        return list(record.argv)
    spec = record.launch_spec_or_none()
    return list(spec.argv) if spec is not None else []


def core_changes(diff: RunDiff) -> list[Row]:
    """The environment changes that decide whether a known-good configuration still works (torch, CUDA, driver ...)."""
    return [r for r in diff.environment if r.core and r.differs]


def diff_sections(diff: RunDiff) -> list[tuple[str, list[Row]]]:
    """The diff in the order the operator should read it: environment (core first), configuration, outcome."""
    return [("environment", diff.environment), ("config", diff.config), ("outcome", diff.outcome)]


def row_label(row: Row) -> str:
    """An environment row's name as people say it ('torch CUDA build' for ``torch_cuda``)."""
    return envdiff.LABELS.get(row.key, row.key)


def gpu_free(g: Gpu) -> int:
    """Bytes free on a GPU."""
    return max(0, g.memory_total - g.memory_used)


# ----------------------------------------------------------------------------- a run's step series

# each figure of a run's step metrics as the Run screen's labels and `gpudeck metrics` write it
SERIES_FORMATS = {"loss": "{:.4f}", "tokens/s": "{:,.0f}"}


@dataclass(frozen=True)
class SeriesSummary:
    """One figure of a run's step metrics: the last step that reported it, its value there, its least and most."""

    name: str
    step: int
    last: float
    low: float
    high: float

    def text(self) -> str:
        """``step 120: 2.3456   min 0.9129  max 10.0000`` (the figure's own format, SERIES_FORMATS)."""
        f = SERIES_FORMATS.get(self.name, "{:g}")
        return f"step {self.step}: {f.format(self.last)}   min {f.format(self.low)}  max {f.format(self.high)}"


def series_points(steps: Sequence[int], values: Sequence[float | None]) -> list[tuple[int, float]]:
    """The (step, value) pairs of the steps that reported the figure."""
    return [(s, v) for s, v in zip(steps, values) if v is not None]


def series_summary(name: str, steps: Sequence[int], values: Sequence[float | None]) -> SeriesSummary | None:
    """The figure's last value, least and most over the steps that reported it; None when none did."""
    pts = series_points(steps, values)
    if not pts:
        return None
    data = [v for _, v in pts]
    return SeriesSummary(name, pts[-1][0], data[-1], min(data), max(data))
