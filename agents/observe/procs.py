"""Provides the process table: which processes exist, and which run each belongs to.

Run membership comes from the ``GPUDECK_RUN_ID`` tag in a process's environment,
so torchrun workers in their own sessions and grandchildren re-parented to init
are found wherever they went. The table is refreshed incrementally: only pids
that are new since the last refresh are read, so a refresh costs one
``listdir('/proc')`` in the steady state.

A process may also declare GPU memory it holds on *simulated* GPUs through
``GPUDECK_SIM_GPU_MEM`` (see ``agents/observe/gpus_sim.py``); the declaration is parsed
in the same single read of the environment.

Processes are identified by ``(pid, create_time)``; anything that signals a
process goes through :func:`signal_exact`, which refuses a pid whose
create_time changed (PID reuse) and signals through a pidfd, so the check and
the signal cannot race.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import psutil

from gpudeck.agents.observe.containers import shared_reader
from gpudeck.agents.wire.protocol import Container, ProcInfo

RUN_TAG = "GPUDECK_RUN_ID"
SIM_GPU_MEM_TAG = "GPUDECK_SIM_GPU_MEM"  # "<gpu>:<GiB>[,<gpu>:<GiB>...]", read by the simulated GPU sampler
CT_TOLERANCE = 0.02  # seconds; psutil derives create_time from clock ticks
# a process this young is read again at every refresh: one caught between fork and exec still shows its
# parent's environment and cmdline (a torchrun worker without its RANK, say), and exec changes neither pid nor start time
YOUNG_S = 3.0
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")
_BOOT = psutil.boot_time()
_T = TypeVar("_T")
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
    exec_mark: tuple[int, int] = (0, 0)  # (startcode, startstack): new at every exec; (0, 0) where hidden


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
            exec_mark=(int(f[23]), int(f[25])) if len(f) > 25 else (0, 0),
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
    exec_mark: tuple[int, int] = (0, 0)  # read_stat's at the time the environment was read
    own_dir: bool = False  # its GPUDECK_RUN_DIR lies under the table's runs folder (a run of this agent's)
    # the container it runs in, seen from the host: read on first use (a GPU holder, a leftover), then kept with the
    # entry, so /proc/PID/cgroup is read once per (pid, create_time) and never for a process nothing shows
    container: Container | None = None
    container_read: bool = False

    def read_container(self) -> Container | None:
        """The container this process runs in (agents/observe/containers.py), read once; None outside any container,
        and when the pid no longer names this process (reused since the entry was made)."""
        if not self.container_read:
            found = shared_reader().of_pid(self.pid)
            self.container = found if found is None or same_process(self.pid, self.create_time) else None
            # a runtime places a process in its group before it executes the container's command: "none" is final
            # only once the process is past that age (a young one is asked again; exec makes a new entry anyway)
            self.container_read = self.container is not None or self.create_time < time.time() - YOUNG_S
        return self.container


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


_ENV_KEYS = (RUN_TAG, "GPUDECK_RUN_DIR", SIM_GPU_MEM_TAG, "RANK", "LOCAL_RANK", "GPUDECK_SIM_SCOPE", "GPUDECK_HOME")


def parse_environ(data: bytes, keys: tuple[str, ...] = _ENV_KEYS) -> dict[str, str]:
    """The ``keys`` of a /proc/PID/environ block, parsed as psutil parses it (the last of a repeated key wins;
    the block ends at an empty entry or an unterminated one; an entry without ``=`` after its first byte is skipped)."""
    out: dict[str, str] = {}
    if b"GPUDECK_" not in data:  # nearly every process: nothing of ours, and no RANK worth reading
        return out
    want = {k.encode() + b"=": k for k in keys}
    pos = 0
    while True:
        nxt = data.find(b"\0", pos)
        if nxt <= pos:
            break
        eq = data.find(b"=", pos, nxt)
        if eq > pos:
            key = want.get(data[pos : eq + 1])
            if key is not None:
                out[key] = data[eq + 1 : nxt].decode("utf-8", "surrogateescape")
        pos = nxt + 1
    return out


def _status_ids(pid: int) -> tuple[int, int | None] | None:
    """(Tgid, real uid) from /proc/PID/status; None when the id is gone. Tgid != pid: the id names a thread."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    tgid, uid = pid, None
    i = data.find(b"\nTgid:")
    if i >= 0:
        tgid = int(data[i + 6 : data.index(b"\n", i + 1)])
    i = data.find(b"\nUid:")
    if i >= 0:
        uid = int(data[i + 5 : data.index(b"\n", i + 1)].split()[0])
    return tgid, uid


