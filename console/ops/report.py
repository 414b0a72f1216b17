"""Provides the run report's evidence (``gpudeck report RUN``): what a run claimed, what the history shows, and where
each figure comes from, gathered once for the Markdown and JSON views (console/present/report.py).

Everything is read from the history (the replica of the agents' journals) with the readers that own each part: the
run's record and events (console/history/replica.py), the GPU ledger's footprint (:func:`ledger_answer`), the stored
triages (:func:`stored_triages`), the figures (:func:`run_figures`); the run it was relaunched or rolled back from is
read here and compared by the diff's one implementation (console/present/rundiff.py). Only the run's output is read
from its agent (:func:`with_output`), when it answers: the history keeps no output.

A claim is checked against evidence, never against another claim: the GPUs a run claimed against the GPUs its
processes held in the ledger, the parameters and world size against the trainer's manifest. A claim with nothing to
check it against is NO EVIDENCE, never a pass. Every string here is the run's and hostile; the views escape it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec

from gpudeck.agents.wire.envdiff import shown_env_value
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import LIVE_STATES, Alert, ClaimRow, PreflightResult, StopResult, Triage
from gpudeck.console.core.records import EventRecord, MetricPoint, RunRecord
from gpudeck.console.core.sanitize import redact_record
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.replica import History, HistoryError
from gpudeck.console.ops.errors import OpsError
from gpudeck.console.ops.figures import RunFigures, median_tokens_per_s, run_figures
from gpudeck.console.ops.ledger import GpuFootprint, HoldRecord, LedgerQuery, ledger_answer
from gpudeck.console.ops.readings import TAIL_WINDOW, run_output
from gpudeck.console.ops.triage import stored_triages

SCHEMA = "gpudeck.report/1"  # the --json document's shape; a change that renames or drops a key bumps it
Verdict = Literal["CONSISTENT", "CONTRADICTED", "NO EVIDENCE", "NOT CLAIMED", "UNCHECKED"]
OUTPUT_TAIL_LINES = 8  # the last lines of the output the report quotes
# the events read for the report: everything but the bulky ones (step telemetry is read from the metrics table)
_KINDS = ("run_created", "run_state", "claims", "preflight", "env_fingerprint", "triage", "reclaimed", "shim_lost", "run_adopted")
_HANG_KINDS = ("hang", "heartbeat_lost", "straggler")
LEDGER_SOURCE = "GPU ledger (gpu_hold events)"
_DIGESTED = re.compile(r"^sha256:[0-9a-f]{16} \(value hidden\)$")  # what agents.wire.envdiff.shown_env_value records
MANIFEST_SOURCE = "trainer manifest (telemetry)"


@dataclass(frozen=True)
class ClaimCheck:
    """One claim against its evidence: the two figures, where each comes from, and the verdict."""

    what: str
    claimed: int | float | None
    claim_source: str
    evidence: int | float | None
    evidence_source: str
    verdict: Verdict
    detail: str = ""


@dataclass(frozen=True)
class Curve:
    """The loss and throughput curve in a few figures (from the recorded steps)."""

    steps: int
    first_step: int | None = None
    last_step: int | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    loss_min: float | None = None
    tokens_per_s_median: float | None = None
    tokens_per_s_min: float | None = None
    tokens_per_s_max: float | None = None
    source: str = "step telemetry (history metrics)"


@dataclass(frozen=True)
class Ending:
    """How the run ended and on what evidence; ``verdict`` says it in words, ``notes`` why."""

    verdict: str
    state: str | None
    cause: str | None
    cause_class: str | None
    exit_code: int | None
    signal: str | None
    ended: float | None
    decided_on: str | None  # the agent's evidence for the end (agents/runs/states.py names each kind)
    ended_by: str | None
    source: str
    telemetry_types: list[str] = field(default_factory=list)  # the trainer's record types the history holds
    final_step: int | None = None
    error: str | None = None
    output_bytes: int | None = None
    output_tail: list[str] = field(default_factory=list)
    output_source: str = "not read (--no-sync: the history keeps no output)"
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Reclaim:
    """Something that reclaimed the run's processes after it (a ``reclaimed`` event)."""

    ts: float
    pids: list[int]
    state: str
    message: str
    source: str
    freed_bytes: int | None = None


@dataclass(frozen=True)
class Leftovers:
    """What the run left behind and what reclaimed it."""

    lingering: list[int] = field(default_factory=list)  # pids alive at its end (run_state)
    stale_holds: list[HoldRecord] = field(default_factory=list)  # ledger holds that outlived the run
    stop: StopResult | None = None
    reclaims: list[Reclaim] = field(default_factory=list)


