"""Provides the end of a run: the facts gathered, the cause decided (:mod:`gpudeck.agents.runs.exit_cause`), the end journaled."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.health import claims
from gpudeck.agents.observe.procs import alive
from gpudeck.agents.runs import telemetry_fold
from gpudeck.agents.runs.exit_cause import ExitFacts, decide, read_exit_record, telemetry_evidence
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety.containment import put_figures
from gpudeck.agents.wire.causes import classify_output
from gpudeck.agents.wire.protocol import Alert, RunInfo

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor

log = logging.getLogger("gpudeck.agent")


def read_tail(path: Path, max_bytes: int = 64 * 1024) -> str:
    """The last bytes of a file as text ('' when missing)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def finish(sup: Supervisor, lr: LiveRun, *, agent_was_down: bool = False, stopped_cause: str | None = None) -> None:
    """Decide how the run ended and journal it (its last telemetry, figures and claims first)."""
    run = lr.info
    telemetry_fold.poll(sup, lr, ending=True)  # the last records (done, error, the last step) before the run is closed
    # the shim is let go only once the end is journaled: a journal that cannot be written now (disk full)
    # must not cost the exit code on the next try
    if lr.shim is not None:
        lr.shim.poll()
    tail = read_tail(Path(run.run_dir or "") / "output.log")
    figures = lr.group.figures() if lr.group is not None else None
    health = lr.health
    facts = ExitFacts(
        record=read_exit_record(run.run_dir),
        shim_returncode=lr.shim.returncode if lr.shim is not None else None,
        output_tail=tail,
        output_reason=classify_output(tail),
        telemetry_evidence=telemetry_evidence(read_tail(Path(run.run_dir or "") / "telemetry.jsonl", 16 * 1024)),
        agent_was_down=agent_was_down,
        first_death=lr.first_death,
        first_gone=health.first_gone(run) if health is not None and lr.first_death is None else None,
        group_oom_kills=figures.oom_kills if figures is not None else None,
        stopped_cause=stopped_cause,
    )
    end = decide(run, facts)
    if end.node_death is not None:
        node_death_alert(sup, run, end.node_death, end.cause)
    lingering = [m for m in run.members if m.role != "shim" and alive(m.pid, m.create_time)]
    data: dict = {"state": end.state, "cause": end.cause, "exit_code": end.exit_code, "signal": end.signal}
    if lingering:
        data["lingering"] = [m.pid for m in lingering]
    if run.containment is not None:
        if figures is not None:
            put_figures(run.containment, figures)
        data["containment"] = msgspec.to_builtins(run.containment)
    claims.record(sup, lr)
    sup.runs.transition(run, end.state, end.evidence, data, cause=end.cause, exit_code=end.exit_code, signal=end.signal, ended=end.ended)
    lr.shim = None


def node_death_alert(sup: Supervisor, run: RunInfo, gone: tuple[int, int, float], cause: str) -> None:
    """A multi-node member whose rank died and whose torchrun tore the node down before the health tick's grace:
    the other nodes go on (until their collectives fail), so this is the rank-death alert, raised as the node ends."""
    rank, pid, since = gone
    node = f"node {run.spec.node_rank}" if run.spec.node_rank is not None else "this node"
    alert = Alert(
        kind="rank_exited",
        severity="critical",
        ts=time.time(),
        rank=rank,
        pid=pid,
        message=f"rank {rank} (pid {pid}) died on {node} ({sup.host}), which then ended: {cause}; the other nodes lose their peer; "
        f"`gpudeck stop {run.id}`, then relaunch",
        data={"node_rank": run.spec.node_rank, "gone_since": round(since, 3), "member_ended": True},
    )
    sup.runs.emit_many([("alert", run.id, {"alert": msgspec.to_builtins(alert)})], f"run {run.id}'s node-death alert")
    log.warning("run %s: %s", run.id, alert.message)
