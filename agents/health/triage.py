"""Provides the triage of a live run: evidence from every rank, the likely culprit in one line, stored with the run.

A triage is gathered when a ``hang`` alert is raised (``--on-hang triage`` or
``stop``) and on demand (``gpudeck triage RUN``). It never stops or signals the
run beyond the dump request. Per rank (or, for a run without ranks, per member
process) it records:

- every thread's Python stack, by one of two methods, and says which and why:

  - ``faulthandler``: gpudeck's trainers register ``faulthandler`` on a signal
    (their manifest's ``stack_signal``, SIGUSR2) writing into
    ``RUN_DIR/stacks/rank<R>.<PID>.txt``; the agent sends that signal to the
    pid the manifest names and reads what was appended. No ptrace needed; the
    dump is written by the C handler, so it comes also while the main thread
    blocks in a collective. A process without that manifest line is never
    sent a signal (the default action of SIGUSR2 is to terminate).
  - ``py-spy``: ``py-spy dump --pid PID`` (PyPI ``py-spy``) reads the
    process's memory through ptrace permissions: the agent's own user and
    ``kernel.yama.ptrace_scope`` 0 or 1 (1: the runs are the agent's
    descendants), or root / CAP_SYS_PTRACE. Without them the rank's entry
    says what was refused and why.

- its process state (psutil's words: running, sleeping, disk-sleep, zombie,
  stopped), CPU % over ``CPU_SAMPLE_S``, and the utilisation and memory of its
  GPU (the one its pid holds memory on, else the one its manifest names).

The culprit is the rank whose main thread is outside any collective while the
others wait in one ("rank 2 is stuck in `time.sleep(...)` at fsdp_lm.py:123;
every other rank waits in all_gather_into_tensor"). For gpudeck's trainers the
triage also asks every rank of this host for its Flight Recorder (NCCL and
gloo) through the run's folder and stores the cross-rank summary
(agents/health/flight_recorder.py: "rank 2 last completed ... seq 57; ranks 0, 1 and 3
are in seq 58 ...: rank 2 is behind").

Everything read from the run (stack files, py-spy's output of the run's
memory, source lines) is bounded: ``MAX_STACK_BYTES`` per rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import psutil

from gpudeck.agents.health import flight_recorder
from gpudeck.agents.health.access import ANYONE, Reader, open_as, reader_of
from gpudeck.agents.health.rules import Observation
from gpudeck.agents.observe.gpus import GpuSource
from gpudeck.agents.wire.errors import BadRequest
from gpudeck.agents.wire.protocol import Alert, Gpu, RankEvidence, RunInfo, StopResult, Triage
from gpudeck.trainers.contract import stack_file

log = logging.getLogger("gpudeck.agent")

CPU_SAMPLE_S = 1.0  # CPU % is measured over this long (and the faulthandler dumps land meanwhile)
DUMP_WAIT_S = 5.0  # a faulthandler dump not written by then: py-spy is tried instead
PY_SPY_TIMEOUT_S = 10.0
MAX_STACK_BYTES = 64 * 1024  # per rank: what is kept of its stacks
MAX_TRIAGE_STACK_BYTES = 640 * 1024  # all ranks together: a triage is one journal event and one reply (1 MiB each)
MAX_SOURCE_BYTES = 4 << 20  # a source file larger than this is not read for the culprit's line
HANG_STOP_GRACE_S = 30.0  # --on-hang stop: the grace the ranks get (a hung rank will not use it)
STACK_SIGNALS = {"SIGUSR1": signal.SIGUSR1, "SIGUSR2": signal.SIGUSR2}  # the only signals a manifest may ask for
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "reduce_mean_and_stop",
    "gather",
    "scatter",
    "recv",
    "send",
)


# ----------------------------------------------------------------------------- stacks


@dataclass(frozen=True)
class Frame:
    """One Python frame: function, file, line."""

    func: str
    file: str
    line: int


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')
_SPY_THREAD = re.compile(r'^Thread (\S+) \(([^)]*)\)(?:: "(.*)")?')
_SPY_FRAME = re.compile(r"^\s+(.+?) \((.+):(\d+)\)\s*$")


def parse_faulthandler(text: str) -> list[tuple[str, list[Frame]]]:
    """faulthandler's dump as (thread, frames innermost first), threads in its order (the main thread last)."""
    threads: list[tuple[str, list[Frame]]] = []
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip()):
        m = _FH_THREAD.match(block)
        if m is None:
            continue
        frames = []
        for line in block.splitlines()[1:]:
            f = _FH_FRAME.match(line)
            if f is not None:
                frames.append(Frame(f.group(3).strip(), f.group(1), int(f.group(2))))
        threads.append((m.group(2), frames))
    return threads


