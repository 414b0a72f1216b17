"""Provides the end of a run: whether it still lives (the kernel judges), how it ended (decided from what it left), the end journaled.

:func:`liveness`: a run lives while its shim does, else while its group is
populated (or, without a group, while a member found by tag + ancestry lives).
:func:`decide` is a pure decision over the facts :func:`finish` gathers, so the
rules read in one place: the shim's exit record first; the shim's own return
code when the record could not be written (with what was checked); ``lost``,
dated by the run's last evidence, when neither exists; the first rank that
died; the OOM killer, from the run's cgroup (``memory.events`` ``oom_kill``)
where the kernel counts it, else from the kernel log.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.health import claims
from gpudeck.agents.health.rules import observe
from gpudeck.agents.observe.procs import alive
from gpudeck.agents.observe.telemetry import LineRejected, decode_line, decode_object
from gpudeck.agents.runs import run_telemetry, states
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety.containment import put_figures
from gpudeck.agents.wire.causes import classify_output, host_oom_note
from gpudeck.agents.wire.protocol import Alert, RunInfo

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor


@dataclass(frozen=True)
class ExitFacts:
    """What is known of a run at its end."""

    record: dict | None  # exit.json
    shim_returncode: int | None  # when this agent reaped the shim
    output_tail: str
    output_reason: str | None  # classify_output(output_tail)
    telemetry_evidence: str
    agent_was_down: bool = False
    first_death: Alert | None = None
    first_gone: tuple[int, int, float] | None = None  # (rank, pid, since) from the health state
    group_oom_kills: int | None = None  # memory.events oom_kill of the run's group (None: not counted here)
    stopped_cause: str | None = None
    shim_gone: str | None = None  # how the shim went without an exit status (killed, or gone while no agent watched)
    missing_record: str | None = None  # the shim exited by itself without exit.json: what was checked (its message, free space)
    last_evidence: tuple[float, str] | None = None  # no exit status: the latest moment the run is known alive, and what says so


@dataclass(frozen=True)
class ExitCause:
    """The decided end."""

    state: str
    cause: str
    exit_code: int | None
    signal: str | None
    ended: float
    evidence: str  # what the end was decided on (agents/runs/states.py)
    ended_by: str | None = None  # no exit status: what ``ended`` is (the run's last evidence), said in the event
    rank_death: tuple[int, int, float] | None = None  # (rank, pid, since): a rank died first and no alert said so yet


MAX_EXIT_RECORD = 64 * 1024  # the shim writes ~100 bytes; the run's folder is the run's to write, so anything may be there


_EXIT_TEXT_MAX = 2000  # launch_error and note as kept (the shim writes a line)


def _typed_exit_record(rec: dict) -> dict | None:
    """Only the fields the shim writes, each of its type (a run can rewrite its exit.json with anything): returncode an
    int in 0..255 (or a negative signal number), signal a short string, ended a finite time, launch_error and note
    strings; a field of another type is dropped, so the decision never sees it. None when nothing usable is left."""
    out: dict = {}
    code = rec.get("returncode")
    if isinstance(code, int) and not isinstance(code, bool) and -128 <= code <= 255:
        out["returncode"] = code
    sig = rec.get("signal")
    if isinstance(sig, str) and 0 < len(sig) <= 32:
        out["signal"] = sig
    ended = rec.get("ended")
    if isinstance(ended, (int, float)) and not isinstance(ended, bool) and 0 < ended < 1e11:
        out["ended"] = float(ended)
    for key in ("launch_error", "note"):
        v = rec.get(key)
        if isinstance(v, str) and v:
            out[key] = v[:_EXIT_TEXT_MAX]
    return out or None


def read_exit_record(run_dir: str | None) -> dict | None:
    """The shim's exit.json, typed (:func:`_typed_exit_record`), or None: missing, or replaced by the run with something
    that is not a small JSON object (over 64 KiB, nested deeper than the telemetry reader's limit, invalid UTF-8)."""
    try:  # never through a link, never blocking on a FIFO the run put there
        fd = os.open(Path(run_dir or "") / "exit.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            raw = fh.read(MAX_EXIT_RECORD + 1)
        rec = decode_object(raw) if len(raw) <= MAX_EXIT_RECORD else {}
    except (OSError, LineRejected):
        return None
    return _typed_exit_record(rec) if isinstance(rec, dict) else None


def telemetry_evidence(tail: str) -> str:
    """What the trainer's telemetry says of its end ('' when nothing)."""
    last_step = None
    for line in tail.splitlines():
        try:  # the run's own lines: bounded, typed decoding (a hostile line is skipped, never raised)
            rec, _typed = decode_line(line.encode("utf-8", "surrogateescape"))
        except LineRejected:
            continue
        if rec.get("type") == "done":
            return f"the trainer reported done at step {rec.get('final_step')}"
        if rec.get("type") == "error":
            return f"the trainer reported an error: {str(rec.get('message'))[:200]}"
        if rec.get("type") == "step":
            last_step = rec.get("step")
    return f"last step reported: {last_step}" if last_step is not None else ""


def _record_from_shim(rc: int, why: str | None) -> dict:
    sig_name = None
    if rc > 128:
        try:
            sig_name = signal.Signals(rc - 128).name
        except ValueError:
            sig_name = None
    note = "exit.json could not be written (the code is the shim's own)" + (f": {why}" if why else "")
    return {"returncode": None if sig_name else rc, "signal": sig_name, "ended": time.time(), "note": note}


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.{0,400}?rank\s*:\s*(\d{1,6}).{0,200}?exitcode\s*:\s*(-?\d{1,4}) \(pid: (\d{1,10})\)", re.S
)


def torchrun_first_failure(tail: str) -> tuple[int, int] | None:
    """(rank, pid) of torchrun's "Root Cause (first observed failure)" in the run's output, or None (bounded match)."""
    got = None
    for m in _ROOT_CAUSE.finditer(tail):
        got = (int(m.group(1)), int(m.group(3)))
    return got


def _date(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 10)}"


