"""Provides run containment: which processes belong to a run, as the kernel sees it where it can.

Three levels behind one interface, found once at agent start (:func:`detect`):

1. ``systemd``: a transient scope per run from a systemd manager. Detected and
   reported; not built yet (a systemd host falls back to cgroupfs, and says so;
   ``GPUDECK_CONTAINMENT=systemd`` is refused).
2. ``cgroupfs``: one cgroup v2 group per run, made directly in the cgroup v2
   file system (found from ``/proc/self/mountinfo``: hybrid hosts mount it at
   ``/sys/fs/cgroup/unified``), under ``gpudeck/<agent>/<run id>``. The run's
   first process is moved into its group before it executes the user's
   command (the shim does it between fork and exec), so everything the run
   forks is inside; the kernel, not an environment variable, says who belongs.
3. ``tag``: no writable cgroup v2 (an unprivileged container, no delegation):
   the ``GPUDECK_RUN_ID`` tag, strengthened by parentage from the run's shim
   (a child subreaper, so double-forked processes stay under it), its session
   and process group.

``GPUDECK_CONTAINMENT=auto|cgroupfs|tag`` forces a level (tests, benchmarks); any other value, ``systemd``
included, is refused with a typed error (the agent does not start).
"""

from __future__ import annotations

import errno
import hashlib
import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpudeck.agents.wire.errors import BadRequest
from gpudeck.agents.wire.protocol import ContainmentInfo

CONTAINMENT_ENV = "GPUDECK_CONTAINMENT"
GROUP_ROOT = "gpudeck"
Level = Literal["systemd", "cgroupfs", "tag"]
LABELS = {"systemd": "cgroup (systemd scope)", "cgroupfs": "cgroup (cgroupfs)"}


def cgroup2_mount(mountinfo: str | None = None) -> str | None:
    """The mount point of the cgroup v2 hierarchy from /proc/self/mountinfo, or None."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8") as fh:
                mountinfo = fh.read()
        except OSError:
            return None
    for line in mountinfo.splitlines():
        # "36 25 0:30 / /sys/fs/cgroup rw,... shared:9 - cgroup2 cgroup2 rw,..."
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        if right.split(" ", 1)[0] == "cgroup2":
            fields = left.split()
            if len(fields) >= 5 and fields[3] == "/":
                return fields[4].replace("\\040", " ")
    return None


def own_cgroup(pid: int | str = "self") -> str | None:
    """The cgroup v2 path ('/a/b') of a process, from /proc/PID/cgroup ('0::/a/b'); None when gone."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        return None
    return None


def systemd_unavailable() -> str:
    """Why the systemd scope level is not used here (it is detected, not built)."""
    if not os.path.isdir("/run/systemd/system"):
        try:
            with open("/proc/1/comm", encoding="utf-8") as fh:
                init = fh.read().strip()
        except OSError:
            init = "unknown"
        return f"no running systemd manager (/run/systemd/system is absent; PID 1 is {init!r})"
    return "a systemd manager runs here, but gpudeck's systemd-scope level is not built yet; the run's group is made in cgroupfs"


@dataclass(frozen=True)
class GroupFigures:
    """What the kernel counts for one group; None where the controller is not there (``note`` says why)."""

    cpu_seconds: float | None = None
    memory_peak_bytes: int | None = None
    memory_current_bytes: int | None = None
    oom_kills: int | None = None
    note: str = ""


def put_figures(info: ContainmentInfo, f: GroupFigures) -> None:
    """Copy the kernel's figures of a run's group onto its containment record (what every reply carries)."""
    info.cpu_seconds, info.memory_peak_bytes, info.oom_kills, info.figures_note = f.cpu_seconds, f.memory_peak_bytes, f.oom_kills, f.note


