"""Provides where this agent runs: in the host's PID namespace, or in another one (a container), found once at start.

Inside a PID namespace other than the host's (Docker without ``--pid=host``, LXC,
a Kubernetes pod, ``unshare --pid``) NVML lists only the processes of that
namespace, so GPU memory held by processes outside it shows as memory that no
visible process explains. What the agent can learn without running any program:

- the PID namespace's inode from ``/proc/self/ns/pid``: the kernel gives the
  initial (host) namespace the fixed inode ``0xEFFFFFFC`` (``PROC_PID_INIT_INO``,
  Linux 3.8 and later), so any other number is a namespace of its own. This holds
  even where ``/proc`` was mounted for the inner namespace, where comparing with
  ``/proc/1/ns/pid`` shows nothing (pid 1 is then the container's own init);
- ``NSpid`` in ``/proc/self/status`` with more than one entry (the pid as each
  namespace from procfs's down sees it): nested, when ``/proc`` is the host's;
- container markers, which say "a container" but not which PID namespace:
  ``/.dockerenv``, ``/run/.containerenv`` (podman), ``container=`` in pid 1's
  environment (systemd-nspawn, LXC, podman), and a docker/kubepods/lxc/containerd
  path in ``/proc/1/cgroup``.

The PID namespace decides; a marker alone is reported as what it is (an image
built by Docker keeps ``/.dockerenv`` in a VM too). Every read is bounded and a
file that cannot be read is evidence of nothing.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Literal

from gpudeck.agents.wire.protocol import NamespaceInfo

INITIAL_PID_NS_INODE = 0xEFFFFFFC  # PROC_PID_INIT_INO in include/linux/proc_ns.h
_READ_LIMIT = 64 * 1024  # bytes read of any one /proc file (pid 1's environment can be large)
_CGROUP_CONTAINER = re.compile(r"(docker|kubepods|libpod|lxc|containerd|cri-o|crio)", re.IGNORECASE)
_ENV_CONTAINER = re.compile(rb"(?:^|\0)container=([^\0]{1,64})")


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(_READ_LIMIT)
    except OSError:
        return None


def _ns_inode(link: str) -> int | None:
    """'pid:[4026531836]' -> 4026531836."""
    m = re.fullmatch(r"pid:\[(\d+)\]", link)
    return int(m.group(1)) if m else None


def detect(root: str | os.PathLike[str] = "/") -> NamespaceInfo:
    """Which PID namespace this process is in and which container markers are present (``root``: a test's fake tree)."""
    base = Path(root)
    proc = base / "proc"
    evidence: list[str] = []
    isolated: bool | None = None
    inode: int | None = None
    try:
        inode = _ns_inode(os.readlink(proc / "self" / "ns" / "pid"))
    except OSError:
        inode = None
    if inode is not None:
        isolated = inode != INITIAL_PID_NS_INODE
        evidence.append(f"/proc/self/ns/pid is pid:[{inode}]" + (" (not the host's)" if isolated else " (the host's)"))
    status = _read(proc / "self" / "status")
    if status is not None:
        m = re.search(rb"^NSpid:\s*([0-9\t ]+)$", status, re.MULTILINE)
        if m:
            levels = m.group(1).split()
            if len(levels) > 1:
                isolated = True
                evidence.append(f"NSpid lists {len(levels)} levels ({' '.join(x.decode() for x in levels)})")
    markers: list[str] = []
    for marker in ("/.dockerenv", "/run/.containerenv"):
        if (base / marker.lstrip("/")).exists():
            markers.append(marker)
    env1 = _read(proc / "1" / "environ")
    if env1 is not None:
        m2 = _ENV_CONTAINER.search(env1)
        if m2:
            markers.append(f"container={m2.group(1).decode('ascii', 'replace')[:32]} in pid 1's environment")
    cg1 = _read(proc / "1" / "cgroup")
    if cg1 is not None:
        m3 = _CGROUP_CONTAINER.search(cg1.decode("utf-8", "replace"))
        if m3:
            markers.append(f"/proc/1/cgroup names {m3.group(1).lower()}")
    return NamespaceInfo(
        pid_namespace=_word(isolated), container_markers=tuple(markers), evidence=tuple(evidence), label=_label(isolated, markers)
    )


def _word(isolated: bool | None) -> Literal["host", "isolated", "unknown"]:
    return "unknown" if isolated is None else ("isolated" if isolated else "host")


def _label(isolated: bool | None, markers: list[str]) -> str:
    seen = f" (container markers: {', '.join(markers)})" if markers else ""
    if isolated:
        return f"own PID namespace{seen}: NVML lists only this namespace's processes; GPU memory held outside it shows as unaccounted"
    if isolated is False:
        extra = "; the PID namespace is the host's, so every GPU process is visible" if markers else ""
        return f"host PID namespace{seen}{extra}"
    return f"PID namespace unknown (/proc/self/ns/pid unreadable){seen}"


@functools.cache
def current() -> NamespaceInfo:
    """This agent's PID namespace, read once per process."""
    return detect("/")