def parse_py_spy(text: str, pid: int | None = None) -> list[tuple[str, list[Frame]]]:
    """``py-spy dump``'s text as (thread, frames innermost first); the main thread (named MainThread, or whose
    thread id is the pid) is put last, as faulthandler has it."""
    threads: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        t = _SPY_THREAD.match(line)
        if t is not None:
            threads.append((t.group(3) or t.group(1).lower(), []))
            continue
        f = _SPY_FRAME.match(line)
        if f is not None and threads:
            threads[-1][1].append(Frame(f.group(1), f.group(2), int(f.group(3))))
    threads.sort(key=lambda t: t[0] in ("MainThread", str(pid)))
    return threads


def _is_collective(frame: Frame) -> bool:
    path = frame.file.replace("\\", "/")
    name = frame.func.rsplit(".", 1)[-1]
    return "torch/distributed/" in path or any(name == c or name.startswith(c + "_") for c in COLLECTIVES)


def _collective_name(frames: list[Frame]) -> str:
    """The collective a stack waits in: the innermost frame named like one, else the innermost torch.distributed one."""
    for f in frames:
        name = f.func.rsplit(".", 1)[-1]
        if any(name == c or name.startswith(c + "_") for c in COLLECTIVES):
            return name
    return next((f.func for f in frames if "torch/distributed/" in f.file.replace("\\", "/")), frames[0].func if frames else "?")