def _is_process(pid: int) -> bool:
    """Whether ``pid`` names a live process (a thread group's leader), not another thread: pidfd_open refuses a
    thread that does not lead its group (EINVAL) and a gone id (ESRCH) in one syscall, where /proc/PID/status
    costs the kernel a page of text to format."""
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        return exc.errno not in (errno.EINVAL, errno.ESRCH, errno.ENOENT)  # anything else (no fds left): read status to tell
    os.close(fd)
    return True


def read_entry(pid: int, runs_dir: str | None = None, thread_ok: bool = True) -> ProcEntry | None:
    """Read one process's identity and run tag; None when it is gone (or, without ``thread_ok``, names a thread).

    With ``runs_dir``, a tag whose GPUDECK_RUN_DIR lies elsewhere belongs to
    another agent on this machine (another user's, or another node of the same
    multi-node run sharing the host) and is not taken as this agent's run.
    Reads /proc directly (stat, status, environ): three small reads, no psutil objects.
    """
    if not thread_ok and not _is_process(pid):
        return None  # a thread (most new ids on a busy host), or gone: one syscall, no read
    ids = _status_ids(pid)
    if ids is None or (not thread_ok and ids[0] != pid):
        return None
    st = read_stat(pid)
    if st is None:
        return None
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = parse_environ(fh.read())
    except OSError:  # kernel threads, zombies, other users' processes
        env = {}
    run_id = env.get(RUN_TAG) or None
    run_dir = env.get("GPUDECK_RUN_DIR")
    if run_id and runs_dir and run_dir and not run_dir.startswith(runs_dir):
        run_id = None
    own_dir = bool(run_id and runs_dir and run_dir)
    sim = env.get(SIM_GPU_MEM_TAG)
    return ProcEntry(
        pid=pid,
        create_time=st.create_time,
        uid=ids[1],
        run_id=run_id,
        rank=_int_or_none(env.get("RANK")) if run_id else None,
        local_rank=_int_or_none(env.get("LOCAL_RANK")) if run_id else None,
        sim_gpu_mem=parse_sim_gpu_mem(sim) if sim is not None else None,
        sim_scope=sim_scope(env) if sim is not None else None,
        exec_mark=st.exec_mark,
        own_dir=own_dir,
    )


def sim_scope(env: Mapping[str, str]) -> str | None:
    """Which simulated machine a process belongs to: ``GPUDECK_SIM_SCOPE``, else its ``GPUDECK_HOME``.

    Several agents with SIMULATED GPUs on one real machine (parallel tests, the fleet benchmark) each see
    the holders of their own scope and the unscoped ones, never another scope's.
    """
    return env.get("GPUDECK_SIM_SCOPE") or env.get("GPUDECK_HOME") or None


def _list_pids() -> set[int]:
    return {int(n) for n in os.listdir("/proc") if n.isdigit()}


def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max", "rb") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return 1 << 22


_PID_MAX = _pid_max()
_RESERVED_PIDS = 300  # the kernel wraps pid allocation around to here


def fork_mark() -> tuple[int, int] | None:
    """(task count, newest pid) from /proc/loadavg ("3/412 58231"); None where it cannot be read.

    Pids are handed out in increasing order (wrapping at pid_max), so the pids made since an earlier
    mark are the ones after its newest pid up to this one; an unchanged mark means nothing was created.
    """
    try:
        with open("/proc/loadavg", "rb") as fh:
            parts = fh.read().split()
        return int(parts[3].partition(b"/")[2]), int(parts[4])
    except (OSError, ValueError, IndexError):
        return None


def _new_ids(prev: int, cur: int) -> range | list[int]:
    """Ids handed out after ``prev`` up to ``cur``, wrap included."""
    if cur >= prev:
        return range(prev + 1, cur + 1)
    return [*range(prev + 1, _PID_MAX), *range(_RESERVED_PIDS, cur + 1)]