@dataclass(frozen=True)
class RunReport:
    """Everything ``gpudeck report`` writes about one run (one node of a multi-node run)."""

    run: RunRecord  # its --env secrets redacted
    made: float
    figures: RunFigures
    claims: list[ClaimCheck]
    manifest: dict[str, Any] | None
    manifest_ts: float | None
    claimed_gpus: list[int] | None
    footprint: list[GpuFootprint]
    holds: list[HoldRecord]
    ledger_note: str
    curve: Curve
    metrics: list[MetricPoint]
    dist_env: dict[str, str]
    env_source: str
    parent: RunRecord | None
    parent_metrics: list[MetricPoint]
    parent_note: str
    alerts: list[Alert]
    triages: list[Triage]
    preflight: PreflightResult | None
    ending: Ending
    leftovers: Leftovers
    events_read: int

    @property
    def rank_deaths(self) -> list[Alert]:
        return [a for a in self.alerts if a.kind == "rank_exited"]

    @property
    def hangs(self) -> list[Alert]:
        return [a for a in self.alerts if a.kind in _HANG_KINDS]

    def verdicts(self, verdict: Verdict) -> list[str]:
        """The claims with this verdict."""
        return [c.what for c in self.claims if c.verdict == verdict]


# ----------------------------------------------------------------------------- gathering


def gather_report(
    history: History, ref: str, host: str | None = None, unanswered: Sequence[str] = (), now: float | None = None
) -> RunReport:
    """The report of the run ``ref`` names (id, unique prefix or name; AmbiguousRun / NoSuchRun say what to give), from
    the history alone. Blocking SQLite: call it from a thread."""
    now = time.time() if now is None else now
    run = history.find(ref, host, list(unanswered))
    events = history.events(run.host, run.id, limit=100_000, kinds=_KINDS)
    metrics = history.metrics(run.host, run.id)
    footprint, holds, ledger_note = _ledger(history, run, now)
    parent, parent_metrics, parent_note = _parent(history, run)
    manifest = run.telemetry.get("manifest") if isinstance(run.telemetry, dict) else None
    manifest = manifest if isinstance(manifest, dict) else None
    rec = redact_record(run)  # a report is attached to post-mortems: never an --env secret in it
    return RunReport(
        run=rec,
        made=now,
        figures=run_figures(run, metrics),
        claims=_claims(run, events, manifest, footprint, history, metrics),
        manifest=manifest,
        manifest_ts=_num(manifest.get("ts")) if manifest else None,
        claimed_gpus=list(run.gpus) if run.gpus else None,
        footprint=footprint,
        holds=holds,
        ledger_note=ledger_note,
        curve=_curve(metrics),
        metrics=metrics,
        dist_env=_dist_env(run),
        env_source=_env_source(events),
        parent=redact_record(parent) if parent is not None else None,
        parent_metrics=parent_metrics,
        parent_note=parent_note,
        alerts=run.alert_list(),
        triages=stored_triages(events),
        preflight=run.preflight_result(),
        ending=_ending(run, events, metrics),
        leftovers=_leftovers(run, events, holds),
        events_read=len(events),
    )


async def with_output(fleet: Fleet, rep: RunReport) -> RunReport:
    """``rep`` with its run's output size and last lines, read from its agent (the history keeps no output); when the
    agent cannot be asked, the report says why instead."""
    run = rep.run
    try:
        chunk = await anext(run_output(fleet, run.host, run.id, offset=-TAIL_WINDOW, follow=False))
    except (AgentError, OpsError, OSError, StopAsyncIteration) as exc:
        why = exc.message if isinstance(exc, (AgentError, OpsError)) else str(exc) or type(exc).__name__
        return replace(rep, ending=replace(rep.ending, output_source=f"not read: {run.host}'s agent did not answer ({why})"))
    src = f"{run.host}'s agent (runs/{run.id}/output.log: stdout and stderr of every rank)"
    lines = [line for line in chunk.data.splitlines() if line.strip()][-OUTPUT_TAIL_LINES:]  # blank lines say nothing
    ending = replace(rep.ending, output_bytes=chunk.next_offset, output_tail=lines, output_source=src)
    return replace(rep, ending=_with_verdict(rep.run, ending))


# ----------------------------------------------------------------------------- the parts


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _recorded_claims(events: list[EventRecord]) -> dict[str, ClaimRow]:
    """The agent's claims check recorded at the run's end (the newest), by what it checks."""
    out: dict[str, ClaimRow] = {}
    for e in events:
        if e.kind != "claims":
            continue
        out = {}
        for r in e.data.get("rows") or []:
            try:
                row = msgspec.convert(r, ClaimRow)
            except msgspec.ValidationError:
                continue
            out[row.what] = row
    return out


