"""Provides the launch of a run: pre-flight, the record on disk, the group, the spawn through the shim.

The spec is validated and its argv read once (:class:`~gpudeck.agents.runs.launcher.LaunchPlan`);
pre-flight, the memory estimate and the environment's fingerprint all use that one
reading. The run is recorded before anything starts, so a failed start is never
unrecorded; a failed pre-flight starts nothing and is recorded as ``preflight_failed``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.observe.procs import create_time_of
from gpudeck.agents.runs import states
from gpudeck.agents.runs.launcher import LaunchPlan, check_executable, fsync_write
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety import envs
from gpudeck.agents.safety.containment import RunGroup
from gpudeck.agents.safety.estimate import estimate_or_reason
from gpudeck.agents.safety.preflight import failure_summary, run_preflight
from gpudeck.agents.wire import paths
from gpudeck.agents.wire.errors import AgentError, BadRequest, LaunchFailed, StorageError
from gpudeck.agents.wire.protocol import EnvFingerprint, LaunchSpec, Member, PreflightResult, RunInfo, new_run_id

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor


async def preflight(sup: Supervisor, spec: LaunchSpec, host_name: str | None = None, plan: LaunchPlan | None = None) -> PreflightResult:
    """Every pre-flight check of ``spec`` here; nothing is started. ``host_name``: what the client calls this host."""
    plan = plan or LaunchPlan.of(spec)
    gpus = await asyncio.to_thread(sup.attributed_gpus) if sup.gpus.available else []  # 500 holders are read off the loop
    ended: dict[str, RunInfo] = {}
    for g in gpus:
        for p in g.processes:
            if p.run_id and p.run_id not in ended:
                r = sup.journal.get_run(p.run_id)
                if r is not None:
                    ended[p.run_id] = r
    run_env = plan.base_env
    est, why = await asyncio.to_thread(estimate_or_reason, spec, None, plan.parsed)
    return await asyncio.to_thread(
        run_preflight,
        spec,
        host=host_name or sup.host,
        gpus=gpus,
        gpu_error=sup.gpus.error,
        ended=ended,
        estimate=est,
        estimate_error=why,
        python_check=lambda py: envs.check_imports_torch(py, env=run_env),
        parsed=plan.preflight_argv,
    )


def fingerprint_for(sup: Supervisor, spec: LaunchSpec, plan: LaunchPlan | None = None) -> EnvFingerprint | None:
    """The run's python environment, fingerprinted (None when the run is not a python program)."""
    python = (plan or LaunchPlan.of(spec)).python
    if python is None:
        return None
    try:
        return envs.fingerprint(python, driver=sup.gpus.driver_version)
    except AgentError as exc:
        return EnvFingerprint(python=python, error=exc.message, taken=time.time())


async def launch(sup: Supervisor, spec: LaunchSpec, request_id: str = "", host_name: str | None = None) -> tuple[RunInfo, bool]:
    """Pre-flight, then start a run; returns (run, duplicate). A known request_id returns its first run.

    A failed pre-flight starts nothing; the run is recorded as ``preflight_failed`` with the reasons.
    """
    plan = LaunchPlan.of(spec)  # validated, its argv parsed and its environment built: once
    async with sup.launch_lock:
        if request_id:
            earlier = sup.journal.run_by_request(request_id)
            if earlier is not None:
                return sup.with_containment(earlier), True
        if spec.run_id is not None and sup.journal.get_run(spec.run_id) is not None:
            raise BadRequest(f"run {spec.run_id} already exists on {sup.host}")
        pf = await preflight(sup, spec, host_name, plan)
        if not pf.ok:
            return await record_preflight_failed(sup, spec, request_id, pf), False
        env = await asyncio.to_thread(fingerprint_for, sup, spec, plan)
        return await launch_new(sup, plan, request_id, pf, env)


def _record(sup: Supervisor, spec: LaunchSpec, request_id: str, state: str, now: float, **fields: object) -> RunInfo:
    """A new run's record (not yet journaled)."""
    return RunInfo(
        id=spec.run_id or new_run_id(),
        host=sup.host,
        state=state,  # type: ignore[arg-type]
        spec=spec,
        name=spec.name,
        created=now,
        request_id=request_id or None,
        **fields,  # type: ignore[arg-type]
    )


async def record_preflight_failed(sup: Supervisor, spec: LaunchSpec, request_id: str, pf: PreflightResult) -> RunInfo:
    now = time.time()
    cause = failure_summary(pf)
    run = _record(sup, spec, request_id, "preflight_failed", now, cause=cause, ended=now, preflight=pf)
    await sup.runs.create(run, states.PREFLIGHT_REFUSED)  # on disk before the reply; the loop never waits on the disk
    sup.runs.emit_many(
        [
            ("preflight", run.id, {"result": msgspec.to_builtins(pf)}),
            (
                "run_state",
                run.id,
                {
                    "state": "preflight_failed",
                    "cause": cause,
                    "ended": now,
                    "cause_class": "preflight",
                    "evidence": states.PREFLIGHT_REFUSED,
                },
            ),
        ],
        f"run {run.id}'s pre-flight failure",
    )
    return run