def _read(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def _keyed(text: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        out[k] = v.strip()
    return out


class RunGroup:
    """One run's cgroup v2 directory: its processes, freeze, kill, remove, figures."""

    def __init__(self, path: Path, run_id: str) -> None:
        self.path = Path(path)
        self.run_id = run_id

    def __repr__(self) -> str:
        return f"RunGroup({str(self.path)!r})"

    @property
    def procs_file(self) -> str:
        """The file a process writes '0' to in order to join the group."""
        return str(self.path / "cgroup.procs")

    def exists(self) -> bool:
        """Whether the directory is still there."""
        return self.path.is_dir()

    def pids(self) -> list[int]:
        """Every process in the group and in any sub-group the run made (cgroup.procs, recursively)."""
        out: list[int] = []
        for dirpath, _dirs, _files in os.walk(self.path):
            text = _read(Path(dirpath) / "cgroup.procs")
            if text:
                out.extend(int(x) for x in text.split())
        return out

    def populated(self) -> bool:
        """cgroup.events' ``populated``: any live process in the group or below (False when removed)."""
        ev = _keyed(_read(self.path / "cgroup.events"))
        return ev.get("populated", "0") == "1"

    def wait_empty(self, timeout: float) -> bool:
        """Block until ``cgroup.events`` says ``populated 0``, at most ``timeout`` s; True when the group is empty (or gone).

        Event-driven: the kernel notifies a poll(POLLPRI) on cgroup.events when ``populated`` changes, so
        this returns within a scheduling delay of the last process's exit, without a polling interval.
        """
        deadline = time.monotonic() + timeout
        try:
            fd = os.open(self.path / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return True  # removed: nothing is in it
        try:
            waiter = select.poll()
            waiter.register(fd, select.POLLPRI | select.POLLERR)
            while True:
                try:
                    text = os.pread(fd, 4096, 0)  # each read re-arms the notification
                except OSError:
                    return True
                if b"populated 0" in text:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                waiter.poll(max(1, int(min(left, 0.5) * 1000)))  # a cap in case a notification is ever missed
        finally:
            os.close(fd)

    def freeze(self, on: bool = True) -> bool:
        """Freeze (or thaw) the whole group; False when the kernel has no cgroup.freeze."""
        try:
            with open(self.path / "cgroup.freeze", "w") as fh:
                fh.write("1" if on else "0")
            return True
        except OSError:
            return False

    def kill(self) -> str:
        """SIGKILL every process in the group in one step; returns how ('cgroup.kill' or 'freeze+SIGKILL')."""
        try:
            with open(self.path / "cgroup.kill", "w") as fh:
                fh.write("1")
            return "cgroup.kill"
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EINVAL):
                raise
        # an older kernel (< 5.14): freeze so nothing forks between the read and the signals, kill, thaw
        frozen = self.freeze(True)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)  # a pid listed in a frozen group cannot be reused before we signal
            except ProcessLookupError:
                pass
        if frozen:
            self.freeze(False)
        return "freeze+SIGKILL" if frozen else "SIGKILL"

    def remove(self) -> str | None:
        """Remove the group (sub-groups first); None when removed, else why not."""
        if not self.path.exists():
            return None
        subdirs = sorted((Path(d) for d, _s, _f in os.walk(self.path)), key=lambda p: len(p.parts), reverse=True)
        for d in subdirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as exc:
                n = len(self.pids())
                return f"{self.path} was kept: {exc.strerror}" + (f" ({n} process(es) still in it)" if n else "")
        return None

    def figures(self) -> GroupFigures:
        """CPU time, peak memory and OOM kills the kernel counted for the group; None and the reason where absent."""
        cpu = _keyed(_read(self.path / "cpu.stat")).get("usage_usec")
        notes: list[str] = []
        peak = _read(self.path / "memory.peak")
        current = _read(self.path / "memory.current")
        events = _keyed(_read(self.path / "memory.events"))
        if current is None:
            controllers = (_read(self.path / "cgroup.controllers") or "").split()
            where = f"{self.path.parent}/cgroup.subtree_control"
            notes.append(
                "peak memory and OOM kills not available: the memory controller is not enabled for this group"
                + (f" ({where} does not list it)" if "memory" not in controllers else "")
                + (" — on a hybrid host memory is managed by cgroup v1" if not controllers else "")
            )
        elif peak is None:
            notes.append("peak memory not available: memory.peak needs Linux 5.19 or newer")
        return GroupFigures(
            cpu_seconds=round(int(cpu) / 1e6, 3) if cpu and cpu.isdigit() else None,
            memory_peak_bytes=int(peak) if peak and peak.strip().isdigit() else None,
            memory_current_bytes=int(current) if current and current.strip().isdigit() else None,
            oom_kills=int(events["oom_kill"]) if events.get("oom_kill", "").isdigit() else None,
            note="; ".join(notes),
        )


class Containment:
    """The containment level this agent gives its runs (the tag-only level: no groups)."""

    level: Level = "tag"

    def __init__(self, reason: str = "") -> None:
        self.reason = reason

    @property
    def label(self) -> str:
        """What ``agent status`` and every run say: 'cgroup (cgroupfs)', 'tag + ancestry only: <why>'."""
        return LABELS.get(self.level) or f"tag + ancestry only: {self.reason}"

    @property
    def has_groups(self) -> bool:
        """Whether runs get a cgroup."""
        return False

    def create(self, run_id: str) -> RunGroup | None:
        """A new, empty group for a run (None at the tag level)."""
        return None

    def group(self, run_id: str) -> RunGroup | None:
        """The existing group of a run, or None."""
        return None

    def groups(self) -> dict[str, RunGroup]:
        """Every group under this agent's own group, by the run id its name says."""
        return {}

    def group_of_pid(self, pid: int) -> str | None:
        """The run id whose group holds ``pid`` (None: in no run's group, or no groups here)."""
        return None

    def release(self) -> None:
        """Tidy up after the last run's group is gone (nothing at the tag level)."""


class CgroupFs(Containment):
    """One cgroup v2 group per run under ``<mount>/gpudeck/<agent>``, made and removed by the agent."""

    level: Level = "cgroupfs"

    def __init__(self, base: Path, mount: str) -> None:
        super().__init__("")
        self.base = Path(base)
        self.mount = mount
        self._prefix = "/" + os.path.relpath(self.base, mount) + "/"
        self._enable_controllers()

    @property
    def has_groups(self) -> bool:
        return True

    def _enable_controllers(self) -> None:
        # memory and cpu figures come with a controller: enable what the parent offers (our own group holds no process)
        offered = (_read(self.base / "cgroup.controllers") or "").split()
        want = [c for c in ("memory", "cpu") if c in offered]
        if want:
            try:
                with open(self.base / "cgroup.subtree_control", "w") as fh:
                    fh.write(" ".join(f"+{c}" for c in want))
            except OSError:
                pass

    def create(self, run_id: str) -> RunGroup:
        if not self.base.is_dir():  # made on the first run, removed with the last (no empty group per agent left behind)
            self.base.mkdir(parents=True, exist_ok=True)
            self._enable_controllers()
        path = self.base / run_id
        try:
            path.mkdir(exist_ok=False)
        except FileExistsError:
            pass  # a launch retried after the agent died between mkdir and spawn: the empty group is reused
        return RunGroup(path, run_id)

    def group(self, run_id: str) -> RunGroup | None:
        path = self.base / run_id
        return RunGroup(path, run_id) if path.is_dir() else None

    def release(self) -> None:
        """Remove this agent's own group once it holds no run's group (the kernel refuses while it does)."""
        try:
            os.rmdir(self.base)
        except OSError:
            pass

    def groups(self) -> dict[str, RunGroup]:
        try:
            names = [e.name for e in os.scandir(self.base) if e.is_dir()]
        except OSError:
            return {}
        return {n: RunGroup(self.base / n, n) for n in names}

    def group_of_pid(self, pid: int) -> str | None:
        path = own_cgroup(pid)
        if path is None or not path.startswith(self._prefix):
            return None
        return path[len(self._prefix) :].split("/", 1)[0] or None


def agent_key(state_dir: os.PathLike[str] | str) -> str:
    """This agent's group name: one per state dir, so agents of several users or tests never share groups."""
    return "a-" + hashlib.sha1(os.fsencode(os.path.realpath(state_dir))).hexdigest()[:12]


def _cgroupfs(state_dir: os.PathLike[str] | str) -> CgroupFs | str:
    """The cgroupfs level for this agent, or why it cannot be had here."""
    mount = cgroup2_mount()
    if mount is None:
        return "no cgroup v2 file system is mounted (/proc/self/mountinfo lists none)"
    base = Path(mount) / GROUP_ROOT / agent_key(state_dir)
    existed = base.is_dir()
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {base} ({exc.strerror}): cgroup v2 at {mount} is not writable by uid {os.getuid()} (run the agent as root or delegate a subtree)"
    if not (base / "cgroup.procs").exists():
        return f"{base} is not a cgroup v2 group"
    got = CgroupFs(base, mount)
    if not existed:
        got.release()  # the probe proved it writable; it is made again with the first run
    return got


def detect(state_dir: os.PathLike[str] | str, forced: str | None = None) -> Containment:
    """The strongest level this host allows, or the one ``GPUDECK_CONTAINMENT`` forces."""
    choice = (forced if forced is not None else os.environ.get(CONTAINMENT_ENV, "auto")).strip().lower() or "auto"
    if choice == "systemd":  # a level the docs name, not built: refused like any other value, saying why
        raise BadRequest(
            f"{CONTAINMENT_ENV}='systemd' cannot be used: gpudeck's systemd-scope level is not built "
            f"({systemd_unavailable()}); give auto, cgroupfs or tag"
        )
    if choice not in ("auto", "cgroupfs", "tag"):
        raise BadRequest(f"{CONTAINMENT_ENV}={choice!r} is not a containment level: give auto, cgroupfs or tag")
    if choice == "tag":
        return Containment(f"forced by {CONTAINMENT_ENV}=tag")
    sysd = systemd_unavailable()
    got = _cgroupfs(state_dir)
    if isinstance(got, str):
        if choice == "cgroupfs":
            return Containment(f"{CONTAINMENT_ENV}=cgroupfs, but {got}")
        return Containment(f"{got}; systemd scope: {sysd}")
    return got
