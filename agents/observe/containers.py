"""Provides which container a process runs in, seen from the host: its cgroup path, named from the runtime's own files.

An agent on a Docker or Podman host, a Proxmox/LXC host or a Kubernetes node sees
every GPU process, but not which container it belongs to. The kernel says where
each process is placed (``/proc/PID/cgroup``), and every runtime names its
groups its own way:

- Docker: ``docker-<64 hex>.scope`` (systemd driver), ``/docker/<64 hex>`` (cgroupfs driver);
- Podman: ``libpod-<64 hex>.scope`` (systemd; ``…/container`` below it with podman 4),
  ``/libpod_parent/libpod-<64 hex>`` (cgroupfs); ``libpod-conmon-…`` is its monitor, not the container;
- LXC: ``/lxc/<name>`` (Proxmox: ``/lxc/<vmid>/ns/…``), ``lxc.payload.<name>`` (LXC 4, LXD);
  ``lxc.monitor…`` is the monitor, not the container;
- Kubernetes: ``kubepods…/pod<uid>/<64 hex>`` (cgroupfs) and
  ``kubepods-<qos>-pod<uid with _>.slice/{cri-containerd,crio,docker}-<64 hex>.scope`` (systemd).

cgroup v2 has one line (``0::/path``); v1 and hybrid hosts one line per hierarchy
(``4:memory:/docker/<id>``, ``1:name=systemd:/docker/<id>``): the v2 line is
read first, then ``name=systemd``, then the others, and the first that names a
container wins (the outermost container of a path wins: the host's runtime
knows that one).

The name is read from what the runtime keeps on disk, never from its daemon:
Docker's ``containers/<id>/config.v2.json`` (``Name``) under its data root,
Podman's ``overlay-containers/containers.json`` (root's, or the user's for a
rootless container), Proxmox's ``/etc/pve/lxc/<vmid>.conf`` (``hostname``),
Kubernetes' ``/var/log/pods/<ns>_<pod>_<uid>`` and
``/var/log/containers/<pod>_<ns>_<container>-<id>.log`` names.

Trust: the file is the kernel's, but a group's name is chosen by whoever made
it (a user with a delegated subtree makes any name, newlines included). So a
file with more lines than the host has hierarchies (a name holding a newline)
is not believed; ids are taken only in their exact shape (64 hex digits, a
UUID); every other text (an LXC name, a name from a runtime's file) is shown
only as ``[A-Za-z0-9_.-]`` with every other byte escaped as ``\\xNN``, at most
:data:`NAME_MAX` bytes. A group below a user's own systemd instance
(``user@UID.service``) is that user's claim: it carries ``owner_uid``, and its
name is looked up only in that user's files (rootless Podman and Docker), never
in root's registries. Every file is read bounded, read-only, without following
a final symbolic link and without blocking on a FIFO; whatever fails is "name
unknown", never an exception in the sampler.

Cost: :meth:`ContainerReader.of_pid` is one read of ``/proc/PID/cgroup``; the
process table calls it once per process (``ProcEntry.read_container``, cached
with the entry, so per ``(pid, create_time)``) and only for the processes a
snapshot or reclaim shows. Names are cached by id; a miss re-reads a runtime's
file only when it changed, and re-lists a folder at most every :data:`RELIST_S`.
"""

from __future__ import annotations

import os
import pwd
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from gpudeck.agents.wire.protocol import Container

ROOT_ENV = "GPUDECK_CONTAINER_ROOT"  # where the runtimes' files are looked up (default "/"; tests point it at a fake tree)
CGROUP_READ_MAX = 64 * 1024  # bytes of /proc/PID/cgroup: a path is at most PATH_MAX, times a dozen v1 hierarchies
NAME_MAX = 64  # bytes of any name shown (before escaping)
CONFIG_MAX = 1 << 20  # bytes of Docker's config.v2.json, Proxmox's conf, Docker's daemon.json
PODMAN_MAX = 8 << 20  # bytes of Podman's containers.json (every container of that storage)
LISTING_MAX = 20000  # entries of one /var/log folder read
RELIST_S = 10.0  # a miss re-reads a changed listing or registry at most this often
UNKNOWN_S = 60.0  # "name unknown" is asked again after this long (a container made since)
CACHE_MAX = 4096  # names kept