def source_line(path: str, line: int, reader: Reader = ANYONE) -> str | None:
    """Line ``line`` of the file at ``path`` (stripped, at most 120 characters), or None: a regular file only, bounded.

    The path comes from the run's own stacks (hostile input: a run can name any file in them), and the agent
    may be root: the file is read only when ``reader`` (the rank's own uid and groups; ANYONE: only what everyone
    may read) could open it itself, every folder on the way included (:func:`access.open_as`), and a path whose
    last component is a symbolic link is not followed. Otherwise the frame is described by its function name.
    """
    fd = open_as(path, reader)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_size > MAX_SOURCE_BYTES:
            return None
        data = os.read(fd, MAX_SOURCE_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    lines = data.split(b"\n")
    if not 1 <= line <= len(lines):
        return None
    return lines[line - 1].decode("utf-8", "replace").strip()[:120] or None


def describe_where(frames: list[Frame], reader: Reader = ANYONE) -> str:
    """The innermost frame as "`time.sleep(seconds)` at runtime.py:480 (maybe_sleep_for_test)"."""
    if not frames:
        return "no Python frame"
    f = frames[0]
    code = source_line(f.file, f.line, reader)
    at = f"{os.path.basename(f.file)}:{f.line} ({f.func})"
    return f"`{code}` at {at}" if code else f"{f.func} at {at}"


def _main_thread(threads: list[tuple[str, list[Frame]]]) -> list[Frame]:
    return threads[-1][1] if threads else []


# ----------------------------------------------------------------------------- gathering


@dataclass
class Target:
    """One process a triage gathers evidence from."""

    rank: int | None
    pid: int
    create_time: float | None
    host: str
    stack_signal: str | None = None  # the manifest says this pid dumps its stacks on this signal
    flight_recorder: bool = False  # the manifest says this pid dumps its Flight Recorder on the request file
    gpu_uuid: str | None = None


def ptrace_scope() -> int | None:
    """``kernel.yama.ptrace_scope`` (None: no Yama)."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def py_spy_path() -> str | None:
    """The py-spy binary: next to this interpreter (its wheel's script), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.is_file() and os.access(here, os.X_OK) else shutil.which("py-spy")


def py_spy_dump(pid: int) -> tuple[str | None, str]:
    """(stacks, why): ``py-spy dump --pid`` of one process; stacks None when it could not, ``why`` says why."""
    exe = py_spy_path()
    if exe is None:
        return None, "py-spy is not installed on this host (pip install py-spy)"
    scope = ptrace_scope()
    try:
        cp = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, timeout=PY_SPY_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump took longer than {PY_SPY_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, f"py-spy could not be started ({exc.strerror or exc})"
    out = cp.stdout[:MAX_STACK_BYTES].decode("utf-8", "replace")
    if cp.returncode == 0 and "Thread" in out:
        rule = f"kernel.yama.ptrace_scope={scope}" if scope is not None else "no Yama ptrace restriction"
        who = "root" if os.geteuid() == 0 else "the agent's own user"
        return out, f"py-spy dump (ptrace permitted: {who}, {rule})"
    return (
        None,
        f"py-spy dump failed: {py_spy_error(cp.stderr[:8000].decode('utf-8', 'replace'), cp.returncode)}; {ptrace_refusal(pid, scope)}",
    )


def py_spy_error(stderr: str, returncode: int) -> str:
    """py-spy's error in one line: its "Error:" line and the first cause (its Rust backtrace left out)."""
    lines = [x.strip() for x in stderr.split("Stack backtrace:")[0].splitlines() if x.strip()]
    head = next((x for x in lines if x.startswith("Error:")), lines[-1] if lines else f"exit code {returncode}")
    cause = next((x.split(":", 1)[1].strip() for x in lines if re.match(r"^\d+: ", x)), "")
    return (head + (f" ({cause})" if cause else ""))[:300]


def has_cap_sys_ptrace() -> bool | None:
    """Whether this process holds CAP_SYS_PTRACE in its effective set (None: unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 19 & 1)  # CAP_SYS_PTRACE is capability 19
    except (OSError, ValueError):
        pass
    return None


def ptrace_refusal(pid: int, scope: int | None) -> str:
    """Why ptrace of ``pid`` was likely refused, from what the agent can see, and what would allow it."""
    if scope is not None and scope >= 3:
        return (
            f"kernel.yama.ptrace_scope={scope} forbids ptrace for everyone, root included: set it to 0-2 (it can be lowered only at boot)"
        )
    cap = has_cap_sys_ptrace()
    try:
        uid = psutil.Process(pid).uids().real
    except psutil.Error:
        uid = None
    me = os.geteuid()
    if cap:
        return "ptrace was refused although the agent holds CAP_SYS_PTRACE (a security module such as AppArmor or SELinux)"
    if scope is not None and scope >= 2:
        return f"kernel.yama.ptrace_scope={scope} allows ptrace only with CAP_SYS_PTRACE, which the agent (uid {me}) lacks: give it CAP_SYS_PTRACE"
    if uid is not None and uid != me:
        return f"pid {pid} runs as uid {uid} and the agent as uid {me} without CAP_SYS_PTRACE: run the agent as that user, or give it CAP_SYS_PTRACE"
    if cap is False:
        return (
            f"the agent (uid {me}) lacks CAP_SYS_PTRACE, and pid {pid}, although its own user's, is not dumpable "
            "(it called prctl(PR_SET_DUMPABLE, 0), or runs a setuid or file-capability program): give the agent CAP_SYS_PTRACE"
        )
    return "ptrace was refused (a container without CAP_SYS_PTRACE, or another user's process): give the agent CAP_SYS_PTRACE"


def _stack_file(run_dir: str, rank: int | None, pid: int) -> Path:
    """Where a trainer's faulthandler writes (the trainers' contract names it for both sides)."""
    return Path(stack_file(run_dir, rank if rank is not None else 0, pid))


def _size(path: Path) -> int:
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def _read_from(path: Path, offset: int) -> str:
    """What was appended to ``path`` past ``offset`` (a regular file, not through a link; bounded)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone, or a symbolic link (ELOOP: not followed)
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.pread(fd, MAX_STACK_BYTES, max(offset, 0)).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _identity_ok(t: Target) -> psutil.Process | None:
    try:
        p = psutil.Process(t.pid)
        if t.create_time is not None and abs(p.create_time() - t.create_time) > 0.05:
            return None
        return p
    except psutil.Error:
        return None


def _gpu_of(t: Target, gpus: list[Gpu]) -> tuple[int | None, int | None, int | None]:
    for g in gpus:
        for p in g.processes:
            if p.pid == t.pid:
                return g.index, g.util_gpu, p.used_bytes
    for g in gpus:
        if t.gpu_uuid and g.uuid == t.gpu_uuid:
            return g.index, g.util_gpu, None
    return None, None, None


def collect(targets: list[Target], run_dir: str, gpus: list[Gpu]) -> list[RankEvidence]:
    """Every target's evidence (blocking: run it in a thread). Signals only the pids whose manifest asked for it."""
    procs = {t.pid: _identity_ok(t) for t in targets}
    cpu0: dict[int, float] = {}
    for t in targets:
        p = procs[t.pid]
        if p is not None:
            try:
                c = p.cpu_times()
                cpu0[t.pid] = c.user + c.system
            except psutil.Error:
                pass
    t0 = time.monotonic()
    # 1. ask every trainer rank for its faulthandler dump (the C handler writes it even while Python is blocked)
    sent: dict[int, tuple[Path, int]] = {}
    why_not_fh: dict[int, str] = {}
    for t in targets:
        sig = STACK_SIGNALS.get(t.stack_signal or "")
        if sig is None:
            why_not_fh[t.pid] = "not a gpudeck trainer (no stack_signal in its manifest)"
            continue
        if procs[t.pid] is None:
            why_not_fh[t.pid] = "the process is gone"
            continue
        path = _stack_file(run_dir, t.rank, t.pid)
        before = _size(path)
        if before < 0:
            why_not_fh[t.pid] = f"its dump file {path} is missing or not a regular file"
            continue
        try:
            os.kill(t.pid, sig)
        except OSError as exc:
            why_not_fh[t.pid] = f"{t.stack_signal} could not be sent ({exc.strerror})"
            continue
        sent[t.pid] = (path, before)
    # 2. py-spy, in parallel, for every target without a faulthandler request
    spy: dict[int, tuple[str | None, str]] = {}
    need_spy = [t for t in targets if t.pid not in sent and procs[t.pid] is not None]
    pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(targets))))
    try:
        futures = {t.pid: pool.submit(py_spy_dump, t.pid) for t in need_spy}
        time.sleep(max(0.0, CPU_SAMPLE_S - (time.monotonic() - t0)))
        # 3. the faulthandler dumps: written within milliseconds; a stopped (T) or D-state process may never write
        dumps: dict[int, str] = {}
        deadline = time.monotonic() + DUMP_WAIT_S
        while True:
            for pid, (path, before) in sent.items():
                if pid not in dumps and _size(path) > before:
                    time.sleep(0.05)  # the handler writes thread by thread: let it finish
                    dumps[pid] = _read_from(path, before)
            if len(dumps) == len(sent) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        late = [t for t in targets if t.pid in sent and t.pid not in dumps]
        for t in late:
            futures[t.pid] = pool.submit(py_spy_dump, t.pid)
        for pid, fut in futures.items():
            spy[pid] = fut.result()
    finally:
        pool.shutdown(wait=True)
    wall = max(time.monotonic() - t0, 1e-3)
    out: list[RankEvidence] = []
    for t in targets:
        p = procs[t.pid]
        ev = RankEvidence(rank=t.rank, pid=t.pid, host=t.host)
        if p is None:
            ev.state = "gone"
            ev.method, ev.method_why = "none", "the process is gone (or its pid was reused)"
            out.append(ev)
            continue
        try:
            ev.state = p.status()
            c = p.cpu_times()
            if t.pid in cpu0:
                ev.cpu_percent = round(100.0 * (c.user + c.system - cpu0[t.pid]) / wall, 1)
        except psutil.Error:
            ev.state = ev.state or "gone"
        ev.gpu, ev.gpu_util, ev.gpu_memory = _gpu_of(t, gpus)
        threads: list[tuple[str, list[Frame]]] = []
        if t.pid in dumps and dumps[t.pid].strip():
            ev.method = "faulthandler"
            ev.method_why = f"gpudeck trainer: {t.stack_signal} to its faulthandler, written to {_stack_file(run_dir, t.rank, t.pid).name} (no ptrace needed)"
            ev.stacks = dumps[t.pid]
            threads = parse_faulthandler(ev.stacks)
        else:
            stacks, why = spy.get(t.pid, (None, "not tried"))
            lead = ""
            if t.pid in sent:
                lead = f"its faulthandler did not write within {DUMP_WAIT_S:.0f} s (state {ev.state}); "
            elif t.pid in why_not_fh:
                lead = f"{why_not_fh[t.pid]}; "
            if stacks is not None:
                ev.method, ev.method_why, ev.stacks = "py-spy", lead + why, stacks
                threads = parse_py_spy(stacks, t.pid)
            else:
                ev.method, ev.method_why = "none", lead + why
        main = _main_thread(threads)
        if threads:
            # source lines are read only as far as the rank's own user (and groups) could
            owner = reader_of(t.pid) or ANYONE
            ev.in_collective = any(_is_collective(f) for f in main)
            ev.where = (f"in {_collective_name(main)}: " if ev.in_collective else "") + describe_where(main, owner)
        out.append(ev)
    return out