async def launch_new(
    sup: Supervisor, plan: LaunchPlan, request_id: str, pf: PreflightResult | None = None, env_fp: EnvFingerprint | None = None
) -> tuple[RunInfo, bool]:
    spec = plan.spec
    run = _record(sup, spec, request_id, "starting", time.time(), preflight=pf, env=env_fp)
    run_id = run.id
    run_dir = sup.runs_dir / run_id
    run.run_dir = str(run_dir)
    try:
        if os.path.lexists(run_dir):
            raise FileExistsError(errno.EEXIST, "a run folder of that id exists already", str(run_dir))
        paths.ensure_private_dir(run_dir)  # 0700 whatever the umask: spec.json holds the run's --env values
        fsync_write(run_dir / "spec.json", msgspec.json.encode(spec))
    except FileExistsError as exc:  # not removed: it is another run's folder (a reused --run-id, or a node launched twice here)
        raise StorageError(
            f"the run folder {run_dir} exists already: run {run_id} was launched on this host before; "
            "launch again without a fixed run id (a new one is drawn), or remove the folder if that run is gone; nothing was started"
        ) from exc
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise StorageError(
            f"cannot create the run folder {run_dir} ({exc.strerror}): free space or fix permissions in {sup.runs_dir}; nothing was started"
        ) from exc
    # the record exists before anything starts: a failed start is never unrecorded
    try:
        await sup.runs.create(run, states.LAUNCHED)  # on disk before anything starts; the loop keeps serving meanwhile
    except StorageError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise StorageError(f"{exc.message}; nothing was started") from exc
    lr = sup.runs.add(LiveRun(info=run, launching=True))
    try:
        return await start_recorded(sup, lr, plan, run_dir, pf, env_fp)
    finally:
        lr.launching = False


async def start_recorded(
    sup: Supervisor, lr: LiveRun, plan: LaunchPlan, run_dir: Path, pf: PreflightResult | None, env_fp: EnvFingerprint | None
) -> tuple[RunInfo, bool]:
    run = lr.info
    run_id = run.id
    spec = plan.spec
    group: RunGroup | None = None
    problem: str | None  # why the launch cannot go on, or None
    if sup.containment.has_groups:
        try:
            group = sup.containment.create(run_id)
        except OSError as exc:
            problem = f"cannot create the run's cgroup under {getattr(sup.containment, 'base', '?')} ({exc.strerror}); set GPUDECK_CONTAINMENT=tag to run without one"
            fail_launch(sup, run, problem)
            raise LaunchFailed(f"{problem}; run {run_id} is recorded as failed") from exc
    lr.group = group
    run.containment = sup.containment_info(group)
    extra: list[tuple[str, str | None, dict]] = [("containment", run_id, {"containment": msgspec.to_builtins(run.containment)})]
    if pf is not None:
        extra.append(("preflight", run_id, {"result": msgspec.to_builtins(pf)}))
    if env_fp is not None:
        extra.append(("env_fingerprint", run_id, {"env": msgspec.to_builtins(env_fp)}))
    sup.runs.emit_many(extra, f"run {run_id}'s containment/pre-flight/environment records")

    env = plan.run_env(run_id, run_dir)
    # a cwd on a hung NFS/FUSE mount must not freeze the agent: the checks run off the event loop
    try:
        problem = await asyncio.wait_for(asyncio.to_thread(check_executable, spec, env, sup.host), 20.0)
    except TimeoutError:
        problem = f"checking the working directory {spec.cwd} and {spec.argv[0]!r} did not return within 20 s (a hung file system?)"
    if problem is not None:
        fail_launch(sup, run, problem)
        raise LaunchFailed(f"{problem}; run {run_id} is recorded as failed")
    try:
        pid, shim = await asyncio.to_thread(sup.spawn_shim, run, env)
    except LaunchFailed as exc:
        fail_launch(sup, run, exc.message)
        raise LaunchFailed(f"{exc.message}; run {run_id} is recorded as failed") from exc
    lr.shim = shim
    now = time.time()
    members = [Member(pid=shim.pid, create_time=create_time_of(shim.pid) or 0.0, role="shim", first_seen=now, cmdline=["gpudeck-shim"])]
    leader_ct = create_time_of(pid)
    if leader_ct is not None:
        members.append(
            Member(
                pid=pid,
                create_time=leader_ct,
                role="leader",
                first_seen=now,
                cmdline=list(spec.argv),
                found_by="cgroup" if group else "tag",
            )
        )
    sup.runs.transition(run, "running", states.SPAWNED, {"pid": pid}, started=time.time(), members=members)
    return run, False


def fail_launch(sup: Supervisor, run: RunInfo, cause: str) -> None:
    why = f"launch failed: {cause}"
    sup.runs.transition(run, "failed", states.LAUNCH_ERROR, {"cause": why}, cause=why, ended=time.time())
