"""Provides the connection budget: who is at the other end of the agent's socket, and how many connections it may hold.

Any process of the agent's user may connect, and a run's processes can find the socket (their environment names the
state folder). Left alone, one run could hold every connection the agent serves and lock its operator out. So each
peer is placed when it connects (``SO_PEERCRED`` gives its pid and uid; the kernel, not the peer, says so):

- **a run's process**: in a run's cgroup (where the agent gives runs one), carrying a run's tag (``GPUDECK_RUN_ID``,
  read from /proc/PID/environ as the process table reads it), a member the supervisor tracks, or a descendant of
  one of those (a process that cleared its environment is still its parent's child);
- **the operator**: every other peer (the CLI, `gpudeck agent dial` for consoles, `agent status`).

A run's processes together hold at most ``PER_RUN`` connections, one process of a run at most ``PER_PID``, and all
runs together never more than the cap less ``OPERATOR_RESERVE``: that share of the cap is only the operator's. A
connection past a limit gets a typed ``connection_limit`` error naming the limit, and is closed. The operator's
peers are limited only by the cap itself (where idle connections give way: the daemon's eviction).
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpudeck.agents.observe.procs import read_entry, read_stat

PER_RUN = 16  # connections all processes of one run may hold at once (a run's own tooling needs a few)
PER_PID = 8  # connections one process of a run may hold at once
OPERATOR_RESERVE = 32  # of the cap, kept for peers in no run (a quarter of the cap when that is smaller)
MAX_ANCESTORS = 16  # parents looked at for a run's member or tag
_CACHE = 1024  # peers remembered by (pid, start time): a process that connects again is not read again


@dataclass(frozen=True)
class Peer:
    """One connecting process: its pid and uid, and the run it belongs to (None: the operator) and how that is known."""

    pid: int
    uid: int
    run_id: str | None = None
    how: str = ""  # "cgroup", "tag", "member", "parent <pid> (tag)" ...

    def describe(self) -> str:
        """'pid 4412 (run r-7f3a, by its cgroup)' or 'pid 4412'."""
        return f"pid {self.pid} (run {self.run_id}, by its {self.how})" if self.run_id else f"pid {self.pid}"


class PeerFinder:
    """Places a peer pid in a run or not; ``group_of_pid`` is the containment's (cgroup) answer, ``members`` the live
    runs' member pids as the supervisor tracks them (called per lookup: runs come and go)."""

    def __init__(self, group_of_pid: Callable[[int], str | None], members: Callable[[], Mapping[int, str]]) -> None:
        self._group_of_pid = group_of_pid
        self._members = members
        self._cache: OrderedDict[tuple[int, float], tuple[str | None, str]] = OrderedDict()
        self._me = os.getpid()

    def _place(self, pid: int) -> tuple[str | None, str]:
        run = self._group_of_pid(pid)
        if run:
            return run, "cgroup"
        members = self._members()
        at, how = pid, ""
        for _ in range(MAX_ANCESTORS):
            if at in members:
                return members[at], f"{how} (a member)" if how else "member"
            entry = read_entry(at)
            if entry is not None and entry.run_id:
                return entry.run_id, f"{how} (its tag)" if how else "tag"
            st = read_stat(at)
            if st is None or st.ppid <= 1 or st.ppid == self._me:  # init, or the agent itself (it launched this one)
                break
            at, how = st.ppid, f"parent {st.ppid}"
        return None, ""

    def peer(self, pid: int, uid: int) -> Peer:
        """The peer ``pid`` (uid from SO_PEERCRED) placed; a pid that is gone already is the operator's (it holds nothing)."""
        st = read_stat(pid)
        if st is None:
            return Peer(pid=pid, uid=uid)
        key = (pid, st.create_time)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._place(pid)
            self._cache[key] = hit
            if len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return Peer(pid=pid, uid=uid, run_id=hit[0], how=hit[1])


class ConnBudget:
    """Connections held, by run and by pid; :meth:`refusal` says whether one more from a peer fits."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.by_run: Counter[str] = Counter()
        self.by_pid: Counter[int] = Counter()
        self.runs_total = 0
        self.refused = 0

    @property
    def reserve(self) -> int:
        """Connections only peers in no run may take."""
        return min(OPERATOR_RESERVE, self.cap // 4)

    def refusal(self, peer: Peer, host: str) -> str | None:
        """Why ``peer`` may not have one more connection now (the message of a ``connection_limit`` error), or None."""
        if peer.run_id is None:
            return None
        who = f"{peer.describe()} on {host}"
        if self.by_pid[peer.pid] >= PER_PID:
            why = f"{who} holds {self.by_pid[peer.pid]} connections to the agent, the most one process of a run may"
        elif self.by_run[peer.run_id] >= PER_RUN:
            why = f"the processes of run {peer.run_id} hold {self.by_run[peer.run_id]} connections, the most one run may ({who} asked for one more)"
        elif self.runs_total >= self.cap - self.reserve:
            why = (
                f"runs hold {self.runs_total} of the agent's {self.cap} connections; the other {self.reserve} are kept for the "
                f"operator's CLI and consoles ({who} asked for one more)"
            )
        else:
            return None
        self.refused += 1
        return f"{why}: close connections it does not use, or reuse one (a connection carries many requests and streams)"

    def add(self, peer: Peer) -> None:
        """Count a connection of ``peer`` (accepted)."""
        if peer.run_id is None:
            return
        self.by_pid[peer.pid] += 1
        self.by_run[peer.run_id] += 1
        self.runs_total += 1

    def remove(self, peer: Peer) -> None:
        """A connection of ``peer`` closed."""
        if peer.run_id is None:
            return
        self.by_pid[peer.pid] -= 1
        if self.by_pid[peer.pid] <= 0:
            del self.by_pid[peer.pid]
        self.by_run[peer.run_id] -= 1
        if self.by_run[peer.run_id] <= 0:
            del self.by_run[peer.run_id]
        self.runs_total -= 1
