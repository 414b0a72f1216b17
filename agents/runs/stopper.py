"""Provides the stop sequence, shared by ``stop`` and ``reclaim``: TERM, grace, kill, wait, verify.

With a cgroup: SIGTERM to every process in the group (and to any that joins
it during the grace), then ``cgroup.kill`` (or freeze + SIGKILL) of what is
left in one step, a wait until ``cgroup.procs`` is empty and ``cgroup.events``
says ``populated 0``, and the group's removal. Without one: SIGTERM to every
member by ``(pid, create_time)`` through a pidfd, re-scans during the grace so
a process forked meanwhile is also stopped, SIGKILL to what is left.

The outcome of each process is classified once (:func:`classify`); the GPU
verification matches NVML's processes by ``(pid, create_time)``, so a pid a
stranger got after a member exited is neither blamed nor waited for.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gpudeck.agents.observe.gpus import GpuSource
from gpudeck.agents.observe.procs import (
    CT_TOLERANCE,
    alive,
    create_time_of,
    read_stat,
    signal_exact,
    status_of,
)
from gpudeck.agents.safety.containment import RunGroup
from gpudeck.agents.wire.protocol import GpuFreed, GpuProcess, Member, StoppedProcess, StopResult

KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the kernel to take them
GPU_SETTLE_S = 5.0  # after the processes are gone, how long to wait for NVML to drop them
RESCAN_EVERY_S = 0.5  # without a group: how often the grace re-scans for processes forked meanwhile
GROUP_RESCAN_S = 0.05  # with a group: how often the grace looks for a process that joined it (the end itself is an event)
PIDFD_WAIT_MAX = 256  # up to this many processes are waited for through pidfds (one fd each); more are polled


@dataclass
class Terminated:
    """What TERM → grace → kill did to each process."""

    signalled: list[Member] = field(default_factory=list)  # got SIGTERM (those found during the grace too)
    gone_after_term: list[Member] = field(default_factory=list)
    needed_kill: list[Member] = field(default_factory=list)
    gone_after_kill: list[Member] = field(default_factory=list)
    kill_how: str = "SIGKILL"
    group_empty: bool | None = None  # with a group: whether populated went to 0


def _key(m: Member) -> tuple[int, float]:
    return (m.pid, round(m.create_time, 1))


def group_members(group: RunGroup, skip: set[int] = frozenset()) -> list[Member]:  # type: ignore[assignment]
    """The group's processes now (but ``skip``), as members (create_time read now: a listed pid is in the group)."""
    out = []
    for pid in group.pids():
        if pid in skip:
            continue
        st = read_stat(pid)
        if st is not None and st.status != "zombie":
            out.append(Member(pid=pid, create_time=st.create_time, found_by="cgroup"))
    return out


async def terminate(
    live: list[Member],
    grace_s: float,
    *,
    group: RunGroup | None = None,
    rescan: Callable[[], Awaitable[list[Member]]] | None = None,
    poll: Callable[[], None] | None = None,
) -> Terminated:
    """SIGTERM, the grace (newcomers get SIGTERM too), then kill what is left and wait; see the module docstring.

    With a group every wait is on ``cgroup.events`` (the kernel's notification that ``populated`` changed),
    in a thread, so the stop returns as soon as the last process exits and the event loop never reads
    hundreds of processes' files itself.
    """
    t = Terminated()
    seen: set[tuple[int, float]] = set()

    def term(ms: list[Member]) -> None:
        for m in ms:
            k = _key(m)
            if k in seen:
                continue
            seen.add(k)
            t.signalled.append(m)
            signal_exact(m.pid, m.create_time, signal.SIGTERM)

    deadline = time.monotonic() + grace_s
    if group is not None:

        def first() -> None:
            term(live)
            term(group_members(group))

        def step(timeout: float) -> bool:
            # the kernel says when the run is over: populated 0; a process that joined meanwhile gets its SIGTERM
            if group.wait_empty(timeout):
                return True
            term(group_members(group, skip={m.pid for m in t.signalled}))
            return False

        await asyncio.to_thread(first)
        while True:
            if poll is not None:
                poll()
            left = deadline - time.monotonic()
            if left <= 0 or await asyncio.to_thread(step, min(left, GROUP_RESCAN_S)):
                break

        def kill() -> bool:
            for m in t.signalled:
                (t.needed_kill if alive(m.pid, m.create_time) else t.gone_after_term).append(m)
            if not group.populated():
                return True
            late = [m for m in group_members(group) if _key(m) not in seen]
            t.signalled += late
            t.needed_kill += late
            t.kill_how = group.kill()
            return group.wait_empty(KILL_WAIT_S)

        t.group_empty = await asyncio.to_thread(kill)
        t.gone_after_kill = await asyncio.to_thread(lambda: [m for m in t.needed_kill if not alive(m.pid, m.create_time)])
        return t

    term(live)
    last_rescan = time.monotonic()
    delay = 0.01
    while True:
        if poll is not None:
            poll()
        if rescan is not None and time.monotonic() - last_rescan >= RESCAN_EVERY_S:
            term(await rescan())
            last_rescan = time.monotonic()
        if not any(alive(m.pid, m.create_time) for m in t.signalled):
            if rescan is None:
                break
            more = [m for m in await rescan() if _key(m) not in seen]  # nothing forked at the very end?
            last_rescan = time.monotonic()
            if not more:
                break
            term(more)
            continue
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
    for m in t.signalled:
        (t.needed_kill if alive(m.pid, m.create_time) else t.gone_after_term).append(m)
    if rescan is not None and t.needed_kill:
        late = [m for m in await rescan() if _key(m) not in seen]
        t.signalled += late
        t.needed_kill += late
    for m in t.needed_kill:
        signal_exact(m.pid, m.create_time, signal.SIGKILL)
    if t.needed_kill:
        await _wait_gone(t.needed_kill, KILL_WAIT_S, poll)
    t.gone_after_kill = [m for m in t.needed_kill if not alive(m.pid, m.create_time)]
    return t