def _claimed(run: RunRecord, row: ClaimRow | None, explicit: str) -> tuple[int | float | None, str]:
    """The claimed figure and where it comes from: the agent's recorded check (it reads the claims, the run's name and
    its note), else the launch's explicit claims."""
    if row is not None and row.claimed is not None and row.source != "manifest":  # the manifest is evidence, not a claim
        src = row.source or "claims"
        return row.claimed, "launch --claim-*" if src == "claims" else src
    spec = run.launch_spec_or_none()
    claims = spec.claims if spec is not None else None
    value = getattr(claims, explicit, None) if claims is not None else None
    if value is not None:
        return value, "launch --claim-*"
    return None, ""


def _verdict(claimed: int | float | None, evidence: int | float | None, ok: bool | None) -> Verdict:
    if claimed is None:
        return "NOT CLAIMED"
    if evidence is None:
        return "NO EVIDENCE"
    if ok is None:
        return "UNCHECKED"
    return "CONSISTENT" if ok else "CONTRADICTED"


def _agent_ok(row: ClaimRow | None, claimed: int | float | None, evidence: int | float | None) -> bool | None:
    """The agent's verdict on the same two figures (its tolerances, checked once in agents/health/rules.py)."""
    if row is None or row.claimed != claimed or row.observed != evidence:
        return None
    return row.ok


def _claims(
    run: RunRecord,
    events: list[EventRecord],
    manifest: dict[str, Any] | None,
    footprint: list[GpuFootprint],
    history: History,
    metrics: list[MetricPoint],
) -> list[ClaimCheck]:
    rows = _recorded_claims(events)
    out: list[ClaimCheck] = []

    # parameters: the manifest's exact count
    row = rows.get("params")
    claimed, csrc = _claimed(run, row, "params")
    ev = _int(manifest.get("params_total")) if manifest else None
    out.append(
        ClaimCheck(
            "params", claimed, csrc, ev, MANIFEST_SOURCE if ev is not None else "", _verdict(claimed, ev, _agent_ok(row, claimed, ev))
        )
    )

    # world size: the manifest's, with the rank processes the agent saw
    row = rows.get("world size")
    claimed, csrc = _claimed(run, row, "world_size")
    spec = run.launch_spec_or_none()
    if claimed is None and spec is not None and spec.expected_ranks is not None:
        claimed, csrc = spec.expected_ranks, "launch --expected-ranks"
    ev = _int(manifest.get("world_size")) if manifest else None
    esrc = MANIFEST_SOURCE if ev is not None else ""
    seen, multi = run.ranks_seen or 0, len(run.spec_nodes) > 1
    if ev is None and seen and not multi:
        ev, esrc = seen, "rank processes seen by the agent (members events)"
    # the manifest says what the trainer believed; the rank processes seen are what ran (one host's share when multi-node)
    ok = None if claimed is None or ev is None else int(claimed) == ev and (multi or not seen or seen == int(claimed))
    detail = f"{seen} rank process(es) seen by the agent (members events)" + ("; this node's only (multi-node)" if multi else "")
    out.append(ClaimCheck("world size", claimed, csrc, ev, esrc, _verdict(claimed, ev, ok), detail))

    # GPUs: the GPUs the run's processes held, from the ledger, against the claimed count
    row = rows.get("GPUs")
    claimed, csrc = _claimed(run, row, "gpus")
    if claimed is None and run.gpus:
        claimed, csrc = len(run.gpus), "--gpus " + ",".join(str(g) for g in run.gpus)
    held = sorted({(f.host, f.gpu) for f in footprint})
    if held:
        ev, esrc = len(held), LEDGER_SOURCE
        detail = ", ".join(f"GPU {g}" for _h, g in held)
    elif _ledger_saw(history, run):
        ev, esrc, detail = 0, LEDGER_SOURCE, "the ledger recorded holds on this host during the run, none by its processes"
    elif row is not None and row.observed is not None:
        ev, esrc, detail = int(row.observed), "the agent's observation at the run's end (claims event)", row.detail
    else:
        ev, esrc, detail = None, "", "the ledger recorded no GPU memory on this host during the run (no GPU, or no ledger then)"
        if row is not None and row.detail:  # what the agent saw at the run's end ("no GPUs on this host")
            detail = f"{row.detail} (the agent's check at the run's end); {detail}"
    cpu_only = csrc.startswith("--gpus") and ev == 0  # --gpus makes GPUs visible; a CPU program uses none: no verdict
    verdict: Verdict = "NOT CLAIMED" if cpu_only else _verdict(claimed, ev, None if claimed is None or ev is None else int(claimed) == ev)
    if cpu_only:
        detail = "holds no GPU memory (--gpus makes GPUs visible; a CPU-only program uses none)"
    out.append(ClaimCheck("GPUs", claimed, csrc, ev, esrc, verdict, detail))

    # dataset: samples against the claim (the agent's tolerance); tokens as recorded
    row = rows.get("dataset samples")
    claimed, csrc = _claimed(run, row, "dataset_samples")
    ev = _int(manifest.get("dataset_samples")) if manifest else None
    out.append(
        ClaimCheck(
            "dataset samples",
            claimed,
            csrc,
            ev,
            MANIFEST_SOURCE if ev is not None else "",
            _verdict(claimed, ev, _agent_ok(row, claimed, ev)),
        )
    )
    ev = _int(manifest.get("dataset_tokens")) if manifest else None
    out.append(ClaimCheck("dataset tokens", None, "", ev, MANIFEST_SOURCE if ev is not None else "", "NOT CLAIMED"))

    # throughput: the median of every recorded step; the verdict is the agent's on the same claim (its tolerance), made
    # on its median of the recent steps it had seen
    row = rows.get("tokens/s")
    claimed, csrc = _claimed(run, row, "tokens_per_s")
    med = median_tokens_per_s(metrics)
    ok = row.ok if row is not None and claimed is not None and row.claimed == claimed else None
    detail = (
        f"the agent's verdict on its median of recent steps ({row.observed:,.0f} tok/s)" if ok is not None and row and row.observed else ""
    )
    src = "median of the recorded steps (history metrics)" if med is not None else ""
    out.append(ClaimCheck("tokens/s", claimed, csrc, med, src, _verdict(claimed, med, ok), detail))
    return out


