"""Provides the stop of one run and the stop sequence it shares with ``reclaim``: TERM, grace, kill, wait, verify.

With a cgroup: SIGTERM to every process in the group (and to any that joins
it during the grace), then ``cgroup.kill`` (or freeze + SIGKILL) of what is
left in one step, a wait until ``cgroup.procs`` is empty and ``cgroup.events``
says ``populated 0``, and the group's removal. Without one: SIGTERM to every
member by ``(pid, create_time)`` through a pidfd, re-scans during the grace so
a process forked meanwhile is also stopped, SIGKILL to what is left.

The outcome of each process is classified once (:func:`classify`); the GPU
verification matches NVML's processes by ``(pid, create_time)``, so a pid a
stranger got after a member exited is neither blamed nor waited for.

A live run is stopped and recorded as ``stopped`` with what it took (SIGKILLs,
survivors, the GPU memory freed); an ended run's leftovers are stopped and the
stop recorded as ``reclaimed``. Concurrent stops of one run share one result; a
stop an earlier agent began is finished with the grace already spent counted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.health import claims
from gpudeck.agents.observe.gpus import GpuSource
from gpudeck.agents.observe.procs import (
    CT_TOLERANCE,
    alive,
    create_time_of,
    read_stat,
    signal_exact,
    status_of,
)
from gpudeck.agents.runs import adoption, run_telemetry, states, tick
from gpudeck.agents.runs.ending import read_exit_record
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety.containment import RunGroup, put_figures
from gpudeck.agents.safety.membership import proc_tree, run_members
from gpudeck.agents.wire.errors import BadRequest
from gpudeck.agents.wire.protocol import TERMINAL_STATES, GpuFreed, GpuProcess, Member, RunInfo, StoppedProcess, StopResult

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor


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
    ends: Callable[[], float] | None = None,
) -> Terminated:
    """SIGTERM, the grace (newcomers get SIGTERM too), then kill what is left and wait; see the module docstring.

    With a group every wait is on ``cgroup.events`` (the kernel's notification that ``populated`` changed),
    in a thread, so the stop returns as soon as the last process exits and the event loop never reads
    hundreds of processes' files itself. ``ends``: when the grace ends (monotonic), asked again at every wait, so a
    later request can shorten it (default: ``grace_s`` from now).
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

    fixed = time.monotonic() + grace_s

    def deadline() -> float:
        return ends() if ends is not None else fixed

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
            left = deadline() - time.monotonic()
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
        if time.monotonic() >= deadline():
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
        cmd = list(m.cmdline[:12])
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
    if result.grace_shortened_s is not None:
        parts.append(f"the grace was cut to {result.grace_shortened_s:g} s by a later stop that asked for less")
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


TAG_LIMIT = (
    "at the tag + ancestry level a process that cleared its environment and left the run's process tree, "
    "session and process group cannot be found; a cgroup (root, or a delegated cgroup v2 subtree) closes that gap"
)


async def stop(sup: Supervisor, ref: str, grace_s: float = 30.0, reason: str = "stopped by operator") -> StopResult:
    """Stop one run entirely and verify; concurrent stops of the same run share one result."""
    if grace_s < 0 or grace_s > 3600:
        raise BadRequest(f"grace {grace_s} s is out of range: give 0 to 3600 seconds")
    run = sup.resolve(ref)
    task = sup.runs.stop_once(run.id, lambda: stop_run(sup, run, grace_s, reason), grace_ends=time.monotonic() + grace_s)
    return await asyncio.shield(task)


async def members_now(sup: Supervisor, run: RunInfo, group: RunGroup | None, lr: LiveRun | None, full: bool = True) -> list[Member]:
    """A fresh look at the run's processes (``full``: every pid's identity checked again): recorded members plus what is found now.

    The reads run in a thread; what they found is applied on the loop.
    """
    await asyncio.to_thread(sup.procs.refresh, full)
    tree = None if group is not None else await asyncio.to_thread(proc_tree)
    if lr is not None:
        lk = await asyncio.to_thread(tick.look, sup, lr, tree)
        if lk.members is run.members:
            tick.apply_look(sup, lr, lk)
        else:  # changed meanwhile: looked at again, here
            tick.discover_members(sup, lr, tree)
        return list(run.members)
    run.members, _ = await asyncio.to_thread(run_members, run, sup.procs, group, tree, sup.uid)  # reclaim's rule too
    return list(run.members)


async def stop_run(sup: Supervisor, run: RunInfo, grace_s: float, reason: str = "stopped by operator") -> StopResult:
    """TERM, grace, kill, wait, verify one run (see :func:`stop`); every read of its hundreds of processes in a thread."""
    t0 = time.monotonic()
    was_terminal = run.state in TERMINAL_STATES
    lr = sup.runs.get(run.id)
    if lr is None and not was_terminal:
        lr = sup.runs.add(LiveRun(info=run, group=adoption.group_of(sup, run)))
    group = lr.group if lr is not None else (sup.runs.ended_group(run.id) or adoption.group_of(sup, run))
    result = StopResult(
        run_id=run.id, state="stopping", containment=(run.containment.label if run.containment else sup.containment_info(group).label)
    )
    stop_started = time.time()
    grace_left = grace_s
    resumed = lr.take_resumed_stop() if lr is not None else None
    if resumed is not None:
        spent = max(0.0, time.time() - resumed)
        stop_started = resumed
        grace_left = max(0.0, grace_s - spent)
        result.resumed_after_s = round(spent, 3)
    if not was_terminal and run.state != "stopping":  # (a stop an earlier agent began is journaled as stopping already)
        sup.runs.transition(run, "stopping", states.STOP_REQUESTED, {"grace_s": grace_s, "stop_started": stop_started})
    # with a group the kernel names the members: no full re-read of every process's identity is needed
    members = await members_now(sup, run, group, lr, full=group is None)
    shim_m = next((m for m in members if m.role == "shim"), None)
    targets = [m for m in members if m.role != "shim"]
    live = await asyncio.to_thread(lambda: [m for m in targets if alive(m.pid, m.create_time)])
    if was_terminal and not live and (group is None or not group.populated()):
        if group is not None:
            sup.runs.settle_group(run.id, group)
        return StopResult(
            run_id=run.id,
            state=run.state,
            message=f"run {run.id} already ended ({run.cause}); none of its processes is alive",
            seconds=time.monotonic() - t0,
        )

    gpu_before = await asyncio.to_thread(sup.gpus.memory_used) if sup.gpus.available else {}

    async def rescan() -> list[Member]:
        ms = await members_now(sup, run, None, lr, full=False)
        return [m for m in ms if m.role != "shim" and alive(m.pid, m.create_time)]

    # the grace ends at the earliest any stop of this run asked for (a later `stop --grace 0` shortens this one)
    grace_from = time.monotonic()
    own_end = grace_from + grace_left
    sup.runs.grace_end(run.id, own_end)  # (a resumed stop's end is earlier than the one its request registered)

    def grace_ends() -> float:
        end = sup.runs.grace_end(run.id)
        return own_end if end is None else end

    t = await terminate(
        live, grace_left, group=group, rescan=rescan if group is None else None, poll=lambda: tick.poll_shims(sup), ends=grace_ends
    )
    if sup.runs.grace_cut(run.id):
        result.grace_shortened_s = round(max(0.0, grace_ends() - grace_from), 3)
    # the shim exits by itself once its child is gone; make sure it did
    if shim_m is not None:
        shim_list = [shim_m] if alive(shim_m.pid, shim_m.create_time) else []
        if shim_list and not await wait_gone(shim_list, 2.0, None):
            signal_exact(shim_m.pid, shim_m.create_time, signal.SIGKILL)
            await wait_gone(shim_list, 2.0, None)
        if lr is not None and lr.shim is not None:
            await asyncio.to_thread(_reap, lr.shim, 2.0)
    await asyncio.to_thread(lambda: classify(result, targets, t, report_gone=lambda m: m.role == "leader"))
    info = run.containment
    if info is not None:
        result.reported = list(info.outside) + list(info.other_uid)
    if group is not None:
        kept = None if t.group_empty else f"{len(group.pids())} process(es) still in it"
        if kept is None:
            if lr is not None and info is not None:
                put_figures(info, group.figures())
            why = (
                sup.runs.settle_group(run.id, group) if was_terminal or lr is None else None
            )  # a live run's group goes when its end is journaled
            result.group_note = (
                f"cgroup {group.path} emptied (populated 0)"
                + (f" by {t.kill_how}" if t.needed_kill else "")
                + ("" if why is None else f"; {why}")
            )
        else:
            result.group_note = f"cgroup {group.path} kept: {kept}"
    else:
        result.group_note = TAG_LIMIT
    await verify_gpu(sup.gpus, result, t.signalled + targets, gpu_before)
    result.seconds = round(time.monotonic() - t0, 3)

    if was_terminal:
        result.state = run.state
        result.message = (
            f"run {run.id} had already ended ({run.cause}); its {len(t.signalled)} leftover process(es) were stopped; " + summary(result)
        )
        if group is not None:
            sup.runs.settle_group(run.id, group)
        sup.runs.append("reclaimed", run.id, msgspec.to_builtins(result))
        return result
    assert lr is not None
    run_telemetry.poll(sup, lr, ending=True)  # its last records and last step, before the stop is recorded
    rec = read_exit_record(run.run_dir)
    code = rec.get("returncode") if rec else None
    sig = rec.get("signal") if rec else None
    cause = reason
    if result.resumed_after_s is not None:
        cause += f"; finished by a restarted agent {result.resumed_after_s:.1f} s after the stop began ({grace_left:.1f} s of the {grace_s:g} s grace were left)"
    if result.needed_kill:
        cause += f"; {len(result.needed_kill)} process(es) ignored SIGTERM for {grace_s:g} s and needed SIGKILL"
    if result.survivors:
        cause += f"; {len(result.survivors)} process(es) survived SIGKILL ({', '.join(f'{s.pid} {s.status}' for s in result.survivors)})"
    if result.reported:
        cause += f"; {len(result.reported)} process(es) reported and not signalled"
    if lr.shim_lost is not None:
        cause += f"; earlier, {lr.shim_lost}: its exit status is not known"
    result.state = "stopped"
    claims.record(sup.runs.append, lr.id, lr.last_obs)
    data: dict = {"state": "stopped", "cause": cause, "stop": msgspec.to_builtins(result)}
    if info is not None:
        data["containment"] = msgspec.to_builtins(info)
    sup.runs.transition(run, "stopped", states.STOP_VERIFIED, data, cause=cause, exit_code=code, signal=sig, ended=time.time())
    if group is not None and t.group_empty:
        # the registry removed it with the run's end; say if it could not
        if group.exists():
            result.group_note += f"; {group.path} could not be removed"
        else:
            result.group_note += " and removed"
    result.message = summary(result)
    if result.resumed_after_s is not None:
        result.message = (
            f"resumed a stop begun {result.resumed_after_s:.1f} s earlier by the previous agent ({grace_left:.1f} s of grace left); "
            + result.message
        )
    return result


def _reap(popen: subprocess.Popen, timeout: float) -> None:
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