_SHOWN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_DOCKER_SCOPE = re.compile(r"docker-([0-9a-f]{64})\.scope")
_LIBPOD = re.compile(r"libpod-([0-9a-f]{64})(?:\.scope)?")
_USER_SERVICE = re.compile(r"user@(\d{1,10})\.service")
_K8S_POD = re.compile(r"(?:kubepods(?:-[a-z]+)*-)?pod([0-9a-fA-F_-]{32,36})(?:\.slice)?")
_K8S_CTR = re.compile(r"(?:(cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")  # static pods: a 32-hex hash
_ENGINES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}
_VMID = re.compile(r"\d{1,9}")
_T = TypeVar("_T")


def shown(raw: str | bytes, limit: int = NAME_MAX) -> str:
    """``raw`` as the agent shows it: ``[A-Za-z0-9_.-]`` as is, every other byte as ``\\xNN``; at most ``limit`` bytes
    of it ("..." after an escape-free cut marks it)."""
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")
    cut = len(data) > limit
    out = "".join(chr(b) if b in _SHOWN else f"\\x{b:02x}" for b in data[:limit])
    return out + "..." if cut else out


@dataclass(frozen=True)
class Place:
    """What a cgroup path says of a container, before any name is looked up."""

    runtime: str  # docker | podman | lxc | kubernetes
    id: str  # 64 hex, or an LXC name (escaped); "" for a process in a pod's own group
    engine: str | None = None  # kubernetes: containerd | cri-o | docker
    pod_uid: str | None = None
    owner_uid: int | None = None  # below user@UID.service: that user's claim (rootless), named from that user's files only


@dataclass(frozen=True)
class Reading:
    """One /proc/PID/cgroup read: the place it names, or None; ``problem`` says why a file was not believed."""

    place: Place | None
    problem: str = ""


def place_of_path(path: str) -> Place | None:
    """The container a cgroup path (``/system.slice/docker-<id>.scope``) names, or None."""
    segs = [s for s in path.split("/") if s]
    owner: int | None = None
    for i, s in enumerate(segs):
        m = _USER_SERVICE.fullmatch(s)
        if m:
            owner = int(m.group(1))
            continue
        if s.startswith("kubepods"):
            return _kubernetes(segs[i:], owner)
        m = _DOCKER_SCOPE.fullmatch(s)
        if m:
            return Place("docker", m.group(1), owner_uid=owner)
        nxt = segs[i + 1] if i + 1 < len(segs) else ""
        if s == "docker" and _HEX64.fullmatch(nxt):
            return Place("docker", nxt, owner_uid=owner)
        m = _LIBPOD.fullmatch(s)
        if m:
            return Place("podman", m.group(1), owner_uid=owner)
        if s in ("lxc", "lxc.payload") and nxt:
            return Place("lxc", shown(nxt), owner_uid=owner)
        if s.startswith("lxc.payload.") and len(s) > len("lxc.payload."):
            return Place("lxc", shown(s[len("lxc.payload.") :]), owner_uid=owner)
    return None


def _kubernetes(segs: list[str], owner: int | None) -> Place | None:
    pod_uid: str | None = None
    for s in segs:
        if pod_uid is None:
            m = _K8S_POD.fullmatch(s)
            if m:
                uid = m.group(1).replace("_", "-").lower()
                if _UUID.fullmatch(uid):
                    pod_uid = uid
            continue
        c = _K8S_CTR.fullmatch(s)
        if c:
            return Place("kubernetes", c.group(2), engine=_ENGINES.get(c.group(1) or ""), pod_uid=pod_uid, owner_uid=owner)
    return Place("kubernetes", "", pod_uid=pod_uid, owner_uid=owner) if pod_uid is not None else None