def decide(run: RunInfo, f: ExitFacts) -> ExitCause:
    """The run's final state, cause, exit code and signal."""
    rec = f.record
    evidence = states.EXIT_RECORD
    ended_by = None
    if rec is None and f.shim_returncode is not None and 0 <= f.shim_returncode != 127:
        # exit.json could not be written (disk full?), but this agent reaped the shim, which exited by itself: its code
        # is the run's. A shim killed by a signal (a negative code) says nothing of the command, so it is not used.
        rec = _record_from_shim(f.shim_returncode, f.missing_record)
        evidence = states.SHIM_EXIT
    now = time.time()
    rank_death = None
    if rec is not None and rec.get("launch_error"):
        state, cause, code, sig = "failed", f"launch failed: {rec['launch_error']}", None, None
    elif rec is not None:
        code, sig = rec.get("returncode"), rec.get("signal")
        now = rec.get("ended") or now
        if code == 0:
            state, cause = "succeeded", "exit code 0"
        elif sig:
            state, cause = "failed", f"killed by {sig}"
        else:
            state, cause = "failed", f"exit code {code}"
        if state == "failed" and f.output_reason:
            cause += f" ({f.output_reason})"
        if f.agent_was_down:
            cause += "; ended while the agent was down"
    else:
        code, sig = None, None
        evidence = states.MEMBERS_GONE
        state = "lost"
        if f.shim_gone is not None:
            cause = f"exit status unknown: {f.shim_gone}, and every process of the run has ended since"
        else:
            cause = "agent lost track: the run ended and left no exit status"
        if f.agent_was_down:
            cause += " (it ended while the agent was down)"
        if f.last_evidence is not None:
            now, ended_by = f.last_evidence
            cause += f"; ended by {_date(now)} at the latest (the last evidence: {ended_by})"
        else:
            ended_by = "when the agent found it ended (no earlier evidence)"
        if f.telemetry_evidence:
            cause += f"; {f.telemetry_evidence}"
        if f.output_reason:
            cause += f"; output shows {f.output_reason}"
    if state == "failed":
        gone = f.first_gone if f.first_death is None else None
        if gone is None and f.first_death is None:
            named = torchrun_first_failure(f.output_tail)  # torchrun's own report: the rank it saw fail first
            if named is not None:
                gone = (named[0], named[1], now)
        if f.first_death is not None:
            cause += f"; rank {f.first_death.rank} died first ({f.first_death.message.split(':')[0]})"
        elif gone is not None:
            cause += f"; rank {gone[0]} died first (pid {gone[1]}; the others were torn down after it)"
            tel = run.telemetry
            world = run.spec.expected_ranks or (tel.world_size if tel is not None else None) or 1
            if (run.spec.nnodes or 1) > 1 or world > 1:
                rank_death = gone
        tail = f.output_tail
        killed = sig == "SIGKILL" or "exitcode: -9" in tail or "Signals.SIGKILL" in tail
        if killed:
            oom = None
            if f.group_oom_kills:
                oom = f"the run's cgroup counted {f.group_oom_kills} OOM kill(s) (memory.events oom_kill)"
                detail = host_oom_note([m.pid for m in run.members], run.started or run.created)
                if detail:
                    oom += f"; {detail}"
            else:
                oom = host_oom_note([m.pid for m in run.members], run.started or run.created)
            if oom:
                cause = f"{cause} (host OOM killer: {oom})"
    if rec is not None and rec.get("note"):
        cause += f"; {rec['note']}"
    if f.stopped_cause is not None:
        state, cause = "stopped", f"{f.stopped_cause} ({cause})"
        rank_death = None  # an operator's stop ended it, not the rank
    return ExitCause(
        state=state, cause=cause, exit_code=code, signal=sig, ended=now, evidence=evidence, ended_by=ended_by, rank_death=rank_death
    )


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
    else:  # adopted without a shim on record (an earlier agent died while starting it): its members say, and
        # the shim among them (found by its tag) may still write the exit status, so nothing is said to be lost
        how = None
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
    lr.note_shim_lost(life.shim_gone)
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
    run_telemetry.poll(sup, lr, ending=True)  # the last records (done, error, the last step) before the run is closed
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
    claims.record(sup.runs.append, lr.id, lr.last_obs)
    sup.runs.transition(run, end.state, end.evidence, data, cause=end.cause, exit_code=end.exit_code, signal=end.signal, ended=end.ended)
    lr.release_shim()


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
