"""Provides the CLI's human views: tables of hosts, runs, stops and history (``--json`` prints the data instead)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import UNSET, UnsetType

from gpudeck.agents.wire.causes import cause_class
from gpudeck.agents.wire.protocol import Container, PreflightResult, RunInfo, Snapshot, StopResult, UnaccountedMemory, to_builtins
from gpudeck.console.core.fmt import duration, elapsed, gib, when
from gpudeck.console.core.records import EventRecord, Problem, RunRecord
from gpudeck.console.core.sanitize import escape_controls
from gpudeck.console.fleet.multinode import by_run, combine, is_multinode
from gpudeck.console.ops.figures import RunFigures, run_figures, tokens_text
from gpudeck.console.ops.triage import show_lines
from gpudeck.console.present.views import series_summary, unaccounted_holders, unaccounted_line

if TYPE_CHECKING:
    from gpudeck.console.ops.readings import StepSeries

SHOW_COMMAND_MAX = 2000  # characters of a command `gpudeck show` prints (--json has it whole)


def command_line(argv: Sequence[str] | None, limit: int) -> str:
    """A command as one line of a table: its words joined by spaces, every control character (a newline too) escaped, at most ``limit``
    characters ('…' marks a cut); '-' for none."""
    text = escape_controls(" ".join(argv or ()))
    return (text[: limit - 1] + "…" if len(text) > limit else text) or "-"


def container_cell(c: Container | None, limit: int = 40) -> str:
    """The CONTAINER cell of a process: ``docker:trainer``, ``k8s:ns/pod/ctr`` (control characters escaped, at most
    ``limit`` characters, '…' marks a cut); '-' outside any container, or from an agent that does not say."""
    return "-" if c is None else command_line([c.label()], limit)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A left-aligned text table."""
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    line = lambda cells: "  ".join(c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()  # noqa: E731
    return "\n".join([line(headers), *(line(r) for r in rows)])


def format_status(snap: Snapshot, alias: str | None = None) -> str:
    """Human view of a snapshot: GPUs, GPU processes, live runs. ``alias``: the fleet's name for the host, shown
    with the machine's own hostname when they differ."""
    name = snap.host if not alias or alias == snap.host else f"{alias} ({snap.host})"
    out = [f"host {name}  ({when(snap.ts)}, sampled in {snap.sample_ms:.2f} ms)"]
    if snap.simulated:
        out.append(format_simulated(snap))
    if snap.storage_error:
        out.append(f"STORAGE: {snap.storage_error}")
    if snap.journal_note:
        out.append(f"JOURNAL: {snap.journal_note}")
    if snap.namespace is not None and snap.namespace.pid_namespace != "host":
        out.append(f"PID NAMESPACE: {snap.namespace.label}")
    if snap.gpu_error:
        out.append(f"GPUs: none ({snap.gpu_error})")
    else:
        rows = [
            [
                str(g.index),
                g.name,
                f"{gib(g.memory_used)}/{gib(g.memory_total)} GiB",
                "-" if g.util_gpu is None else f"{g.util_gpu}%",
                "-" if g.temperature_c is None else f"{g.temperature_c}C",
                "-" if g.power_w is None else f"{g.power_w:.0f}W",
                gib(g.unaccounted_bytes),
            ]
            for g in snap.gpus
        ]
        out.append(table(["GPU", "NAME", "MEMORY", "UTIL", "TEMP", "POWER", "UNACCOUNTED GiB"], rows))
        out.extend(unaccounted_line(u) for u in unaccounted_holders(snap.unaccounted))
        procs = [p for g in snap.gpus for p in g.processes]
        if procs:
            prow = [
                [
                    str(p.pid),
                    str(p.gpu),
                    gib(p.used_bytes),
                    p.attribution,
                    p.run_id or "-",
                    "-" if p.rank is None else str(p.rank),
                    p.user or "-",
                    container_cell(p.container),
                    command_line(p.cmdline, 60),
                ]
                for p in procs
            ]
            out.append("")
            out.append(table(["PID", "GPU", "GiB", "HOLDER", "RUN", "RANK", "USER", "CONTAINER", "COMMAND"], prow))
        else:
            out.append("no GPU processes")
    if snap.runs:
        out.append("")
        out.append(
            table(
                ["RUN", "NAME", "STATE", "MEMBERS", "ELAPSED", "COMMAND"],
                [
                    [
                        r.id,
                        r.name or "-",
                        r.state,
                        str(sum(1 for m in r.members if m.role != "shim")),
                        duration(elapsed(r.started, r.ended)),
                        command_line(r.spec.argv, 50),
                    ]
                    for r in snap.runs
                ],
            )
        )
    else:
        out.append("no live runs")
    return "\n".join(out)


def format_runs(runs: list[dict[str, Any]]) -> str:
    """Human view of the run list: the very objects ``runs --json`` prints (``run_json``'s, a multi-node run one object
    with its hosts joined by +), so the table and the JSON never disagree."""
    if not runs:
        return "no runs yet: `gpudeck launch -- CMD ...` starts one"
    rows = [
        [
            r["id"],
            r["host"],
            r.get("name") or "-",
            r["state"],
            when(r.get("started") or r.get("created")),
            duration(elapsed(r.get("started"), r.get("ended"))),
            str(len(r.get("alerts") or [])) if r.get("alerts") else "-",
            (r.get("cause") or "-")[:70],
        ]
        for r in runs
    ]
    return table(["RUN", "HOST", "NAME", "STATE", "STARTED", "ELAPSED", "ALERTS", "CAUSE"], rows)


def format_stop(res: StopResult) -> str:
    """Human view of a stop's verification."""
    if res.message and not res.stopped and not res.survivors:  # nothing was alive (an ended run): say so, not "stopped in"
        return res.message
    lines = [f"run {res.run_id}: {res.state} in {res.seconds:.2f} s"]
    for p in res.stopped:
        lines.append(f"  stopped  pid {p.pid:<7} {p.how:<12} {command_line(p.cmdline, 70)}")
    for p in res.survivors:
        lines.append(f"  SURVIVED pid {p.pid:<7} {p.status or '?':<12} {command_line(p.cmdline, 70)}")
    if res.needed_kill:
        lines.append(f"  needed SIGKILL: {', '.join(map(str, res.needed_kill))}")
    for f in res.freed:
        lines.append(f"  GPU {f.gpu}: {gib(f.before_bytes)} -> {gib(f.after_bytes)} GiB used ({gib(f.freed_bytes)} GiB freed)")
    lines.append(f"  {res.gpu_note}" if res.gpu_note else "")
    if res.survivors:
        lines.append(
            "  a process in disk sleep (D) cannot be killed until its I/O returns: check the driver/storage (dmesg); it is not retried in a loop"
        )
    return "\n".join(ln for ln in lines if ln)


def run_json(r: RunInfo) -> dict[str, Any]:
    """The scripted shape of a run (stable keys for users' scripts): the JSON object ``--json`` prints, the printing edge."""
    d = to_builtins(r)
    for k in ("exit_code", "signal", "cause", "started", "ended", "name"):
        d.setdefault(k, None)
    # the keys `history --json` has too (README, "One record shape")
    d.update(kind=r.spec.kind, cause_class=cause_class(r.state, r.cause), alerts=d.get("alerts") or [])
    return d


LIVE_KEYS = ("request_id", "run_dir", "containment")  # what only the agent that runs it knows (null in the history)
RECORD_KEYS = (*(f for f in RunRecord.__struct_fields__ if f not in ("hosts", "nodes")), *LIVE_KEYS)


def record_shape(d: Mapping[str, Any], fill: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One run as ``runs --json`` and ``history --json`` both print it: every key of RECORD_KEYS, in that order (README,
    "One record shape"), each from ``d``, else from ``fill``, else null; then a multi-node run's ``hosts`` and ``nodes``."""
    fill = fill or {}
    out = {k: d[k] if k in d else fill.get(k) for k in RECORD_KEYS}
    for k, v in d.items():
        if k not in out:
            out[k] = v
    return out


def format_simulated(snap: Snapshot) -> str:
    """The label every view of a simulated host carries."""
    return "SIMULATED GPUs (no real GPU on this host: GPUDECK_SIMULATE_GPUS is set)" if snap.simulated else ""


def why_down(host: str, error: str | None) -> str:
    """Why a host is down, for a line that already names the host and says it is unreachable."""
    return (error or "").removeprefix(f"host {host} is unreachable: ").removeprefix(f"{host}: ")


class HostLine(msgspec.Struct, kw_only=True, frozen=True):
    """``gpudeck hosts``: one configured host, and (after ``--check``) its link state; unset fields are left out of ``--json``."""

    name: str
    transport: str = "ssh"
    command: str = "-"
    state: str | UnsetType = UNSET
    agent_version: str | None | UnsetType = UNSET
    error: str | None | UnsetType = UNSET


class HostStatus(msgspec.Struct, frozen=True):
    """``gpudeck status``: one host's snapshot, or why it did not answer."""

    host: str
    state: str  # up | unreachable
    error: str | None
    snapshot: Snapshot | None


def format_hosts(rows: list[HostLine]) -> str:
    """``gpudeck hosts``: configured hosts and (when probed) their link state."""
    out = []
    for r in rows:
        state = r.state if isinstance(r.state, str) and r.state else "-"
        if isinstance(r.error, str) and r.error:
            state += f": {why_down(r.name, r.error)}"
        out.append([r.name, r.transport, r.command, state[:240]])
    return table(["HOST", "LINK", "COMMAND", "STATE"], out)


def format_history(rows: list[RunRecord]) -> str:
    """``gpudeck history``: one line per run, newest first."""
    if not rows:
        return "no runs match"
    out = []
    for r in rows:
        fig = run_figures(r)
        out.append(
            [
                r.id,
                r.host,
                r.name or "-",
                r.kind or "-",
                r.state or "-",
                when(r.started or r.created),
                duration(fig.elapsed_s) if fig.elapsed_s is not None else "-",
                "-" if fig.last_step is None else str(fig.last_step),
                tokens_text(fig.tokens_per_s),
                str(r.alert_count or "") or "-",
                (r.cause or "-")[:60],
            ]
        )
    return table(["RUN", "HOST", "NAME", "KIND", "STATE", "STARTED", "ELAPSED", "STEP", "TOK/S", "ALERTS", "CAUSE"], out)


def _kv(lines: list[str], key: str, value: object) -> None:
    if value is not None and value != "" and value != [] and value != {}:
        lines.append(f"  {key:<16} {value}")


def env_line(env: Mapping[str, Any]) -> str:
    """A recorded fingerprint in one line; what is absent is named (torch not installed, a CPU build, no driver), never None."""
    torch, cuda = env.get("torch"), env.get("torch_cuda")
    if not torch:
        torch_text = "torch not installed"
    else:
        torch_text = f"torch {torch} " + (f"cuda {cuda}" if cuda else "(CPU build)")
    parts = [f"python {env.get('python_version') or '?'}", torch_text]
    if env.get("nccl"):
        parts.append(f"nccl {env['nccl']}")
    parts.append(f"driver {env['driver']}" if env.get("driver") else "no NVIDIA driver")
    return escape_controls(
        " ".join(parts) + f" ({len(env.get('packages') or {})} packages, freeze {str(env.get('freeze_hash') or '-')[:12]})"
    )


def format_show(run: RunRecord, events: list[EventRecord], figures: RunFigures | None = None) -> str:
    """``gpudeck show``: one run in full, with its timeline (the shared figures: console/ops/figures.py)."""
    fig = figures or run_figures(run)
    lines = [f"run {run.id} on {run.host}" + (f" ({run.name})" if run.name else "")]
    _kv(lines, "state", run.state)
    _kv(lines, "cause", run.cause)
    _kv(lines, "cause class", fig.cause_class)
    _kv(lines, "kind", run.kind)
    _kv(lines, "command", command_line(run.argv, SHOW_COMMAND_MAX) if run.argv else None)
    _kv(lines, "gpus", run.gpus)
    _kv(lines, "start", run.start)
    _kv(lines, "cwd", run.cwd)
    _kv(lines, "operator", run.operator)
    _kv(lines, "parent", run.parent)
    _kv(lines, "created", when(run.created))
    _kv(lines, "started", when(run.started) if run.started else None)
    _kv(lines, "ended", when(run.ended) if run.ended else None)
    _kv(lines, "elapsed", duration(fig.elapsed_s) if fig.elapsed_s is not None else None)
    _kv(lines, "exit code", run.exit_code)
    _kv(lines, "signal", run.signal)
    _kv(lines, "params", f"{run.params_total:,}" if run.params_total else None)
    _kv(lines, "world size", run.world_size)
    _kv(lines, "ranks seen", run.ranks_seen or None)
    _kv(
        lines,
        "dataset",
        f"{run.dataset_samples:,} samples, {run.dataset_tokens or 0:,} tokens" if run.dataset_samples else None,
    )
    _kv(lines, "last step", fig.last_step)
    _kv(lines, "loss", f"{run.last_loss:.4f}" if run.last_loss is not None else None)
    _kv(lines, "tokens/s median", tokens_text(fig.tokens_per_s) if fig.tokens_per_s is not None else None)
    _kv(lines, "MFU", f"{run.mfu * 100:.1f}%" if run.mfu is not None else None)
    _kv(lines, "peak memory", f"{fig.peak_mem_gib:.2f} GiB" if fig.peak_mem_gib is not None else None)
    _kv(lines, "checkpoint", run.last_checkpoint)
    _kv(lines, "tau", run.tau)
    _kv(lines, "error", run.error)
    env = run.env or {}  # the recorded fingerprint as written (any gpudeck version's): shown field by field
    if env:
        _kv(lines, "environment", env_line(env))
    for a in run.alerts or []:
        lines.append(f"  ALERT {a.get('kind')}: {a.get('message')}")
    lines += show_lines(events)
    members = run.members or []
    if members:
        lines.append(f"  members ({len(members)}):")
        for m in members[:32]:
            rank = "" if m.get("rank") is None else f" rank {m['rank']}"
            role = " (leader)" if m.get("role") == "leader" else ""
            lines.append(f"    pid {m.get('pid')}{role}{rank}: {command_line(m.get('cmdline') or [], 90)}")
        if len(members) > 32:
            lines.append(f"    ... and {len(members) - 32} more (gpudeck show --json lists them)")
    if events:
        lines.append("  timeline:")
        for e in events:
            lines.append(f"    {when(e.ts)}  #{e.seq:<6} {e.kind:<12} {_event_summary(e)}")
    return "\n".join(lines)


def _event_summary(e: EventRecord) -> str:
    d = e.data or {}
    k = e.kind
    if k == "run_state":
        return f"{d.get('state')}" + (f": {d['cause']}" if d.get("cause") else "")
    if k == "telemetry":
        rec = d.get("record") or {}
        t = rec.get("type")
        if t == "step":
            return f"step {rec.get('step')} loss {rec.get('loss')} tok/s {rec.get('tokens_per_s')}"
        return f"{t} " + json.dumps({x: y for x, y in rec.items() if x not in ("ts", "type", "argv")}, default=str)[:100]
    if k == "members":
        return f"+{len(d.get('added') or [])} process(es)"
    if k == "gpu_hold":  # the GPU ledger (`gpudeck ledger`): one change of one hold
        who = f"pid {d.get('pid')}" if d.get("pid") is not None else "unaccounted memory"
        held = d.get("bytes")
        return f"GPU {d.get('gpu')}: {who} {d.get('change')} {gib(held if isinstance(held, int) else None)} GiB {d.get('attribution')}"
    return json.dumps(d, default=str)[:110]


def format_leftovers(host: str, leftovers: list[Any], unaccounted: list[UnaccountedMemory] | None = None) -> str:
    """``gpudeck reclaim HOST``: what could be reclaimed and why, biggest GPU holders first; then the memory no process
    visible on the host explains (a holder that cannot be signalled from there, and why)."""
    hidden = unaccounted_holders(unaccounted or [])
    if not leftovers and not hidden:
        return f"{host}: no leftovers (no process of an ended run is alive, no GPU memory outside a live run)"
    if not leftovers:
        return "\n".join(
            [f"{host}: no leftover process, but GPU memory no process visible there explains (nothing here can stop it):"]
            + [f"  {unaccounted_line(u)}" for u in hidden]
        )
    rows = []
    for lo in leftovers:
        gpu = ", ".join(f"GPU {g}: {gib(b)} GiB" for g, b in sorted(lo.gpu_bytes.items())) or "-"
        run = "-"
        if lo.run_id:
            run = lo.run_id + (
                f" ({lo.run_state}" + (f", ended {duration(time.time() - lo.run_ended)} ago" if lo.run_ended else "") + ")"
                if lo.run_state
                else ""
            )
        rows.append(
            [
                f"{host}:{lo.pid}",
                lo.kind,
                run,
                lo.user or "-",
                container_cell(lo.container),
                lo.status or "-",
                gpu,
                "-" if lo.cpu_percent is None else f"{lo.cpu_percent:.0f}%",
                "-" if lo.rss is None else f"{lo.rss / 2**20:.0f} MiB",
                command_line(lo.cmdline, 60),
            ]
        )
    out = [table(["PROCESS", "KIND", "RUN", "USER", "CONTAINER", "STATUS", "GPU MEMORY", "CPU", "RSS", "COMMAND"], rows), ""]
    for lo in leftovers:
        out.append(f"  {host}:{lo.pid}: {lo.note}")
    for u in hidden:
        out.append(f"  {unaccounted_line(u)}")
    out.append("")
    out.append(f"stop them with `gpudeck reclaim {' '.join(f'{host}:{lo.pid}' for lo in leftovers if lo.kind != 'live')}`")
    return "\n".join(out)


def format_claims(run_id: str, rows: list[Any], alerts: list[Any]) -> str:
    """``gpudeck verify RUN``: claimed against observed, mismatches marked."""
    out = [f"run {run_id}: claims vs observed"]
    body = []
    for r in rows:
        mark = "OK" if r.ok else ("MISMATCH" if r.ok is False else "-")
        claimed = "-" if r.claimed is None else f"{r.claimed:,}" if isinstance(r.claimed, int) else f"{r.claimed:,.4g}"
        observed = "-" if r.observed is None else f"{r.observed:,}" if isinstance(r.observed, int) else f"{r.observed:,.4g}"
        body.append([r.what, claimed, observed, mark, r.source or "-", r.detail or ""])
    out.append(
        table(["WHAT", "CLAIMED", "OBSERVED", "VERDICT", "CLAIM FROM", "DETAIL"], body)
        if body
        else "  nothing observed yet (no manifest, no ranks)"
    )
    for a in alerts:
        out.append(f"  ALERT {a.kind}: {a.message}")
    return "\n".join(out)


def format_preflight(result: PreflightResult) -> str:
    """Human text: a verdict line, then one line per check (✓ passed, ✗ failed, forced, – skipped)."""
    failed = [c for c in result.checks if not c.ok and not c.overridden]
    if failed:
        verdict = f"FAILED ({len(failed)} of {len(result.checks)} checks): nothing was started"
    elif result.forced:
        verdict = "ok, with --force past the GPU holders (recorded)"
    else:
        verdict = "ok"
    lines = [f"pre-flight on {result.host or 'this host'}: {verdict}"]
    width = max((len(c.name) for c in result.checks), default=0)
    for c in result.checks:
        if c.overridden:
            mark = "forced"
        elif not c.ok:
            mark = "✗"
        elif c.details.get("skipped"):
            mark = "–"
        else:
            mark = "✓"
        lines.append(f"  {mark:<6} {c.name:<{width}}  {c.message}")
    if result.estimate is not None and result.estimate.method:
        lines.append(f"  memory: {result.estimate.method}")
    return "\n".join(lines)


def format_problems(problems: list[Problem]) -> str:
    """Human view of ``gpudeck history --problems``."""
    if not problems:
        return "no problems: every event the agents sent is in the history"
    lines = [f"{len(problems)} event(s) kept out of the history (raw copies in its quarantine table):"]
    for p in problems:
        lines.append(f"  {p.host} epoch {p.epoch[:12]} seq {p.seq} {p.kind}{' run ' + p.run_id if p.run_id else ''}: {p.error}")
    return "\n".join(lines)


def group_runs(runs: Sequence[RunInfo], unreachable: set[str] | None = None) -> list[dict[str, Any]]:
    """``gpudeck runs``: the agents' runs as JSON objects (the printing edge: RunInfo's scripted shape, ``run_json``),
    each multi-node run one object with the combined host, state, cause, ranks seen, times and nodes."""
    infos = {(r.host, r.id): r for r in runs}
    out: list[dict[str, Any]] = []
    for rs in by_run([RunRecord.from_info(r) for r in runs]):
        if not is_multinode(rs):
            out.append(record_shape(run_json(infos[(rs[0].host, rs[0].id)]), rs[0].as_json()))  # history's keys from the agent's run
            continue
        c = combine(rs, unreachable)
        lead = run_json(infos[(c.rows[0].host, c.rows[0].id)])
        lead.update(c.combined(), nodes=[msgspec.to_builtins(n) for n in c.nodes])
        out.append(record_shape(lead, c.rows[0].as_json()))
    return out


def format_series(run_id: str, host: str, series: StepSeries) -> str:
    """``gpudeck metrics``: where the step metrics came from, then each figure as the Run screen's label writes it."""
    where = {"agent": f"from {host}'s agent", "history": "from the history (the agent could not be asked)"}.get(series.source)
    if where is None or not series.steps:
        return f"run {run_id} on {host}: no step metrics reported" + ("" if where else " (no agent answered and no history)")
    lines = [f"run {run_id} on {host}: {len(series.steps)} step(s) {where}"]
    for name, values in (("loss", series.loss), ("tokens/s", series.tokens_per_s)):
        summary = series_summary(name, series.steps, values)
        lines.append(f"{name} {summary.text()}" if summary is not None else f"{name}: not reported")
    return "\n".join(lines)