def parse_cgroup(data: bytes, hierarchies: int | None = None) -> Reading:
    """The container a /proc/PID/cgroup text names. ``hierarchies``: how many lines every process's file has on this
    host (the agent's own); more means a group's name holds a newline, and the file is not believed."""
    if len(data) >= CGROUP_READ_MAX:
        return Reading(None, f"longer than {CGROUP_READ_MAX} bytes: not believed")
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if hierarchies is not None and len(lines) > hierarchies:
        return Reading(None, f"{len(lines)} lines where this host has {hierarchies} hierarchies: a group's name holds a newline")
    ranked: list[tuple[int, bytes]] = []
    for n, line in enumerate(lines):
        hid, sep1, rest = line.partition(b":")
        controllers, sep2, path = rest.partition(b":")
        if not (sep1 and sep2 and hid.isdigit() and path.startswith(b"/")):
            return Reading(None, f"line {n + 1} is not ID:CONTROLLERS:/PATH: not believed")
        rank = 0 if hid == b"0" and not controllers else (1 if controllers == b"name=systemd" else 2)
        ranked.append((rank, path))
    for _rank, path in sorted(ranked, key=lambda rp: rp[0]):  # stable: file order within a rank
        place = place_of_path(path.decode("utf-8", "surrogateescape"))
        if place is not None:
            return Reading(place)
    return Reading(None)


