"""Provides how an ended run's state and cause are decided from what it left: exit.json, output, telemetry, its group.

A pure decision (:func:`decide`) over facts the supervisor gathers, so the
rules read in one place: the shim's exit record first; the shim's own return
code when the record could not be written; "lost" with the telemetry's
evidence when neither exists; the first rank that died; the OOM killer, from
the run's cgroup (``memory.events`` ``oom_kill``) where the kernel counts it,
else from the kernel log.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from gpudeck.agents.observe.telemetry import LineRejected, decode_line, decode_object
from gpudeck.agents.runs import states
from gpudeck.agents.wire.causes import host_oom_note
from gpudeck.agents.wire.protocol import Alert, RunInfo


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
