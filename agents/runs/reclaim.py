"""Provides reclaim: the leftovers of ended runs (and GPU holders of no run) listed, and exactly the chosen ones stopped.

A leftover is found by its group where the run had one (anything still in an
ended run's cgroup, whatever its environment says), else by its tag or as a GPU
holder of no run (:mod:`gpudeck.agents.safety.leftovers`). A live run's process is
reclaimed only when asked; the stop is the stop sequence's (:mod:`gpudeck.agents.runs.stop`), verified through NVML.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.observe.procs import CT_TOLERANCE, alive, read_stat
from gpudeck.agents.runs import stop, tick
from gpudeck.agents.safety.leftovers import find_leftovers
from gpudeck.agents.wire.errors import BadRequest, StorageError
from gpudeck.agents.wire.protocol import Leftover, Member, StoppedProcess, StopResult

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor

log = logging.getLogger("gpudeck.agent")
SIGNAL_PROOF = ("zombie", "disk_sleep", "no_such_process")  # leftover kinds whose note says what ends them instead


def grouped_leftovers(sup: Supervisor) -> dict[int, str]:
    """pid -> run id for every process in the group of an ended run (a leftover whatever its environment says)."""
    out: dict[int, str] = {}
    groups = dict(sup.containment.groups())
    groups.update(sup.runs.ended_groups())
    for rid, group in groups.items():
        if sup.runs.get(rid) is not None:
            continue
        state = sup.run_state(rid)
        if state is None:
            continue  # an unknown group: reported at adoption, not offered
        for pid in group.pids():
            out[pid] = rid
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
        grouped=grouped_leftovers(sup),
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
            targets.append(Member(pid=lo.pid, create_time=lo.create_time, role="leftover", rank=lo.rank, cmdline=lo.cmdline[:12]))
    live = [m for m in targets if alive(m.pid, m.create_time)]
    gpu_before = await asyncio.to_thread(sup.gpus.memory_used) if sup.gpus.available else {}
    t = await stop.terminate(live, grace_s, poll=lambda: tick.poll_shims(sup))
    stop.classify(result, targets, t)
    for lo in unsignalable:
        result.survivors.append(StoppedProcess(pid=lo.pid, cmdline=lo.cmdline, role="leftover", how="survived", status="no such process"))
    await stop.verify_gpu(sup.gpus, result, targets + [Member(pid=lo.pid, create_time=0.0) for lo in unsignalable], gpu_before)
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