# ----------------------------------------------------------------------------- the culprit


def _ranks_text(evs: list[RankEvidence]) -> str:
    names = [f"rank {e.rank}" if e.rank is not None else f"pid {e.pid}" for e in evs]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _who(e: RankEvidence) -> str:
    who = f"rank {e.rank}" if e.rank is not None else f"pid {e.pid}"
    on = f" on {e.host}" if e.host else ""
    gpu = f" (GPU {e.gpu})" if e.gpu is not None else ""
    return who + on + gpu


def culprit(evs: list[RankEvidence]) -> str:
    """One line: who is stuck where, and what the others do."""
    if not evs:
        return "no live rank to look at"
    odd = [e for e in evs if e.state in ("stopped", "disk-sleep", "zombie", "gone", "tracing-stop")]
    known = [e for e in evs if e.in_collective is not None]
    waiting = [e for e in known if e.in_collective]
    outside = [e for e in known if not e.in_collective]
    waits = sorted({e.where.split(":")[0].removeprefix("in ") for e in waiting})
    waits_text = " / ".join(waits) or "a collective"
    if odd:
        e = odd[0]
        state = {
            "stopped": "stopped (state T: SIGSTOP or a debugger)",
            "disk-sleep": "in uninterruptible sleep (D state: I/O or the driver)",
        }.get(e.state or "", e.state or "?")
        rest = f"; {_ranks_text(waiting)} wait in {waits_text}" if waiting else ""
        return f"{_who(e)} is {state}{rest}"
    if outside and waiting:
        lone = outside[0]
        others = "every other rank waits" if len(waiting) == len(evs) - 1 else f"{_ranks_text(waiting)} wait"
        if len(outside) == 1:
            return f"{_who(lone)} is stuck in {lone.where}; {others} in {waits_text}"
        return f"{_ranks_text(outside)} are outside collectives ({_who(lone)} in {lone.where}); {others} in {waits_text}"
    if waiting and not outside:
        missing = [e for e in evs if e.in_collective is None]
        if missing:
            return f"{_ranks_text(waiting)} wait in {waits_text}; no stacks from {_ranks_text(missing)}: it is the likely culprit"
        return (
            f"every rank here ({_ranks_text(waiting)}) waits in {waits_text}: the rank they wait for is on another host, "
            f"or they are in different collectives (a desync)"
        )
    if outside:
        if len(outside) == 1:
            return f"{_who(outside[0])} is in {outside[0].where}"
        return "; ".join(f"{_who(e)} is in {e.where}" for e in outside[:4])
    return "no stacks could be gathered: " + "; ".join(f"{_who(e)}: {e.method_why}" for e in evs[:2])


