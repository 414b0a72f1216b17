"""Provides the process table: which processes exist, and which run each belongs to.

Run membership comes from the ``GPUDECK_RUN_ID`` tag in a process's environment,
so torchrun workers in their own sessions and grandchildren re-parented to init
are found wherever they went. The table is refreshed incrementally: only pids
that are new since the last refresh are read, so a refresh costs one
``listdir('/proc')`` in the steady state.

A process may also declare GPU memory it holds on *simulated* GPUs through
``GPUDECK_SIM_GPU_MEM`` (see ``agents/gpus_sim.py``); the declaration is parsed
in the same single read of the environment.

Processes are identified by ``(pid, create_time)``; anything that signals a
process goes through :func:`signal_exact`, which refuses a pid whose
create_time changed (PID reuse) and signals through a pidfd, so the check and
the signal cannot race.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import psutil

from agents.protocol import ProcInfo

RUN_TAG = "GPUDECK_RUN_ID"
SIM_GPU_MEM_TAG = "GPUDECK_SIM_GPU_MEM"  # "<gpu>:<GiB>[,<gpu>:<GiB>...]", read by the simulated GPU sampler
CT_TOLERANCE = 0.02  # seconds; psutil derives create_time from clock ticks
# a process this young is read again at every refresh: one caught between fork and exec still shows its
# parent's environment and cmdline (a torchrun worker without its RANK, say), and exec changes neither pid nor start time
YOUNG_S = 3.0
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")
_BOOT = psutil.boot_time()
_STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk-sleep",
    "Z": "zombie",
    "T": "stopped",
    "t": "tracing-stop",
    "X": "dead",
    "I": "idle",
    "W": "waking",
    "P": "parked",
}


@dataclass(frozen=True)
class StatLine:
    """The dynamic facts of a process from one read of /proc/PID/stat."""

    status: str
    ppid: int
    pgid: int
    sid: int
    cpu_seconds: float
    create_time: float
    rss: int


def read_stat(pid: int) -> StatLine | None:
    """One read of /proc/PID/stat (the hot path of a snapshot); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    f = data[data.rfind(b")") + 2 :].split()
    try:
        return StatLine(
            status=_STATE_NAMES.get(f[0].decode(), f[0].decode()),
            ppid=int(f[1]),
            pgid=int(f[2]),
            sid=int(f[3]),
            cpu_seconds=(int(f[11]) + int(f[12])) / _TICKS,
            create_time=_BOOT + int(f[19]) / _TICKS,
            rss=int(f[21]) * _PAGE,
        )
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class SimGpuMem:
    """A process's ``GPUDECK_SIM_GPU_MEM`` declaration: bytes it holds per simulated GPU index."""

    held: tuple[tuple[int, int], ...]  # (gpu index, bytes), one pair per GPU, sorted by index
    error: str | None = None  # why the declaration could not be parsed; it then holds nothing


def parse_sim_gpu_mem(text: str) -> SimGpuMem:
    """Parse ``"<gpu>:<GiB>[,<gpu>:<GiB>...]"``; a malformed text gives an empty holding with the reason."""
    held: dict[int, int] = {}
    for part in text.split(","):
        gpu_s, sep, gib_s = part.strip().partition(":")
        try:
            gpu, gib = int(gpu_s), float(gib_s)
        except ValueError:
            gpu, gib = -1, -1.0
        if not sep or gpu < 0 or not gib >= 0 or gib == float("inf"):  # "not >=" also catches nan
            return SimGpuMem(
                held=(),
                error=f"{SIM_GPU_MEM_TAG}={text!r}: {part.strip()!r} is not <gpu>:<GiB>; write e.g. {SIM_GPU_MEM_TAG}=0:40,1:12.5",
            )
        held[gpu] = held.get(gpu, 0) + int(gib * 2**30)
    return SimGpuMem(held=tuple(sorted(held.items())))