class ProcTable:
    """Incrementally refreshed map of live pids to their run tags; safe to refresh from a worker thread.

    A refresh costs one small read (/proc/loadavg) while no process is created: the ids handed out since
    the last refresh are read one by one (threads are told apart and skipped); the listing of /proc, whose
    cost grows with every process on the host (7 ms of CPU with 5,000), is read only for ``full``, when
    more than ``PROBE_MAX`` ids were handed out, and every ``RELIST_S`` as a safety net. Processes that end
    leave the table at the next listing; tagged ones and simulated-GPU holders are checked at every refresh,
    so ``tagged()`` and ``sim_holders()`` never name a process that has ended. With ``own`` (the agent's: is this
    run id one of mine?), only the tags of this agent's runs are watched so: a process tagged for another agent's
    run (a shared host) is read once, kept with its tag for attribution, and costs no refresh after that. Entries younger than
    ``YOUNG_S`` are re-read when they have exec'd since. A plain refresh that finds another one running
    returns at once (the event loop never waits for a scan in the sampler thread).
    """

    RELIST_S = 30.0
    PROBE_MAX = 2048

    def __init__(self, runs_dir: str | os.PathLike[str] | None = None, own: Callable[[str], bool] | None = None) -> None:
        self._entries: dict[int, ProcEntry] = {}
        self._young: dict[int, ProcEntry] = {}
        self._watched: dict[int, ProcEntry] = {}  # tagged for our runs, or simulated-GPU holders: checked at every refresh
        self._own = own
        self._self_pid = os.getpid()
        self._runs_dir = os.path.join(os.fspath(runs_dir), "") if runs_dir is not None else None
        self._lock = threading.Lock()
        self._newest: int | None = None
        self._listed = -1e9  # monotonic time of the last listing of /proc
        self._refreshed = -1e9  # monotonic time the last refresh finished
        self.listings = 0  # how many times /proc was listed (the benchmark reports it)
        self.probed = 0  # ids read one by one

    def refresh(self, full: bool = False, max_age: float = 0.0) -> None:
        """Re-read /proc: new pids are read; with ``full`` every pid's create_time is re-checked.

        ``max_age``: a plain refresh finished less than this many seconds ago is fresh enough (the agent's tick
        refreshes in its sampler thread and then asks again on the loop: the second one costs nothing).
        """
        if not full:
            if max_age > 0 and time.monotonic() - self._refreshed < max_age:
                return
            if not self._lock.acquire(blocking=False):
                return  # another thread is refreshing right now: what it finds is as fresh as this one would be
        else:
            self._lock.acquire()
        try:
            self._refresh(full)
            self._refreshed = time.monotonic()
        finally:
            self._lock.release()

    def watch_own(self, own: Callable[[str], bool]) -> None:
        """From now on watch only the tags ``own`` says are this agent's runs (the supervisor's run_state: a run its
        journal knows, created before any of its processes starts), and those whose GPUDECK_RUN_DIR is ours."""
        with self._lock:
            self._own = own
            for pid, e in list(self._watched.items()):
                if not self._watches(e):
                    del self._watched[pid]

    def _watches(self, entry: ProcEntry) -> bool:
        """Whether a refresh re-checks this entry: a simulated-GPU holder, or a tag of this agent's runs."""
        if entry.sim_gpu_mem is not None:
            return True
        if entry.run_id is None:
            return False
        if self._own is None or entry.own_dir:
            return True
        try:
            return self._own(entry.run_id)
        except Exception:  # the journal cannot say (a read failed): watched, as before the filter
            return True

    def _put(self, pid: int, entry: ProcEntry | None, known: ProcEntry | None) -> None:
        if entry is None:
            self._drop(pid)
            return
        if known is not None and abs(entry.create_time - known.create_time) <= CT_TOLERANCE:
            entry.create_time = known.create_time  # the same process read again: keep the key others hold
        self._entries[pid] = entry
        if entry.create_time >= time.time() - YOUNG_S:
            self._young[pid] = entry
        else:
            self._young.pop(pid, None)
        if self._watches(entry):
            self._watched[pid] = entry
        else:
            self._watched.pop(pid, None)

    def _drop(self, pid: int) -> None:
        self._entries.pop(pid, None)
        self._young.pop(pid, None)
        self._watched.pop(pid, None)

    def _refresh(self, full: bool) -> None:
        mark = fork_mark()
        now = time.monotonic()
        entries = self._entries
        new = None if mark is None or self._newest is None else _new_ids(self._newest, mark[1])
        if full or new is None or len(new) > self.PROBE_MAX or now - self._listed > self.RELIST_S:
            self._listed = now
            self.listings += 1
            if mark is not None:
                self._newest = mark[1]
            pids = _list_pids()
            for gone in entries.keys() - pids:
                self._drop(gone)
            young = time.time() - YOUNG_S
            for pid in pids:
                known = entries.get(pid)
                if known is not None and not full and known.create_time < young:
                    continue
                if known is not None:
                    st = read_stat(pid)
                    if (
                        st is not None
                        and abs(st.create_time - known.create_time) <= CT_TOLERANCE
                        and (st.status == "zombie" or (known.exec_mark[0] and st.exec_mark == known.exec_mark))
                    ):
                        continue  # the same process, not exec'd since it was read (a zombie execs no more)
                self._put(pid, read_entry(pid, self._runs_dir), known)
            return
        if mark is None:  # new is None whenever mark is None, and that case listed and returned above
            raise RuntimeError("process table: new pids computed without a fork mark")
        self._newest = mark[1]
        for pid in new:  # made since the last refresh: processes are read, threads skipped
            self.probed += 1
            known = entries.get(pid)
            entry = read_entry(pid, self._runs_dir, thread_ok=False)
            if entry is not None or known is not None:
                self._put(pid, entry, known)
        for pid, known in list(self._young.items()) + list(self._watched.items()):
            st = read_stat(pid)
            if st is None or abs(st.create_time - known.create_time) > CT_TOLERANCE:
                self._drop(pid)  # ended (or its pid was reused: read again when the new one is seen)
            elif known.create_time < time.time() - YOUNG_S and pid in self._young:
                del self._young[pid]
            elif pid in self._young and st.status != "zombie" and (not known.exec_mark[0] or st.exec_mark != known.exec_mark):
                self._put(pid, read_entry(pid, self._runs_dir), known)  # exec'd since (or cannot tell): its own environment now

    def lookup(self, pid: int) -> ProcEntry | None:
        """The entry for ``pid``, read now if the table does not know it yet (a pid newer than the last refresh)."""
        entry = self._entries.get(pid)
        if entry is None:
            entry = read_entry(pid, self._runs_dir, thread_ok=False)
            if entry is not None:
                with self._lock:
                    if pid not in self._entries:
                        self._put(pid, entry, None)
        return entry

    def get(self, pid: int) -> ProcEntry | None:
        """The entry for a pid seen at the last refresh."""
        return self._entries.get(pid)

    def exists(self, pid: int) -> bool:
        """Whether the OS shows this pid (checked now, not from the cache)."""
        return os.path.exists(f"/proc/{pid}")

    def tagged(self, run_id: str | None = None, *, anyone: bool = False) -> list[ProcEntry]:
        """Entries carrying the tag of this agent's runs (of one run, or of any); ``anyone``: every tagged entry
        the table holds, another agent's runs' too, as of the last refresh (a full scan of the table)."""
        source = self._entries if anyone else self._watched
        return [e for e in list(source.values()) if e.run_id is not None and (run_id is None or e.run_id == run_id)]

    def sim_holders(self) -> list[ProcEntry]:
        """Entries that declare ``GPUDECK_SIM_GPU_MEM`` (parsed or not), as of the last refresh."""
        # list() copies the values in one step under the GIL, so a worker thread may call this safely
        return [e for e in list(self._watched.values()) if e.sim_gpu_mem is not None]

    def __len__(self) -> int:
        return len(self._entries)