async def _wait_gone(members: list[Member], timeout: float, poll: Callable[[], None] | None) -> list[Member]:
    """Wait until members are dead (zombies count as dead); return those that went.

    Event-driven where it can be: a pidfd becomes readable when its process exits, so up to
    ``PIDFD_WAIT_MAX`` members are waited for through the loop's selector; more are polled.
    """
    pending: list[Member] = []
    gone: list[Member] = []
    for m in members:
        (pending if alive(m.pid, m.create_time) else gone).append(m)
    if not pending:
        return gone
    if len(pending) <= PIDFD_WAIT_MAX:
        return gone + await _wait_pidfds(pending, timeout, poll)
    deadline = time.monotonic() + timeout
    delay = 0.01
    while pending:
        if time.monotonic() >= deadline:
            break
        if poll is not None:
            poll()
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)
        still: list[Member] = []
        for m in pending:
            (still if alive(m.pid, m.create_time) else gone).append(m)
        pending = still
    return gone


async def _wait_pidfds(pending: list[Member], timeout: float, poll: Callable[[], None] | None) -> list[Member]:
    loop = asyncio.get_running_loop()
    fds: dict[int, Member] = {}
    gone: list[Member] = []
    exited: asyncio.Queue[int] = asyncio.Queue()
    try:
        for m in pending:
            try:
                fd = os.pidfd_open(m.pid)
            except OSError:
                gone.append(m)
                continue
            if not alive(m.pid, m.create_time):  # checked after the open: the fd names the member or it has gone
                os.close(fd)
                gone.append(m)
                continue
            fds[fd] = m
            loop.add_reader(fd, exited.put_nowait, fd)
        deadline = time.monotonic() + timeout
        while fds:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                fd = await asyncio.wait_for(exited.get(), min(left, 0.1))
            except TimeoutError:
                if poll is not None:
                    poll()
                continue
            if fd in fds:
                gone.append(fds.pop(fd))
                loop.remove_reader(fd)
                os.close(fd)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
    return gone


wait_gone = _wait_gone


