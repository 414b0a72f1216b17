"""Provides attribution: which run a process belongs to, one answer for the snapshot, the supervisor and reclaim.

In order: the run whose cgroup holds the pid (the kernel's word); the run
whose tag the process carries; a member the supervisor recorded by
``(pid, create_time)`` (found by parentage at the tag level). Never by pid alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpudeck.agents.observe.procs import CT_TOLERANCE, ProcEntry, create_time_of
from gpudeck.agents.safety.containment import Containment
from gpudeck.agents.wire.protocol import GpuProcess, Member

LIVE = ("starting", "running", "stopping")


@dataclass(frozen=True)
class Owner:
    """The run a process belongs to and how that is known."""

    run_id: str
    via: str  # "cgroup" | "tag" | "member"
    rank: int | None = None


class Attribution:
    """Answers 'which run is this pid' from the containment, the tag and the recorded members."""

    def __init__(self, containment: Containment, run_state: Callable[[str], str | None]) -> None:
        self.containment = containment
        self.run_state = run_state
        self._members: dict[int, tuple[str, Member]] = {}  # pid -> (run id, member): rebuilt by the supervisor

    def index(self, runs: dict[str, list[Member]]) -> None:
        """Replace the recorded-member index: {run id: members}."""
        self._members = {m.pid: (rid, m) for rid, ms in runs.items() for m in ms if m.role != "shim"}

    def owner(self, pid: int, create_time: float | None, entry: ProcEntry | None = None) -> Owner | None:
        """The run ``(pid, create_time)`` belongs to, or None (a process of no run)."""
        if self.containment.has_groups:
            rid = self.containment.group_of_pid(pid)
            if rid is not None:
                return Owner(rid, "cgroup", entry.rank if entry is not None and entry.run_id == rid else None)
        if entry is not None and entry.run_id is not None:
            return Owner(entry.run_id, "tag", entry.rank)
        known = self._members.get(pid)
        if known is not None:
            rid, m = known
            ct = create_time if create_time is not None else create_time_of(pid)
            if ct is not None and abs(ct - m.create_time) <= CT_TOLERANCE:
                return Owner(rid, "member", m.rank)
        return None

    def correct(self, p: GpuProcess, entry: ProcEntry | None) -> None:
        """Fix a GPU process's attribution where the group or a recorded member says more than the tag did.

        Only an untagged process is looked up (a tagged one is its tag's run; its group agrees): the
        tick's cost stays with the processes the tag cannot place. The container it runs in comes with its
        table entry (read once per process, agents/observe/containers.py).
        """
        if entry is not None and p.container is None:
            p.container = entry.read_container()
        if p.attribution == "NO_SUCH_PROCESS" or (p.attribution in ("RUN", "STALE") and p.run_id):
            return
        own = self.owner(p.pid, p.create_time, entry)
        if own is None or (own.run_id == p.run_id and p.attribution in ("RUN", "STALE")):
            return
        p.run_id = own.run_id
        if own.rank is not None:
            p.rank = own.rank
        p.attribution = "RUN" if self.run_state(own.run_id) in LIVE else "STALE"