def read_bounded(path: str, limit: int) -> bytes | None:
    """A regular file's bytes if it has at most ``limit`` of them; None otherwise (gone, unreadable, too big, a FIFO or
    device, a final symbolic link: none followed, none blocked on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


class _DockerConfig(msgspec.Struct):
    Name: str = ""


class _DockerDaemon(msgspec.Struct, rename={"data_root": "data-root"}):
    data_root: str = ""


class _PodmanEntry(msgspec.Struct):
    id: str = ""
    names: list[str] = []


_docker_config = msgspec.json.Decoder(_DockerConfig)
_docker_daemon = msgspec.json.Decoder(_DockerDaemon)
_podman_registry = msgspec.json.Decoder(list[_PodmanEntry])


def _decode(decoder: msgspec.json.Decoder[_T], data: bytes | None) -> _T | None:
    """The decoded file, or None where there is none or it is not what the runtime writes."""
    if data is None:
        return None
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, ValueError):
        return None


def _home_of(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_dir
    except (KeyError, OSError):
        return None


@dataclass
class _Listing:
    checked: float = -1e9  # monotonic time of the last stat
    signature: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) of what ``names`` was made from
    names: dict[str, tuple[str, ...]] | None = None


class ContainerNames:
    """Names containers from their runtimes' own files under ``root``; bounded, cached by id, never raising."""

    def __init__(self, root: str = "/", home_of: Callable[[int], str | None] = _home_of) -> None:
        self.root = root
        self._home_of = home_of
        self._homes: dict[int, str | None] = {}
        self._names: dict[tuple[str, str, int | None], tuple[float, Container]] = {}
        self._listings: dict[str, _Listing] = {}
        self._docker_root: str | None = None
        self._lock = threading.Lock()
        self.file_reads = 0  # registries and listings read (the tests and the benchmark report it)

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *(p.lstrip("/") for p in parts))

    def container(self, place: Place) -> Container:
        """The wire record of ``place``, with the names the runtime's files give (cached by id)."""
        key = (place.runtime, place.id if place.runtime != "kubernetes" else f"{place.pod_uid}/{place.id}", place.owner_uid)
        now = time.monotonic()
        with self._lock:
            hit = self._names.get(key)
            if hit is not None and (hit[0] == 0.0 or now - hit[0] < UNKNOWN_S):
                return hit[1]
            c = self._lookup(place)
            if len(self._names) >= CACHE_MAX:
                self._names.clear()
            known = c.name is not None or c.pod is not None
            self._names[key] = (0.0 if known else now, c)  # a known name is kept; "unknown" is asked again later
            return c

    def _lookup(self, place: Place) -> Container:
        base = Container(runtime=place.runtime, id=place.id, engine=place.engine, pod_uid=place.pod_uid, owner_uid=place.owner_uid)
        try:
            if place.runtime == "docker":
                return msgspec.structs.replace(base, name=self._docker_name(place))
            if place.runtime == "podman":
                return msgspec.structs.replace(base, name=self._podman_name(place))
            if place.runtime == "lxc":
                return msgspec.structs.replace(base, name=self._lxc_name(place))
            if place.runtime == "kubernetes" and place.owner_uid is None:
                return self._kubernetes_names(base)
        except (OSError, ValueError, UnicodeError):  # "name unknown": the sampler never fails for a name
            pass
        return base

    def _user_dir(self, uid: int, *parts: str) -> str | None:
        if uid not in self._homes:
            self._homes[uid] = self._home_of(uid)
        home = self._homes[uid]
        return self._path(home, *parts) if home else None

    def _docker_name(self, place: Place) -> str | None:
        if place.owner_uid is not None:  # rootless Docker keeps its data in the user's home
            data_root = self._user_dir(place.owner_uid, ".local/share/docker")
        else:
            if self._docker_root is None:
                daemon = _decode(_docker_daemon, read_bounded(self._path("/etc/docker/daemon.json"), CONFIG_MAX))
                given = daemon.data_root if daemon is not None else ""
                self._docker_root = self._path(given) if given.startswith("/") else self._path("/var/lib/docker")
            data_root = self._docker_root
        if data_root is None:
            return None
        self.file_reads += 1
        conf = _decode(_docker_config, read_bounded(os.path.join(data_root, "containers", place.id, "config.v2.json"), CONFIG_MAX))
        name = conf.Name.lstrip("/") if conf is not None else ""
        return shown(name) if name else None

    def _podman_name(self, place: Place) -> str | None:
        if place.owner_uid is not None:
            path = self._user_dir(place.owner_uid, ".local/share/containers/storage/overlay-containers/containers.json")
        else:
            path = self._path("/var/lib/containers/storage/overlay-containers/containers.json")
        if path is None:
            return None
        names = self._registry(path, self._read_podman).get(place.id)
        return names[0] if names else None

    def _read_podman(self, path: str) -> dict[str, tuple[str, ...]]:
        entries = _decode(_podman_registry, read_bounded(path, PODMAN_MAX)) or []
        return {e.id: tuple(shown(n) for n in e.names[:4]) for e in entries[:LISTING_MAX] if _HEX64.fullmatch(e.id)}

    def _lxc_name(self, place: Place) -> str | None:
        if place.owner_uid is not None or not _VMID.fullmatch(place.id):
            return None  # LXC and LXD name a container by its path already; Proxmox by a VMID, its hostname is in its conf
        data = read_bounded(self._path(f"/etc/pve/lxc/{place.id}.conf"), CONFIG_MAX)
        for line in (data or b"").split(b"\n"):
            if line.startswith(b"["):
                break  # a snapshot section: the current config is above it
            key, sep, value = line.partition(b":")
            if sep and key.strip() == b"hostname" and value.strip():
                return shown(value.strip())
        return None

    def _kubernetes_names(self, base: Container) -> Container:
        pods = self._registry(self._path("/var/log/pods"), _read_pods).get(base.pod_uid or "")
        ctr = self._registry(self._path("/var/log/containers"), _read_log_links).get(base.id) if base.id else None
        ns, pod = pods if pods else (None, None)
        return msgspec.structs.replace(base, namespace=ns, pod=pod, name=ctr[0] if ctr else None)

    def _registry(self, path: str, read: Callable[[str], dict[str, tuple[str, ...]]]) -> dict[str, tuple[str, ...]]:
        """``read(path)``'s map, made again only when the file or folder changed, at most every RELIST_S."""
        lst = self._listings.setdefault(path, _Listing())
        now = time.monotonic()
        if lst.names is not None and now - lst.checked < RELIST_S:
            return lst.names
        lst.checked = now
        try:
            st = os.stat(path)
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            lst.signature, lst.names = None, {}
            return lst.names
        if lst.names is None or sig != lst.signature:
            self.file_reads += 1
            lst.signature, lst.names = sig, read(path)
        return lst.names


