"""Provides the end of a run: whether it lives (the kernel judges), the facts gathered, the cause decided
(:mod:`gpudeck.agents.runs.exit_cause`), the end journaled with its evidence."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.health import claims
from gpudeck.agents.health.rules import observe
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


@dataclass(frozen=True)
class Liveness:
    """Whether a run lives, judged by the kernel where it can be: its group's members, not its shim."""

    alive: bool
    members: int = 0  # processes of the run still running (counted only once its shim is gone)
    shim_gone: str | None = None  # how the shim went, when it went without an exit status (the run's fate is its members')


def liveness(lr: LiveRun) -> Liveness:
    """A run lives while its shim does; a shim gone without an exit status leaves the judgement to the run's members.

    The shim writes exit.json before it exits, so a shim gone with the record means the command ended (what is left
    are leftovers). A shim gone without one (SIGKILLed, or an earlier agent's shim that died) says nothing of the
    command: the run lives while its group is populated (the kernel's count) or, without a group, while a member
    found by tag + ancestry lives.
    """
    run = lr.info
    shim_m = lr.member("shim")
    if lr.shim is not None:
        if lr.shim.poll() is None:
            return Liveness(True)
        if lr.shim.returncode >= 0:  # it exited by itself: the command ended (exit.json, or the code the shim returned)
            return Liveness(False)
        how = f"its shim (pid {lr.shim.pid}, the parent of the run's command) was killed ({_signal_name(-lr.shim.returncode)})"
    elif shim_m is not None:
        if alive(shim_m.pid, shim_m.create_time):
            return Liveness(True)
        how = (
            f"its shim (pid {shim_m.pid}, the parent of the run's command) is gone; how it ended is not known (this agent did not start it)"
        )
    else:  # adopted without a shim on record (an earlier agent died while starting it)
        how = "no shim is on record for it (an earlier agent died while starting it)"
    if read_exit_record(run.run_dir) is not None:
        return Liveness(False)
    if lr.group is not None:
        n = len(lr.group.pids()) if lr.group.populated() else 0
    else:
        n = sum(1 for m in run.members if m.role != "shim" and alive(m.pid, m.create_time))
    return Liveness(n > 0, members=n, shim_gone=how)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def note_shim_gone(sup: Supervisor, lr: LiveRun, life: Liveness) -> None:
    """Journal, once, that the run goes on without its shim: what happened and how many of its processes still run."""
    if life.shim_gone is None or lr.shim_lost is not None:
        return
    lr.shim_lost = life.shim_gone
    where = f"in its group {lr.group.path}" if lr.group is not None else "found by its tag and ancestry"
    note = (
        f"{life.shim_gone}; {life.members} process(es) of the run still run {where}: the run stays live and supervised "
        f"(output, telemetry, health, stop); its exit status will not be known"
    )
    shim_m = lr.member("shim")
    data = {"note": note, "shim_pid": shim_m.pid if shim_m is not None else None, "members": life.members}
    sup.runs.emit_many([("shim_lost", lr.id, data)], f"run {lr.id}'s lost shim")
    log.warning("run %s: %s", lr.id, note)


def last_evidence(lr: LiveRun) -> tuple[float, str] | None:
    """The latest moment the run is known to have been alive, and what says so (a lost run's end is dated by it)."""
    run = lr.info
    now = time.time()
    floor = run.created  # (output.log is made before the run is marked started)
    found: list[tuple[float, str]] = []
    if lr.last_seen_alive is not None:
        found.append((lr.last_seen_alive, "the last moment this agent saw its processes alive"))
    tel = run.telemetry
    if tel is not None and tel.last_ts is not None and floor <= tel.last_ts <= now:  # the trainer's clock: only within the run
        found.append((tel.last_ts, "its last telemetry record"))
    for name in ("telemetry.jsonl", "output.log"):
        try:
            mtime = os.stat(Path(run.run_dir or "") / name, follow_symlinks=False).st_mtime
        except OSError:
            continue
        if floor <= mtime <= now:
            found.append((mtime, f"the last write to its {name}"))
    return max(found) if found else None


_SHIM_SAID = re.compile(r"gpudeck-shim: could not write \S+ \(([^)\n]{1,200})\)")


def missing_exit_record(run_dir: str | None, output_tail: str) -> str:
    """Why exit.json is missing though the shim exited by itself, from what was checked: the shim's own message in
    output.log and the free space of the run folder's file system now."""
    parts = []
    said = _SHIM_SAID.findall(output_tail)
    if said:
        parts.append(f"the shim reported {said[-1]!r}")
    try:
        st = os.statvfs(run_dir or ".")
        free = st.f_bavail * st.f_frsize
        full = free < FULL_BELOW_BYTES or st.f_favail == 0
        parts.append(
            f"its file system has {free / 2**20:.1f} MiB and {st.f_favail} inodes free now" + (" (full)" if full else " (not full now)")
        )
    except OSError as exc:
        parts.append(f"its file system could not be checked ({exc.strerror})")
    return "; ".join(parts)