def _ledger(history: History, run: RunRecord, now: float) -> tuple[list[GpuFootprint], list[HoldRecord], str]:
    """The run's GPU footprint on each of its hosts, from the ledger (one implementation: ops/ledger.py)."""
    footprint: list[GpuFootprint] = []
    holds: list[HoldRecord] = []
    for host in dict.fromkeys([run.host, *run.spec_nodes]):
        try:
            ans = ledger_answer(history, LedgerQuery(host=host, gpu=None, mode="run", run=run.id), now)
        except (OpsError, HistoryError):
            continue  # that node is not in the history
        footprint += ans.footprint
        holds += ans.holds
    if footprint:
        return footprint, holds, ""
    return [], [], "the ledger holds no GPU memory of this run (it held none, or it ran before the ledger)"


def _ledger_saw(history: History, run: RunRecord) -> bool:
    """Whether the ledger recorded any hold on the run's host while it ran (so 'none of the run's' is evidence)."""
    if not run.started:
        return False
    return bool(history.ledger_between(run.host, None, run.started, run.ended or time.time()))


def _parent(history: History, run: RunRecord) -> tuple[RunRecord | None, list[MetricPoint], str]:
    if not run.parent:
        return None, [], "not a relaunch or rollback (no parent run recorded)"
    try:
        parent = history.find(run.parent)
    except (OpsError, HistoryError) as exc:
        return None, [], f"parent run {run.parent} not in the history: {exc}"
    return parent, history.metrics(parent.host, parent.id), ""


def _dist_env(run: RunRecord) -> dict[str, str]:
    """The NCCL_*/TORCH_* variables the environment probe saw; secret-looking values only as a digest (the probe records
    them so; a value recorded otherwise is digested here)."""
    fp = run.env_fingerprint()
    if fp is None:
        return {}
    return {k: v if _DIGESTED.match(v) else shown_env_value(k, v) for k, v in sorted(fp.dist_env.items())}


def _env_source(events: list[EventRecord]) -> str:
    for e in events:
        if e.kind == "env_fingerprint":
            return f"environment probe at launch (env_fingerprint event #{e.seq})"
    return "no environment fingerprint recorded (not a python run, or recorded before fingerprints)"


def _curve(metrics: list[MetricPoint]) -> Curve:
    if not metrics:
        return Curve(steps=0, source="no step recorded")
    losses = [m.loss for m in metrics if m.loss is not None]
    tps = [float(m.tokens_per_s) for m in metrics if m.tokens_per_s is not None]
    return Curve(
        steps=len(metrics),
        first_step=metrics[0].step,
        last_step=metrics[-1].step,
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        loss_min=min(losses) if losses else None,
        tokens_per_s_median=median_tokens_per_s(metrics),
        tokens_per_s_min=min(tps) if tps else None,
        tokens_per_s_max=max(tps) if tps else None,
    )