@dataclass
class ProcEntry:
    """What the table knows of one process; the static parts are read once."""

    pid: int
    create_time: float
    uid: int | None
    run_id: str | None
    rank: int | None = None
    local_rank: int | None = None
    sim_gpu_mem: SimGpuMem | None = None  # only processes that declare GPUDECK_SIM_GPU_MEM (tests, benchmarks)
    sim_scope: str | None = None  # the simulated machine a holder belongs to (see sim_scope())
    _static: dict = field(default_factory=dict)


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def read_entry(pid: int, runs_dir: str | None = None) -> ProcEntry | None:
    """Read one process's identity and run tag; None when it is gone.

    With ``runs_dir``, a tag whose GPUDECK_RUN_DIR lies elsewhere belongs to
    another agent on this machine (another user's, or another node of the same
    multi-node run sharing the host) and is not taken as this agent's run.
    """
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            ct = p.create_time()
            try:
                uid = p.uids().real
            except psutil.Error:
                uid = None
        try:
            env = p.environ()
        except (psutil.Error, OSError):  # kernel threads, zombies, other users' processes
            env = {}
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    except psutil.AccessDenied:
        return ProcEntry(pid=pid, create_time=0.0, uid=None, run_id=None)
    run_id = env.get(RUN_TAG) or None
    run_dir = env.get("GPUDECK_RUN_DIR")
    if run_id and runs_dir and run_dir and not run_dir.startswith(runs_dir):
        run_id = None
    sim = env.get(SIM_GPU_MEM_TAG)
    return ProcEntry(
        pid=pid,
        create_time=ct,
        uid=uid,
        run_id=run_id,
        rank=_int_or_none(env.get("RANK")) if run_id else None,
        local_rank=_int_or_none(env.get("LOCAL_RANK")) if run_id else None,
        sim_gpu_mem=parse_sim_gpu_mem(sim) if sim is not None else None,
        sim_scope=sim_scope(env) if sim is not None else None,
    )


def sim_scope(env: Mapping[str, str]) -> str | None:
    """Which simulated machine a process belongs to: ``GPUDECK_SIM_SCOPE``, else its ``GPUDECK_HOME``.

    Several agents with SIMULATED GPUs on one real machine (parallel tests, the fleet benchmark) each see
    the holders of their own scope and the unscoped ones, never another scope's.
    """
    return env.get("GPUDECK_SIM_SCOPE") or env.get("GPUDECK_HOME") or None


def _list_pids() -> set[int]:
    return {int(n) for n in os.listdir("/proc") if n.isdigit()}


def _fork_mark() -> bytes | None:
    """What /proc/loadavg says of the process space: its task count and the newest pid ("3/412 58231").

    Unchanged between two reads means no process (nor thread) was created and none ended, so the
    listing of /proc cannot have changed either; None where it cannot be read.
    """
    try:
        with open("/proc/loadavg", "rb") as fh:
            parts = fh.read().split()
    except OSError:
        return None
    if len(parts) < 5:
        return None
    return parts[3].partition(b"/")[2] + b" " + parts[4]  # the running count (first half of "3/412") changes all the time


