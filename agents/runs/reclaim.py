"""Provides reclaim: the leftovers of ended runs (and GPU holders of no run) listed, and exactly the chosen ones stopped.

A leftover of an ended run is what a ``stop`` of that run would stop: its
members by :func:`gpudeck.agents.safety.membership.run_members`, the rule the
stop uses, at the run's level (anything in its cgroup whatever its environment
says; else its tag and its ancestry: a process that cleared its environment but
descends from the run, or stays in its shim's session). Besides those, GPU
holders of no run and tagged processes of runs older than the ones looked at
(:mod:`gpudeck.agents.safety.leftovers`). A live run's process is reclaimed only
when asked; the stop is the stopper's, verified through NVML, and the result
names exactly what was verified (the processes stopped) and what still holds
memory: the rest of the same run, others on the same GPUs, and memory no
visible process explains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.observe import namespace as pid_namespace
from gpudeck.agents.observe.procs import CT_TOLERANCE, alive, read_stat
from gpudeck.agents.runs import stop, tick
from gpudeck.agents.safety import unaccounted
from gpudeck.agents.safety.containment import RunGroup
from gpudeck.agents.safety.leftovers import find_leftovers
from gpudeck.agents.safety.membership import may_linger, proc_tree, run_members, session_marks
from gpudeck.agents.wire.errors import BadRequest, StorageError
from gpudeck.agents.wire.protocol import TERMINAL_STATES, Gpu, GpuProcess, Leftover, Member, RunInfo, StoppedProcess, StopResult

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor

log = logging.getLogger("gpudeck.agent")
SIGNAL_PROOF = ("zombie", "disk_sleep", "no_such_process")  # leftover kinds whose note says what ends them instead
ENDED_RUNS_LOOKED_AT = 2000  # the newest ended runs whose processes a listing looks for (adoption settles as many)


async def run_processes(sup: Supervisor, include_live: bool = False) -> dict[int, tuple[str, Member]]:
    """pid -> (run id, member) for every live process of an ended run (and of a live one with ``include_live``), by
    :func:`~gpudeck.agents.safety.membership.run_members`: what a ``stop`` of that run would stop, at every level.

    Ended runs looked at: those with a group still here, and the newest :data:`ENDED_RUNS_LOOKED_AT` that may still
    have a process (:func:`~gpudeck.agents.safety.membership.may_linger`). What the loop owns (the live runs, the
    groups) is taken on the loop; the reads of /proc and the journal run in a thread.
    """
    live = {r.id: r for r in sup.live_runs()}
    groups = dict(sup.containment.groups())
    groups.update(sup.runs.ended_groups())
    return await asyncio.to_thread(_run_processes, sup, live, groups, include_live)


def _run_processes(
    sup: Supervisor, live: dict[str, RunInfo], groups: dict[str, RunGroup], include_live: bool
) -> dict[int, tuple[str, Member]]:
    tree = proc_tree()
    out: dict[int, tuple[str, Member]] = {}

    def take(rid: str, members: list[Member]) -> None:
        for m in members:
            st = tree.get(m.pid)
            if st is None or st.status == "zombie" or abs(st.create_time - m.create_time) > CT_TOLERANCE:
                continue  # gone, exited (holds nothing), or the pid now names another process
            out.setdefault(m.pid, (rid, m))

    if include_live:
        for r in live.values():
            take(r.id, [m for m in r.members if m.role != "shim"])
    runs = {r.id: r for r in sup.journal.list_runs(limit=ENDED_RUNS_LOOKED_AT, states=TERMINAL_STATES)}
    for rid in groups.keys() - runs.keys() - live.keys():
        known = sup.journal.get_run(rid)
        if known is not None:  # an unknown group: reported at adoption, not offered
            runs[rid] = known
    tagged = {e.run_id for e in sup.procs.tagged()}
    marks = session_marks(tree)
    for run in runs.values():
        if run.id in live or run.state not in TERMINAL_STATES:
            continue
        group = groups.get(run.id)
        if group is None and not may_linger(run, tree, run.id in tagged, marks):
            continue
        members, _ = run_members(run, sup.procs, group, tree if group is None else None, sup.uid)
        take(run.id, members)
    return out


async def leftovers(sup: Supervisor, include_live: bool = False, host_name: str | None = None) -> list[Leftover]:
    """Every leftover process here (see agents/safety/leftovers.py), with CPU % over a short sample."""
    await asyncio.to_thread(sup.procs.refresh, True)  # a full read of /proc, off the loop
    gpus = await asyncio.to_thread(sup.attributed_gpus) if sup.gpus.available else []
    found = find_leftovers(
        host_name or sup.host,
        sup.procs,
        gpus,
        sup.run_state,
        sup.journal.get_run,
        include_live=include_live,
        members=await run_processes(sup, include_live),
    )
    before = {lo.pid: read_stat(lo.pid) for lo in found}
    t0 = time.monotonic()
    await asyncio.sleep(0.25)
    dt = time.monotonic() - t0
    for lo in found:
        a, b = before.get(lo.pid), read_stat(lo.pid)
        if a is not None and b is not None and abs(a.create_time - b.create_time) <= CT_TOLERANCE:
            lo.cpu_percent = round(100.0 * (b.cpu_seconds - a.cpu_seconds) / dt, 1)
    return found


def reclaim_message(result: StopResult, found: dict[int, Leftover]) -> str:
    """The stop's one line, then what only a leftover's own kind can add: why signals do not end a zombie, a process
    in disk sleep or one the OS does not show, and what does. An orphan's note is the reclaim just done: never repeated
    back (one that exited and waits for its parent's wait is stopped, by SIGTERM, not a ``zombie`` leftover)."""
    notes = [
        f"pid {s.pid}: {found[s.pid].note}"
        for s in result.survivors + result.stopped
        if s.pid in found and found[s.pid].kind in SIGNAL_PROOF
    ]
    return stop.summary(result) + ("; " + "; ".join(notes) if notes else "")


async def reclaim(
    sup: Supervisor, pids: list[int], grace_s: float = 10.0, include_live: bool = False, host_name: str | None = None
) -> StopResult:
    """Stop exactly these leftovers: TERM, grace, KILL, verify through NVML; never a live run's process unless asked."""
    host = host_name or sup.host
    if not pids:
        raise BadRequest(f"name the pids to reclaim: `gpudeck reclaim {host}` lists the leftovers, `gpudeck reclaim {host}:PID` stops one")
    if grace_s < 0 or grace_s > 3600:
        raise BadRequest(f"grace {grace_s} s is out of range: give 0 to 3600 seconds")
    t0 = time.monotonic()
    found = {lo.pid: lo for lo in await leftovers(sup, include_live=True, host_name=host)}
    chosen: list[Leftover] = []
    for pid in dict.fromkeys(pids):
        lo = found.get(pid)
        if lo is None:
            raise BadRequest(
                f"pid {pid} is not a leftover on {host} (not a process of an ended run, not holding GPU memory outside a run): "
                f"reclaim stops only leftovers — `gpudeck reclaim {host}` lists them; a live run is stopped with `gpudeck stop RUN`"
            )
        if lo.kind == "live" and not include_live:
            raise BadRequest(
                f"pid {pid} belongs to live run {lo.run_id}: `gpudeck stop {lo.run_id}` stops the whole run; to stop this one process alone add --include-live"
            )
        chosen.append(lo)
    result = StopResult(run_id=None, state="reclaimed", containment=sup.containment.label)
    targets: list[Member] = []
    unsignalable: list[Leftover] = []
    for lo in chosen:
        if lo.kind == "no_such_process" or lo.create_time is None:
            unsignalable.append(lo)
        else:
            targets.append(Member(pid=lo.pid, create_time=lo.create_time, role="leftover", rank=lo.rank, cmdline=tuple(lo.cmdline[:12])))
    live = [m for m in targets if alive(m.pid, m.create_time)]
    gpu_before = await asyncio.to_thread(sup.gpus.memory_used) if sup.gpus.available else {}
    t = await stop.terminate(live, grace_s, poll=lambda: tick.poll_shims(sup))
    stop.classify(result, targets, t)
    for lo in unsignalable:
        result.survivors.append(StoppedProcess(pid=lo.pid, cmdline=lo.cmdline, role="leftover", how="survived", status="no such process"))
    await stop.verify_gpu(
        sup.gpus,
        result,
        targets + [Member(pid=lo.pid, create_time=0.0) for lo in unsignalable],
        gpu_before,
        verified=verified_words(chosen),
    )
    if sup.gpus.available:
        await _still_held(sup, result, chosen, host)
    result.seconds = round(time.monotonic() - t0, 3)
    result.message = reclaim_message(result, found)
    sup.runs.settle_emptied_groups()
    by_run: dict[str | None, list[int]] = {}
    for lo in chosen:
        by_run.setdefault(lo.run_id, []).append(lo.pid)
    try:
        for owner, rpids in by_run.items():
            sup.runs.append("reclaimed", owner, {"pids": rpids, **msgspec.to_builtins(result)})
    except StorageError:
        log.warning("could not journal the reclaim of %s", pids)
    return result


def verified_words(chosen: list[Leftover]) -> str:
    """What the verification covers, exactly: the processes this reclaim stopped, never 'the run'."""
    pids = ", ".join(str(lo.pid) for lo in chosen[:16]) + (f", … {len(chosen) - 16} more" if len(chosen) > 16 else "")
    n = len(chosen)
    return f"the {n} process{'es' if n > 1 else ''} reclaimed (pid{'s' if n > 1 else ''} {pids}) hold{'s' if n == 1 else ''} no GPU memory"


async def _still_held(sup: Supervisor, result: StopResult, chosen: list[Leftover], host: str) -> None:
    """After the stop: what was not stopped and still holds memory, of the same run(s) or on the GPUs the stopped
    processes held (and memory no visible process explains there), into ``result`` and its GPU note."""
    runs = {lo.run_id for lo in chosen if lo.run_id}
    gpus_held = {g for lo in chosen for g in lo.gpu_bytes}
    chosen_pids = {lo.pid for lo in chosen}

    def look() -> list[Gpu]:
        sup.procs.refresh(True)
        return sup.attributed_gpus()

    after = await asyncio.to_thread(look)
    owners = await run_processes(sup, include_live=True)
    others: list[GpuProcess] = []
    for g in after:
        for p in g.processes:
            if p.pid in chosen_pids:
                continue  # a stopped process still holding is the verification's (still_on_gpu), not this list's
            rid = p.run_id or (owners[p.pid][0] if p.pid in owners else None)
            if (rid is not None and rid in runs) or p.gpu in gpus_held:
                if rid is not None and p.run_id is None:  # an untagged member, placed as a stop would place it
                    p.run_id = rid
                    if p.attribution == "FOREIGN":
                        p.attribution = "RUN" if sup.run_state(rid) in ("starting", "running", "stopping") else "STALE"
                others.append(p)
    result.still_held = others
    result.unaccounted = [u for u in unaccounted.holders(after, pid_namespace.current(), sup.gpus.simulated) if u.gpu in gpus_held]
    words = [
        f"pid {p.pid} ({'run ' + p.run_id if p.run_id else p.attribution.lower().replace('_', ' ')}) "
        f"{(p.used_bytes or 0) / 2**30:.1f} GiB on GPU {p.gpu}"
        + (f" (`gpudeck reclaim {host}:{p.pid}`)" if p.attribution in ("STALE", "FOREIGN") else "")
        for p in others[:16]
    ]
    words += [f"GPU {u.gpu}: {u.used_bytes / 2**30:.1f} GiB held by no process visible here" for u in result.unaccounted]
    if words:
        result.gpu_note += "; still held, not stopped by this reclaim: " + ", ".join(words)
    elif runs:
        result.gpu_note += f"; no other process of run {', '.join(sorted(runs))} holds GPU memory"