FULL_BELOW_BYTES = 1 << 20  # a file system with less free than this counts as full (exit.json is ~100 bytes; fsync needs room)


def finish(sup: Supervisor, lr: LiveRun, *, agent_was_down: bool = False, stopped_cause: str | None = None) -> None:
    """Decide how the run ended and journal it (its last telemetry, figures, claims and a first rank's death first)."""
    run = lr.info
    telemetry_fold.poll(sup, lr, ending=True)  # the last records (done, error, the last step) before the run is closed
    # the shim is let go only once the end is journaled: a journal that cannot be written now (disk full)
    # must not cost the exit code on the next try
    if lr.shim is not None:
        lr.shim.poll()
    tail = read_tail(Path(run.run_dir or "") / "output.log")
    figures = lr.group.figures() if lr.group is not None else None
    health = lr.health
    if health is not None and lr.first_death is None:
        # the end may come before the tick saw a rank gone (torchrun tears a node down within its monitor interval):
        # one last look records every rank seen alive earlier and gone now, so the first to go is known
        health.update(observe(run, time.time(), [], lambda m: alive(m.pid, m.create_time), stopping=True), None)
    record = read_exit_record(run.run_dir)
    shim_rc = lr.shim.returncode if lr.shim is not None else None
    shim_gone = lr.shim_lost
    if record is None and shim_gone is None:
        shim_gone = liveness(lr).shim_gone
    facts = ExitFacts(
        record=record,
        shim_returncode=shim_rc,
        output_tail=tail,
        output_reason=classify_output(tail),
        telemetry_evidence=telemetry_evidence(read_tail(Path(run.run_dir or "") / "telemetry.jsonl", 16 * 1024)),
        agent_was_down=agent_was_down,
        first_death=lr.first_death,
        first_gone=health.first_gone(run) if health is not None and lr.first_death is None else None,
        group_oom_kills=figures.oom_kills if figures is not None else None,
        stopped_cause=stopped_cause,
        shim_gone=shim_gone,
        missing_record=missing_exit_record(run.run_dir, tail) if record is None and shim_rc is not None and shim_rc >= 0 else None,
        last_evidence=last_evidence(lr) if record is None else None,
    )
    end = decide(run, facts)
    if end.rank_death is not None:
        rank_death_alert(sup, run, end.rank_death, end.cause)  # journaled before the end: a rank's death came first
    lingering = [m for m in run.members if m.role != "shim" and alive(m.pid, m.create_time)]
    data: dict = {"state": end.state, "cause": end.cause, "exit_code": end.exit_code, "signal": end.signal}
    if end.ended_by is not None:
        data["ended_by"] = end.ended_by
    if lingering:
        data["lingering"] = [m.pid for m in lingering]
    if run.containment is not None:
        if figures is not None:
            put_figures(run.containment, figures)
        data["containment"] = msgspec.to_builtins(run.containment)
    claims.record(sup, lr)
    sup.runs.transition(run, end.state, end.evidence, data, cause=end.cause, exit_code=end.exit_code, signal=end.signal, ended=end.ended)
    lr.shim = None


def rank_death_alert(sup: Supervisor, run: RunInfo, gone: tuple[int, int, float], cause: str) -> None:
    """A rank died and the run (or, multi-node, this node) ended before the health tick's grace raised it: the rank's
    death is the first evidence of the end, so its rank_exited alert is journaled, before the end, whatever ended first
    (the other nodes of a multi-node run go on until their collectives fail)."""
    rank, pid, since = gone
    if (run.spec.nnodes or 1) > 1:
        node = f"node {run.spec.node_rank}" if run.spec.node_rank is not None else "this node"
        message = (
            f"rank {rank} (pid {pid}) died on {node} ({sup.host}), which then ended: {cause}; the other nodes lose their peer; "
            f"`gpudeck stop {run.id}`, then relaunch"
        )
    else:
        message = f"rank {rank} (pid {pid}) died on {sup.host} and the run then ended: {cause}; relaunch it"
    alert = Alert(
        kind="rank_exited",
        severity="critical",
        ts=time.time(),
        rank=rank,
        pid=pid,
        message=message,
        data={"node_rank": run.spec.node_rank, "gone_since": round(since, 3), "member_ended": True},
    )
    sup.runs.emit_many([("alert", run.id, {"alert": msgspec.to_builtins(alert)})], f"run {run.id}'s rank-death alert")
    log.warning("run %s: %s", run.id, alert.message)