class ProcTable:
    """Incrementally refreshed map of live pids to their run tags; safe to refresh from a worker thread.

    A refresh costs one small read (/proc/loadavg) while no process is created or ends: the listing of
    /proc is read again only when that changes (or every ``RELIST_S`` as a safety net), and only new pids
    (and those younger than ``YOUNG_S``) are read. A plain refresh that finds another one running, or one
    that finished less than ``COALESCE_S`` ago, returns at once: the table is as fresh as it can be.
    """

    COALESCE_S = 0.1
    RELIST_S = 10.0

    def __init__(self, runs_dir: str | os.PathLike[str] | None = None) -> None:
        self._entries: dict[int, ProcEntry] = {}
        self._self_pid = os.getpid()
        self._runs_dir = os.path.join(os.fspath(runs_dir), "") if runs_dir is not None else None
        self._lock = threading.Lock()
        self._mark: bytes | None = None
        self._listed = -1e9  # monotonic time of the last listing of /proc
        self._done = -1e9  # monotonic time the last refresh finished
        self.listings = 0  # how many times /proc was listed (the benchmark reports it)

    def refresh(self, full: bool = False) -> None:
        """Re-read /proc: new pids are read; with ``full`` every pid's create_time is re-checked."""
        if not full:
            if time.monotonic() - self._done < self.COALESCE_S:
                return
            if not self._lock.acquire(blocking=False):
                return  # another thread is refreshing right now
        else:
            self._lock.acquire()
        try:
            self._refresh(full)
        finally:
            self._done = time.monotonic()
            self._lock.release()

    def _refresh(self, full: bool) -> None:
        mark = _fork_mark()
        now = time.monotonic()
        entries = self._entries
        young = time.time() - YOUNG_S
        if full or mark is None or mark != self._mark or now - self._listed > self.RELIST_S:
            self._mark = mark
            self._listed = now
            self.listings += 1
            pids = _list_pids()
            for gone in entries.keys() - pids:
                del entries[gone]
            todo = [pid for pid in pids if full or (known := entries.get(pid)) is None or known.create_time >= young]
        else:
            todo = [pid for pid, e in list(entries.items()) if e.create_time >= young]  # between fork and exec
        for pid in todo:
            known = entries.get(pid)
            if known is not None and full:
                ct = create_time_of(pid)
                if ct is not None and abs(ct - known.create_time) <= CT_TOLERANCE:
                    continue
            entry = read_entry(pid, self._runs_dir)
            if entry is None:
                entries.pop(pid, None)
            else:
                if known is not None and abs(entry.create_time - known.create_time) <= CT_TOLERANCE:
                    entry.create_time = known.create_time  # the same process read again: keep the key others hold
                entries[pid] = entry

    def lookup(self, pid: int) -> ProcEntry | None:
        """The entry for ``pid``, read now if the table does not know it yet (a pid newer than the last refresh)."""
        entry = self._entries.get(pid)
        if entry is None:
            entry = read_entry(pid, self._runs_dir)
            if entry is not None:
                self._entries.setdefault(pid, entry)
        return entry

    def get(self, pid: int) -> ProcEntry | None:
        """The entry for a pid seen at the last refresh."""
        return self._entries.get(pid)

    def exists(self, pid: int) -> bool:
        """Whether the OS shows this pid (checked now, not from the cache)."""
        return os.path.exists(f"/proc/{pid}")

    def tagged(self, run_id: str | None = None) -> list[ProcEntry]:
        """Entries carrying a run tag (of one run, or of any)."""
        return [e for e in list(self._entries.values()) if e.run_id is not None and (run_id is None or e.run_id == run_id)]

    def sim_holders(self) -> list[ProcEntry]:
        """Entries that declare ``GPUDECK_SIM_GPU_MEM`` (parsed or not), as of the last refresh."""
        # list() copies the values in one step under the GIL, so a worker thread may call this safely
        return [e for e in list(self._entries.values()) if e.sim_gpu_mem is not None]

    def __len__(self) -> int:
        return len(self._entries)


def create_time_of(pid: int) -> float | None:
    """A pid's create_time now, or None when it does not exist."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def same_process(pid: int, create_time: float) -> bool:
    """True when ``pid`` still names the process that had ``create_time``."""
    ct = create_time_of(pid)
    return ct is not None and abs(ct - create_time) <= CT_TOLERANCE


def status_of(pid: int, create_time: float | None = None) -> str | None:
    """psutil status ('running', 'zombie', 'disk-sleep', ...), or None when gone (or reused)."""
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > CT_TOLERANCE:
            return None
        return p.status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def alive(pid: int, create_time: float) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    st = status_of(pid, create_time)
    return st is not None and st != psutil.STATUS_ZOMBIE


def signal_exact(pid: int, create_time: float, sig: int) -> bool:
    """Send ``sig`` to the process (pid, create_time) and to nothing else.

    Opens a pidfd first, then checks the create_time, then signals through the
    pidfd: if the pid was reused, the check fails; if the process exits after
    the check, the pidfd still names it and the signal goes nowhere else.
    Returns False when the process is gone or the pid now names another process.
    """
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if not same_process(pid, create_time):
            return False
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            return False
        return True
    finally:
        os.close(fd)


def proc_info(pid: int, run_id: str | None = None, rank: int | None = None, local_rank: int | None = None) -> ProcInfo:
    """Everything an operator wants to see of one process (NO_SUCH_PROCESS gives just the pid)."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            info = ProcInfo(
                pid=pid,
                ppid=p.ppid(),
                user=_safe(p.username),
                create_time=p.create_time(),
                status=p.status(),
                rss=_safe(lambda: p.memory_info().rss),
                cpu_seconds=_safe(lambda: p.cpu_times().user + p.cpu_times().system),
                cmdline=_safe(p.cmdline) or [],
                run_id=run_id,
                rank=rank,
                local_rank=local_rank,
            )
        try:
            info.pgid = os.getpgid(pid)
            info.sid = os.getsid(pid)
        except OSError:
            pass
        return info
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ProcInfo(pid=pid, run_id=run_id, rank=rank, status="no such process")


def _safe(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except (psutil.Error, OSError):
        return None