def flight_recorder_note(run: RunInfo) -> str:
    """Why there is no Flight Recorder summary of this run (the summary itself: agents/health/flight_recorder.py)."""
    tel = run.telemetry
    ranks = list(tel.ranks.values()) if tel is not None else []
    if not ranks or all(not rt.device for rt in ranks):
        return "no Flight Recorder: the run is not a gpudeck trainer (no manifest)"
    if not any(rt.flight_recorder for rt in ranks):
        return "no Flight Recorder: the trainers' manifests offer no dump on request (an older gpudeck, or a torch without _dump_fr_trace_json)"
    return "no Flight Recorder: no live rank of this host offers a dump on request"


# ----------------------------------------------------------------------------- the supervisor's side


def targets_of(run: RunInfo, live_ranks: dict[int, int], host: str) -> list[Target]:
    """The processes to look at: the live ranks, else every member but the shim."""
    tel = run.telemetry
    ranks = tel.ranks if tel is not None else {}
    by_pid = {m.pid: m for m in run.members}
    out = []
    if live_ranks:
        for rank, pid in sorted(live_ranks.items()):
            rt = ranks.get(str(rank))
            named = rt is not None and rt.pid == pid
            m = by_pid.get(pid)
            out.append(
                Target(
                    rank=rank,
                    pid=pid,
                    create_time=m.create_time if m is not None else None,
                    host=(rt.host if rt is not None and rt.host else host),
                    stack_signal=rt.stack_signal if named and rt is not None else None,
                    flight_recorder=named and rt is not None and rt.flight_recorder == "request_file",
                    gpu_uuid=rt.gpu_uuid if rt is not None else None,
                )
            )
        return out
    return [Target(rank=None, pid=m.pid, create_time=m.create_time, host=host) for m in run.members if m.role != "shim"]


