"""Provides membership discovery: which processes are a run's members now, at the run's containment level.

With a cgroup, the members are what ``cgroup.procs`` lists (the tag and
``RANK``/``LOCAL_RANK`` still give rank and role); a tagged process outside the
group is reported, not taken. Without one, the members are the tagged
processes of this agent's uid plus everything descended from the run's shim
(a child subreaper) or in its session or process group. A tagged process of
another uid is reported and never taken.

:func:`run_members` is the one answer to "which processes are this run's now"
that a stop and a reclaim listing both use, at every level; :func:`may_linger`
says cheaply whether an ended run can have any left, so a listing does not look
at every ended run's tree.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import msgspec

from gpudeck.agents.observe.procs import (
    CT_TOLERANCE,
    YOUNG_S,
    ProcEntry,
    ProcTable,
    StatLine,
    read_entry,
    read_stat,
)
from gpudeck.agents.safety.containment import RunGroup
from gpudeck.agents.wire.protocol import Member, Reported, RunInfo

PROC_TREE_ROLES = ("shim", "leader")


def cmdline_of(pid: int) -> list[str]:
    """A process's argv ([] when gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a][:32]
    except OSError:
        return []


def proc_tree() -> dict[int, StatLine]:
    """One /proc/PID/stat read of every process: parentage, session and process group (a full scan)."""
    out: dict[int, StatLine] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def list_pids() -> set[int]:
    """Every pid /proc shows now (one listdir)."""
    return {int(n) for n in os.listdir("/proc") if n.isdigit()}


def partial_tree(pids: set[int]) -> dict[int, StatLine]:
    """``pids`` and every ancestor of theirs: what :func:`descendants` needs to place new processes (cost grows with them, not with the host)."""
    out: dict[int, StatLine] = {}
    for pid in pids:
        while pid > 1 and pid not in out:
            st = read_stat(pid)
            if st is None:
                break
            out[pid] = st
            pid = st.ppid
    return out


class TreeWatch:
    """Parentage for the tick: a full scan the first time, then only the processes that appeared since (and their ancestors)."""

    def __init__(self) -> None:
        self._seen: set[int] | None = None

    def scan(self) -> dict[int, StatLine]:
        """The part of the process tree that can hold new members since the last scan."""
        pids = list_pids()
        tree = proc_tree() if self._seen is None else partial_tree(pids - self._seen)
        self._seen = pids
        return tree


def descendants(tree: dict[int, StatLine], roots: dict[int, float], sessions: set[int]) -> dict[int, StatLine]:
    """Processes below the roots ``{pid: create_time}`` (matched by create_time), or in one of ``sessions``/process groups."""
    children: dict[int, list[int]] = {}
    for pid, st in tree.items():
        children.setdefault(st.ppid, []).append(pid)
    found: dict[int, StatLine] = {}
    stack = [p for p, ct in roots.items() if p in tree and abs(tree[p].create_time - ct) <= CT_TOLERANCE]
    while stack:
        pid = stack.pop()
        for c in children.get(pid, ()):
            if c not in found:
                found[c] = tree[c]
                stack.append(c)
    for pid, st in tree.items():
        if pid not in found and pid not in roots and (st.sid in sessions or st.pgid in sessions):
            found[pid] = st
    return found


@dataclass
class Discovery:
    """What one look at a run found: members to add or update, and processes to report."""

    new: list[Member] = field(default_factory=list)
    updated: list[Member] = field(default_factory=list)
    outside: list[Reported] = field(default_factory=list)
    other_uid: list[Reported] = field(default_factory=list)
    untagged: list[int] = field(default_factory=list)
    in_group: set[int] | None = None  # with a group: every pid it listed
    replaces: dict[int, Member] = field(default_factory=dict)  # id() of a recorded member -> its updated copy (in ``updated``)


def _index(run: RunInfo) -> dict[int, list[Member]]:
    out: dict[int, list[Member]] = {}
    for m in run.members:
        out.setdefault(m.pid, []).append(m)
    return out


def _entry(procs: ProcTable, pid: int) -> ProcEntry | None:
    e = procs.get(pid)
    if e is None or e.create_time == 0.0:
        e = read_entry(pid)
    return e