def create_time_of(pid: int) -> float | None:
    """A pid's create_time now, or None when it does not exist (one read of /proc/PID/stat, as psutil computes it)."""
    st = read_stat(pid)
    return st.create_time if st is not None else None


def same_process(pid: int, create_time: float) -> bool:
    """True when ``pid`` still names the process that had ``create_time``."""
    ct = create_time_of(pid)
    return ct is not None and abs(ct - create_time) <= CT_TOLERANCE


def status_of(pid: int, create_time: float | None = None) -> str | None:
    """Status ('running', 'zombie', 'disk-sleep', ... as psutil names them), or None when gone (or reused).

    One read of /proc/PID/stat (a stop checks hundreds of members: psutil's object and two reads each cost 5x more).
    """
    st = read_stat(pid)
    if st is None or (create_time is not None and abs(st.create_time - create_time) > CT_TOLERANCE):
        return None
    return st.status


def alive(pid: int, create_time: float) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    st = status_of(pid, create_time)
    return st is not None and st != "zombie" and st != "dead"


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


class StaticFacts:
    """A process's user and command line, read once per program it runs (the snapshot's cache).

    Keyed by ``(pid, create_time, exec_mark)``: an exec keeps the pid and the create_time, so a process first read
    between fork and exec (the parent's command line) is read again once it runs its own program. Where the exec
    mark is hidden (another uid's process, read without ptrace rights), a process younger than ``young_s`` is read
    afresh at every call instead, so its exec is not missed either.
    """

    def __init__(self, limit: int = 4096, young_s: float = 5.0) -> None:
        self.limit = limit
        self.young_s = young_s
        self._facts: dict[tuple[int, float, tuple[int, int]], tuple[str | None, tuple[str, ...]]] = {}
        self.reads = 0  # proc_info calls made, for tests and benchmarks

    def get(self, pid: int, create_time: float, st: StatLine | None) -> tuple[str | None, tuple[str, ...]]:
        """``(user, cmdline[:16])`` of the process ``st`` was read from (``st`` None: the process has gone)."""
        mark = st.exec_mark if st is not None else (0, 0)
        key = (pid, create_time, mark)
        facts = self._facts.get(key)
        if facts is not None:
            return facts
        info = proc_info(pid)
        self.reads += 1
        facts = (info.user, tuple(info.cmdline[:16]))
        if mark[0] or time.time() - create_time >= self.young_s:
            if len(self._facts) >= self.limit:
                self._facts.clear()
            self._facts[key] = facts
        return facts


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
                cmdline=tuple(_safe(p.cmdline) or ()),
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


def _safe(fn: Callable[[], _T]) -> _T | None:
    try:
        return fn()
    except (psutil.Error, OSError):
        return None
