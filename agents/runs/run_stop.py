"""Provides the stop of one run: the stopper's sequence (:mod:`gpudeck.agents.runs.stopper`) applied to a run, its end journaled.

A live run is stopped and recorded as ``stopped`` with what it took (SIGKILLs,
survivors, the GPU memory freed); an ended run's leftovers are stopped and the
stop recorded as ``reclaimed``. Concurrent stops of one run share one result; a
stop an earlier agent began is finished with the grace already spent counted.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.health import claims
from gpudeck.agents.observe.procs import alive, signal_exact
from gpudeck.agents.runs import adoption, states, stopper, telemetry_fold, tick
from gpudeck.agents.runs.exit_cause import read_exit_record
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety.containment import RunGroup, put_figures
from gpudeck.agents.safety.membership import discover, proc_tree
from gpudeck.agents.wire.errors import BadRequest
from gpudeck.agents.wire.protocol import TERMINAL_STATES, Member, RunInfo, StopResult

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor

TAG_LIMIT = (
    "at the tag + ancestry level a process that cleared its environment and left the run's process tree, "
    "session and process group cannot be found; a cgroup (root, or a delegated cgroup v2 subtree) closes that gap"
)


async def stop(sup: Supervisor, ref: str, grace_s: float = 30.0, reason: str = "stopped by operator") -> StopResult:
    """Stop one run entirely and verify; concurrent stops of the same run share one result."""
    if grace_s < 0 or grace_s > 3600:
        raise BadRequest(f"grace {grace_s} s is out of range: give 0 to 3600 seconds")
    run = sup.resolve(ref)
    task = sup.runs.stop_once(run.id, lambda: stop_run(sup, run, grace_s, reason))
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
    d = await asyncio.to_thread(discover, run, sup.procs, group, tree, sup.uid)
    run.members = [d.replaces.get(id(m), m) for m in run.members] + d.new
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
    if lr is not None and lr.resume_stop_started is not None:
        spent = max(0.0, time.time() - lr.resume_stop_started)
        stop_started = lr.resume_stop_started
        grace_left = max(0.0, grace_s - spent)
        result.resumed_after_s = round(spent, 3)
        lr.resume_stop_started = None
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

    t = await stopper.terminate(live, grace_left, group=group, rescan=rescan if group is None else None, poll=lambda: tick.poll_shims(sup))
    # the shim exits by itself once its child is gone; make sure it did
    if shim_m is not None:
        shim_list = [shim_m] if alive(shim_m.pid, shim_m.create_time) else []
        if shim_list and not await stopper.wait_gone(shim_list, 2.0, None):
            signal_exact(shim_m.pid, shim_m.create_time, signal.SIGKILL)
            await stopper.wait_gone(shim_list, 2.0, None)
        if lr is not None and lr.shim is not None:
            await asyncio.to_thread(_reap, lr.shim, 2.0)
    await asyncio.to_thread(lambda: stopper.classify(result, targets, t, report_gone=lambda m: m.role == "leader"))
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
    await stopper.verify_gpu(sup.gpus, result, t.signalled + targets, gpu_before)
    result.seconds = round(time.monotonic() - t0, 3)

    if was_terminal:
        result.state = run.state
        result.message = (
            f"run {run.id} had already ended ({run.cause}); its {len(t.signalled)} leftover process(es) were stopped; "
            + stopper.summary(result)
        )
        if group is not None:
            sup.runs.settle_group(run.id, group)
        sup.runs.append("reclaimed", run.id, msgspec.to_builtins(result))
        return result
    assert lr is not None
    telemetry_fold.poll(sup, lr, ending=True)  # its last records and last step, before the stop is recorded
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
    claims.record(sup, lr)
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
    result.message = stopper.summary(result)
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