def classify(
    result: StopResult,
    targets: list[Member],
    t: Terminated,
    *,
    report_gone: Callable[[Member], bool] = lambda m: True,
) -> None:
    """One outcome per process into ``result.stopped`` / ``result.survivors``; stop and reclaim share it.

    ``targets`` are the processes the stop was for (a target never signalled had already gone);
    ``report_gone`` says whether such an already-gone target is news (a leader is, a finished worker is not).
    """
    signalled = {_key(m) for m in t.signalled}
    term_keys = {_key(m) for m in t.gone_after_term}
    kill_keys = {_key(m) for m in t.gone_after_kill}
    by_key = {_key(m): m for m in targets}
    for m in t.signalled:  # processes found during the grace (forked meanwhile, or only in the group)
        by_key.setdefault(_key(m), m)
    for k, m in by_key.items():
        cmd = m.cmdline[:12]
        st = status_of(m.pid, m.create_time)
        if k not in signalled:
            if report_gone(m):
                result.stopped.append(
                    StoppedProcess(pid=m.pid, cmdline=cmd, role=m.role, how="zombie" if st == "zombie" else "already_gone", status=st)
                )
        elif k in term_keys:  # ended by the SIGTERM; a zombie now only waits for its parent's wait (it holds nothing)
            result.stopped.append(StoppedProcess(pid=m.pid, cmdline=cmd, role=m.role, how="SIGTERM", status=st))
        elif k in kill_keys:
            result.stopped.append(StoppedProcess(pid=m.pid, cmdline=cmd, role=m.role, how="SIGKILL"))
        else:
            result.survivors.append(StoppedProcess(pid=m.pid, cmdline=cmd, role=m.role, how="survived", status=st))
    result.needed_kill = [m.pid for m in t.needed_kill]


async def verify_gpu(
    gpus: GpuSource,
    result: StopResult,
    members: list[Member],
    before: dict[int, int],
    verified: str = "no process of the run holds GPU memory",
) -> None:
    """Wait for NVML to drop every member, matched by (pid, create_time); record what was freed and who still holds.

    ``verified``: what the check covered, in words ("no process of the run holds GPU memory" for a whole run's stop;
    a reclaim names the processes it stopped)."""
    if not gpus.available:
        result.gpu_verified = False
        result.gpu_note = f"GPU memory not verified: {gpus.error}"
        return
    want: dict[int, list[float]] = {}
    for m in members:
        want.setdefault(m.pid, []).append(m.create_time)

    def is_member(p: GpuProcess) -> bool:
        cts = want.get(p.pid)
        if not cts:
            return False
        ct = p.create_time if p.create_time is not None else create_time_of(p.pid)
        if ct is None:
            return any(c == 0.0 for c in cts)  # a pid the OS no longer shows: blamed only when it was recorded as such
        return any(c == 0.0 or abs(c - ct) <= CT_TOLERANCE for c in cts)

    deadline = time.monotonic() + GPU_SETTLE_S
    while True:
        sample = await asyncio.to_thread(gpus.sample)
        for g in sample:
            for p in g.processes:
                if p.create_time is None:
                    p.create_time = create_time_of(p.pid)
        holders = [p for g in sample for p in g.processes if is_member(p)]
        if not holders or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    after = {g.index: g.memory_used for g in sample}
    result.still_on_gpu = [
        GpuProcess(pid=p.pid, gpu=p.gpu, used_bytes=p.used_bytes, attribution="STALE", run_id=result.run_id, create_time=p.create_time)
        for p in holders
    ]
    for idx, b in sorted(before.items()):
        a = after.get(idx, b)
        result.freed.append(GpuFreed(gpu=idx, before_bytes=b, after_bytes=a, freed_bytes=max(0, b - a)))
    result.freed_bytes = sum(f.freed_bytes for f in result.freed)
    result.gpu_verified = not holders
    if holders:
        result.gpu_note = "still holding GPU memory: " + ", ".join(
            f"pid {p.pid} on GPU {p.gpu} ({(p.used_bytes or 0) / 2**30:.1f} GiB)" for p in holders
        )
    else:
        via = "on the SIMULATED GPUs (memory the processes declared; no NVML here)" if gpus.simulated else "through NVML"
        result.gpu_note = f"verified {via}: {verified}; {result.freed_bytes / 2**30:.2f} GiB freed"


def summary(result: StopResult) -> str:
    """One line: what was stopped, what needed SIGKILL, what survived, the GPU verification."""
    parts = [f"stopped {len(result.stopped)} process(es)"]
    if result.needed_kill:
        shown = ", ".join(map(str, result.needed_kill[:16])) + (
            f", … {len(result.needed_kill) - 16} more" if len(result.needed_kill) > 16 else ""
        )
        parts.append(f"{len(result.needed_kill)} needed SIGKILL ({shown})")
    if result.survivors:
        parts.append(f"{len(result.survivors)} SURVIVED: " + ", ".join(f"{s.pid} ({s.status})" for s in result.survivors))
    if result.reported:
        parts.append(f"{len(result.reported)} reported, not signalled: " + "; ".join(f"pid {r.pid}: {r.why}" for r in result.reported[:4]))
    parts.append(result.gpu_note)
    return "; ".join(p for p in parts if p)