def _last_state(events: list[EventRecord]) -> EventRecord | None:
    """The newest state change (by time: a recreated journal's epoch does not sort after the old one)."""
    ends = [e for e in events if e.kind == "run_state"]
    return max(ends, key=lambda e: (e.ts, e.seq)) if ends else None


def _ending(run: RunRecord, events: list[EventRecord], metrics: list[MetricPoint]) -> Ending:
    last = _last_state(events)
    data = last.data if last is not None else {}
    tel = run.telemetry if isinstance(run.telemetry, dict) else {}
    types = sorted(str(k) for k in tel)
    if metrics and "step" not in types:
        types = sorted({*types, "step"})
    ending = Ending(
        verdict="",
        state=run.state,
        cause=run.cause,
        cause_class=run_figures(run, metrics).cause_class,
        exit_code=run.exit_code,
        signal=run.signal,
        ended=run.ended,
        decided_on=str(data["evidence"]) if data.get("evidence") else None,
        ended_by=str(data["ended_by"]) if data.get("ended_by") else None,
        source=f"run_state event #{last.seq}" if last is not None else "no state change recorded",
        telemetry_types=types,
        final_step=run.final_step,
        error=run.error,
    )
    return _with_verdict(run, ending)


def _end_verdict(run: RunRecord, e: Ending) -> tuple[str, list[str]]:
    """The end in words, loud where the evidence does not back a success (failure 8: never "(no output)" read as one)."""
    notes: list[str] = []
    did_work = bool({"manifest", "step", "done"} & set(e.telemetry_types))
    trainer = run.kind in ("fsdp", "dflash")
    if e.state in LIVE_STATES or e.state in ("pending", "starting", "running", "stopping"):
        return f"NOT ENDED: the run is {e.state} (this report is of a run in progress)", notes
    if e.state == "succeeded":
        if e.output_bytes == 0 and not did_work:
            notes.append("exit code 0 is not evidence of work: the run wrote no output and reported no telemetry")
            return "ENDED WITH NO OUTPUT: exit code 0, but the run wrote nothing to its output and reported no telemetry", notes
        if not did_work:
            notes.append("no manifest, no step, no done record: nothing in the history shows what the run did")
            out = f"{e.output_bytes:,} bytes of output" if e.output_bytes is not None else "its output not read"
            return f"ENDED WITH NO EVIDENCE OF WORK: exit code 0, no telemetry ({out})", notes
        if trainer and "done" not in e.telemetry_types:
            notes.append("the trainer reported no 'done' record: its last step is not known to be its final one")
            return "NO EVIDENCE OF COMPLETION: exit code 0 without the trainer's done record", notes
        step = f" at step {e.final_step:,}" if e.final_step is not None else ""
        return f"SUCCEEDED: exit code 0{step}", notes
    if e.state == "preflight_failed":
        return f"REFUSED BEFORE START (pre-flight): {e.cause or 'no cause recorded'}", notes
    if not e.cause:
        notes.append("no cause recorded")
    return f"{(e.state or 'UNKNOWN').upper()}: {e.cause or 'cause unknown'}", notes


def _leftovers(run: RunRecord, events: list[EventRecord], holds: list[HoldRecord]) -> Leftovers:
    lingering: list[int] = []
    for e in events:
        if e.kind == "run_state" and isinstance(e.data.get("lingering"), list):
            lingering = [p for p in e.data["lingering"] if isinstance(p, int)]
    reclaims = []
    for e in events:
        if e.kind != "reclaimed":
            continue
        d = e.data
        pids = [p for p in d.get("pids") or [] if isinstance(p, int)]
        reclaims.append(
            Reclaim(
                ts=e.ts,
                pids=pids,
                state=str(d.get("state") or ""),
                message=str(d.get("message") or ""),
                source=f"reclaimed event #{e.seq}",
                freed_bytes=_int(d.get("freed_bytes")),
            )
        )
    stale = [h for h in holds if h.attribution == "STALE"]
    return Leftovers(lingering=lingering, stale_holds=stale, stop=run.stop_result(), reclaims=reclaims)


def _with_verdict(run: RunRecord, e: Ending) -> Ending:
    """``e`` with its verdict and notes decided."""
    verdict, notes = _end_verdict(run, e)
    return replace(e, verdict=verdict, notes=notes)