def _scan(path: str) -> list[str]:
    """At most LISTING_MAX entry names of a folder (not through a final link); [] where it cannot be read."""
    out: list[str] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return out
    try:
        with os.scandir(fd) as it:
            for entry in it:
                out.append(entry.name)
                if len(out) >= LISTING_MAX:
                    break
    except OSError:
        pass
    finally:
        os.close(fd)
    return out


def _read_pods(path: str) -> dict[str, tuple[str, ...]]:
    """/var/log/pods/<namespace>_<pod>_<uid> -> {uid: (namespace, pod)} (names are DNS labels: no "_" in them)."""
    out: dict[str, tuple[str, ...]] = {}
    for name in _scan(path):
        parts = name.split("_")
        if len(parts) == 3 and _UUID.fullmatch(parts[2]):
            out[parts[2]] = (shown(parts[0]), shown(parts[1]))
    return out


def _read_log_links(path: str) -> dict[str, tuple[str, ...]]:
    """/var/log/containers/<pod>_<namespace>_<container>-<64 hex>.log -> {id: (container,)}."""
    out: dict[str, tuple[str, ...]] = {}
    for name in _scan(path):
        stem = name.removesuffix(".log")
        cid = stem[-64:]
        parts = stem[:-65].split("_")
        if stem != name and len(stem) > 65 and stem[-65] == "-" and _HEX64.fullmatch(cid) and len(parts) == 3 and parts[2]:
            out[cid] = (shown(parts[2]),)
    return out


class ContainerReader:
    """Reads the container of a process from /proc/PID/cgroup and names it (:class:`ContainerNames`); never raises."""

    def __init__(self, names: ContainerNames | None = None, proc: str = "/proc") -> None:
        self.names = names if names is not None else ContainerNames()
        self.proc = proc
        self._hierarchies: int | None = None
        self.reads = 0  # /proc/PID/cgroup files read (the tests and the benchmark report it)
        self.refused: dict[int, str] = {}  # the latest pids whose file was not believed, and why (bounded)

    def hierarchies(self, again: bool = False) -> int | None:
        """How many lines every process's cgroup file has on this host (this process's own), read once."""
        if self._hierarchies is None or again:
            data = read_bounded(os.path.join(self.proc, "self", "cgroup"), CGROUP_READ_MAX)
            self._hierarchies = None if data is None else len(data.rstrip(b"\n").split(b"\n"))
        return self._hierarchies

    def reading(self, pid: int) -> Reading:
        """What /proc/PID/cgroup says (one bounded read); an unreadable file names no container."""
        try:
            with open(os.path.join(self.proc, str(pid), "cgroup"), "rb") as fh:
                data = fh.read(CGROUP_READ_MAX)
        except OSError:
            return Reading(None, "cannot be read")
        self.reads += 1
        got = parse_cgroup(data, self.hierarchies())
        if got.place is None and got.problem and "hierarchies" in got.problem:  # a mount since the agent started?
            got = parse_cgroup(data, self.hierarchies(again=True))
        if got.problem:
            if len(self.refused) >= 64:
                self.refused.clear()
            self.refused[pid] = got.problem
        return got

    def of_pid(self, pid: int) -> Container | None:
        """The container ``pid`` runs in, named where its runtime's files say; None outside any container."""
        place = self.reading(pid).place
        return self.names.container(place) if place is not None else None


_shared: ContainerReader | None = None
_shared_lock = threading.Lock()


def shared_reader() -> ContainerReader:
    """This process's reader (its caches shared by every table), its runtimes' files under ``GPUDECK_CONTAINER_ROOT``."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ContainerReader(ContainerNames(os.environ.get(ROOT_ENV) or "/"))
        return _shared