def discover(run: RunInfo, procs: ProcTable, group: RunGroup | None, tree: dict[int, StatLine] | None, uid: int) -> Discovery:
    """The run's members now, against those recorded (``run.members``); ``tree`` is needed without a group."""
    d = Discovery()
    shim_pids = {m.pid for m in run.members if m.role == "shim"}
    now = time.time()
    index = _index(run)

    def _known(pid: int, ct: float) -> Member | None:
        return next((m for m in index.get(pid, ()) if abs(m.create_time - ct) <= CT_TOLERANCE), None)

    def take(pid: int, ct: float, e: ProcEntry | None, found_by: str) -> None:
        tagged = e is not None and e.run_id == run.id
        known = _known(pid, ct)
        if known is not None:
            if tagged and known.rank is None and e is not None and e.rank is not None and known.role == "worker":
                # first seen between fork and exec, with its parent's environment: now it has exec'd
                # (a copy: this may run in the tick's thread; the loop swaps it in when it applies the discovery)
                upd = msgspec.structs.replace(known, rank=e.rank, local_rank=e.local_rank, cmdline=cmdline_of(pid))
                d.replaces[id(known)] = upd
                d.updated.append(upd)
            return
        d.new.append(
            Member(
                pid=pid,
                create_time=ct,
                role="worker",
                rank=e.rank if tagged and e else None,
                local_rank=e.local_rank if tagged and e else None,
                first_seen=now,
                cmdline=tuple(cmdline_of(pid)),
                found_by=found_by,
                tagged=tagged,
            )
        )

    if group is not None:
        in_group: set[int] = set()
        # a recorded member that is still in the group is not read again (the tick's steady state: one read of cgroup.procs)
        # (a young tagged worker without a rank is read again: it may have been caught between fork and exec)
        settled = {m.pid for m in run.members if not (m.role == "worker" and m.rank is None and m.tagged and now - m.first_seen < YOUNG_S)}
        d.in_group = in_group
        for pid in group.pids():
            in_group.add(pid)
            if pid in settled:
                continue
            e = _entry(procs, pid)
            st = read_stat(pid)
            if st is None:
                continue
            ct = e.create_time if e is not None and abs(e.create_time - st.create_time) <= CT_TOLERANCE else st.create_time
            take(pid, ct, e, "cgroup")
            if e is None or e.run_id != run.id:
                d.untagged.append(pid)
        for e in procs.tagged(run.id):
            if e.pid in in_group or e.pid in shim_pids:
                continue
            st = read_stat(e.pid)
            if st is None or st.status == "zombie" or abs(st.create_time - e.create_time) > CT_TOLERANCE:
                continue
            d.outside.append(
                Reported(
                    pid=e.pid,
                    create_time=e.create_time,
                    uid=e.uid,
                    cmdline=cmdline_of(e.pid)[:12],
                    why=f"carries the tag of run {run.id} but is outside its cgroup ({group.path}): reported, not signalled",
                )
            )
        return d

    for e in procs.tagged(run.id):
        if e.pid in shim_pids:
            continue
        if e.uid is not None and e.uid != uid:
            d.other_uid.append(
                Reported(
                    pid=e.pid,
                    create_time=e.create_time,
                    uid=e.uid,
                    cmdline=cmdline_of(e.pid)[:12],
                    why=f"carries the tag of run {run.id} but runs as uid {e.uid}, not the agent's {uid}: reported, never signalled",
                )
            )
            continue
        take(e.pid, e.create_time, e, "tag")
    if tree is not None:
        roots = {m.pid: m.create_time for m in run.members if m.role in PROC_TREE_ROLES}
        roots.update({m.pid: m.create_time for m in run.members if m.role == "worker"})
        sessions = {m.pid for m in run.members if m.role == "shim"}  # the shim leads the run's session and process group
        tagged_pids = {e.pid for e in procs.tagged(run.id)}
        for pid, st in descendants(tree, roots, sessions).items():
            if pid in tagged_pids or st.status == "zombie":
                continue
            e = _entry(procs, pid)
            if e is not None and e.run_id is not None and e.run_id != run.id:
                continue  # another run's process (its own tag wins)
            if e is not None and e.uid is not None and e.uid != uid:
                d.other_uid.append(
                    Reported(
                        pid=pid,
                        create_time=st.create_time,
                        uid=e.uid,
                        cmdline=cmdline_of(pid)[:12],
                        why=f"descends from run {run.id} but runs as uid {e.uid}: reported, never signalled",
                    )
                )
                continue
            take(pid, st.create_time, e, "ancestry")
    return d


def run_members(
    run: RunInfo, procs: ProcTable, group: RunGroup | None, tree: dict[int, StatLine] | None, uid: int
) -> tuple[list[Member], Discovery]:
    """The run's members now, the one rule ``stop`` and ``reclaim`` share: the recorded members (updated where an exec
    gave a rank) and every process :func:`discover` finds at the run's level (its cgroup; else its tag and its ancestry).

    ``tree`` (:func:`proc_tree`) is needed without a group. The discovery is returned too (what was reported, not taken).
    """
    d = discover(run, procs, group, tree, uid)
    return [d.replaces.get(id(m), m) for m in run.members] + d.new, d


def session_marks(tree: dict[int, StatLine]) -> set[int]:
    """Every session id and process-group id a live process has (for :func:`may_linger`)."""
    return {st.sid for st in tree.values()} | {st.pgid for st in tree.values()}


def may_linger(run: RunInfo, tree: dict[int, StatLine], tagged: bool, marks: set[int]) -> bool:
    """Whether a run without a group can still have a process: one carries its tag, a recorded member is alive (pid and
    create_time), or a live process is in the session or process group its shim led (where an untagged descendant
    that left the tree still is)."""
    if tagged:
        return True
    for m in run.members:
        st = tree.get(m.pid)
        if st is not None and abs(st.create_time - m.create_time) <= CT_TOLERANCE:
            return True
        if m.role == "shim" and m.pid in marks:
            return True
    return False