class TriagedRun(Protocol):
    """What a triage needs of a live run (agents/runs/liverun.py's LiveRun is one): health/ never imports runs/."""

    info: RunInfo
    last_obs: Observation | None
    triage_task: asyncio.Task[Triage] | None

    @property
    def id(self) -> str: ...

    def set_triage_task(self, task: asyncio.Task[Triage]) -> None: ...


class TriageHost(Protocol):
    """What a triage needs of the run's supervisor (agents/runs/supervisor.py's Supervisor is one)."""

    host: str
    gpus: GpuSource

    def attributed_gpus(self, gpus: list[Gpu] | None = None) -> list[Gpu]: ...

    def resolve(self, ref: str) -> RunInfo: ...

    def live_run(self, run_id: str) -> TriagedRun | None: ...

    def journal_many(self, items: list[tuple[str, str | None, dict]], what: str) -> None: ...

    def stop_under_way(self, run_id: str) -> bool: ...

    async def stop(self, ref: str, grace_s: float = 30.0, reason: str = "stopped by operator") -> StopResult: ...

    def spawn_bg(self, coro: Coroutine[Any, Any, Any]) -> None: ...


async def gather(sup: TriageHost, lr: TriagedRun, reason: str) -> Triage:
    """Gather, store (journal event ``triage``) and return a triage of a live run; one at a time per run."""
    if lr.triage_task is not None and not lr.triage_task.done():
        return await asyncio.shield(lr.triage_task)
    task = asyncio.ensure_future(_gather(sup, lr, reason))
    lr.set_triage_task(task)
    return await asyncio.shield(task)


async def _gather(sup: TriageHost, lr: TriagedRun, reason: str) -> Triage:
    run = lr.info
    started = time.time()
    live = dict(lr.last_obs.live_ranks) if lr.last_obs is not None else {}
    targets = targets_of(run, live, sup.host)
    gpus: list[Gpu] = []
    if sup.gpus.available:
        gpus = await asyncio.to_thread(sup.attributed_gpus)
    fr_ranks = [(t.rank, t.pid) for t in targets if t.flight_recorder and t.rank is not None]
    nonce = await asyncio.to_thread(flight_recorder.request, run.run_dir) if fr_ranks and run.run_dir else None
    evs = await asyncio.to_thread(collect, targets, run.run_dir or "", gpus)
    fr_text = flight_recorder_note(run)
    if nonce is not None and run.run_dir:  # the ranks answered while the stacks were gathered (they poll every 0.25 s)
        dumps = await asyncio.to_thread(flight_recorder.collect, run.run_dir, fr_ranks, nonce)
        fr_text = flight_recorder.summarise(dumps, [r for r, _ in fr_ranks])
    share = MAX_TRIAGE_STACK_BYTES // max(1, len(evs))
    for e in evs:
        if len(e.stacks.encode()) > share:  # the head: the main thread is last, but every thread's top frames come first
            e.stacks = e.stacks.encode()[:share].decode("utf-8", "ignore") + "\n... (cut: the triage keeps 640 KiB of stacks in all)"
    missing = [f"{_who(e)}: no stacks ({e.method_why})" for e in evs if e.method == "none"]
    t = Triage(
        run_id=run.id,
        ts=time.time(),
        reason=reason,
        culprit=culprit(evs),
        seconds=round(time.time() - started, 2),
        ranks=evs,
        flight_recorder=fr_text,
        missing=missing,
    )
    sup.journal_many([("triage", run.id, {"triage": msgspec.to_builtins(t)})], f"run {run.id}'s triage")
    log.warning("run %s: triage (%s): %s", run.id, reason, t.culprit)
    return t


async def on_demand(sup: TriageHost, ref: str) -> Triage:
    """``gpudeck triage RUN``: a live run's triage now (BadRequest for a run that is not live)."""
    run = sup.resolve(ref)
    lr = sup.live_run(run.id)
    if lr is None or run.state not in ("running", "starting", "stopping"):
        raise BadRequest(
            f"run {run.id} is {run.state}, not live: a triage looks at live processes (`gpudeck show {run.id}` has any stored)"
        )
    return await gather(sup, lr, "on demand")


def on_alerts(sup: TriageHost, lr: TriagedRun, raised: list[Alert]) -> None:
    """The supervisor's hook after the health rules: a raised hang is triaged (and the run stopped) per ``--on-hang``."""
    hang = next((a for a in raised if a.kind == "hang"), None)
    policy = lr.info.spec.on_hang
    if hang is None or policy == "alert":
        return

    async def act() -> None:
        try:
            await gather(sup, lr, "hang alert")
        except Exception:  # evidence is a report: a failure is logged, never the end of the agent's loop
            log.exception("run %s: the triage of its hang failed", lr.id)
        if policy == "stop" and not sup.stop_under_way(lr.id):
            await sup.stop(
                lr.id,
                HANG_STOP_GRACE_S,
                reason=f"stopped by gpudeck: {hang.message.split(':')[0]} and the run was launched with --on-hang stop",
            )

    sup.spawn_bg(act())
