"""What reclaim-and-launch would stop, from pre-flight's verdict: only stale/foreign processes of the operator; another
user's, an invisible one, or memory the reclaim cannot free refuse the whole action, each named."""

from __future__ import annotations

from gpudeck.agents.wire.protocol import Gpu, GpuProcess, PreflightCheck, PreflightResult, Snapshot
from gpudeck.console.ops.holders import holder_plan
from gpudeck.console.ops.launch import NodeOutcome

GIB = 2**30


def _holder(pid: int, attribution: str, user: str | None, gib: int, gpu: int = 0, run_id: str | None = None) -> dict:
    return {"pid": pid, "gpu": gpu, "attribution": attribution, "user": user, "used_bytes": gib * GIB, "run_id": run_id, "cmdline": ["x"]}


def _outcome(holders: list[dict], memory: dict | None = None, other: bool = False) -> NodeOutcome:
    checks = [PreflightCheck(name="gpu_holders", ok=False, message="held", details={"holders": holders})]
    if memory is not None:
        checks.append(PreflightCheck(name="gpu_memory", ok=False, message="short", details=memory))
    if other:
        checks.append(PreflightCheck(name="python_env", ok=False, message="no torch"))
    return NodeOutcome("gpu1", preflight=PreflightResult(ok=False, host="gpu1", checks=checks))


def _snap() -> Snapshot:
    procs = [GpuProcess(pid=10, gpu=0, attribution="STALE", used_bytes=20 * GIB, create_time=1000.0)]
    return Snapshot(host="gpu1", ts=0.0, epoch="e", gpus=[Gpu(index=0, memory_used=20 * GIB, memory_total=141 * GIB, processes=procs)])


def test_stale_and_foreign_of_the_operator_go_with_their_age() -> None:
    plan = holder_plan([_outcome([_holder(10, "STALE", "op", 20, run_id="r-1"), _holder(11, "FOREIGN", "op", 5)])], {"gpu1": _snap()}, "op")
    assert plan.blocked is None and plan.pids() == {"gpu1": [10, 11]}
    stale = plan.holders[0]
    assert stale.started == 1000.0 and "run r-1" in stale.line() and "user op" in stale.line() and "GPU 0: 20.0 GiB" in stale.line()


def test_another_users_process_or_an_invisible_one_refuses_everything() -> None:
    plan = holder_plan([_outcome([_holder(10, "STALE", "op", 20), _holder(12, "FOREIGN", "bob", 5)])], {}, "op")
    assert plan.blocked is not None and "pid 12" in plan.blocked and "user bob" in plan.blocked and "--force" in plan.blocked
    assert [h.pid for h in plan.to_stop] == [10] and "REFUSED" in plan.lines()[1]
    unknown = holder_plan([_outcome([_holder(13, "FOREIGN", None, 5)])], {}, "op")
    assert unknown.blocked is not None and "another user" in unknown.blocked
    ghost = holder_plan([_outcome([_holder(14, "NO_SUCH_PROCESS", None, 5)])], {}, "op")
    assert ghost.blocked is not None and "cannot see it" in ghost.blocked


def test_memory_is_weighed_with_what_the_reclaim_frees() -> None:
    memory = {"need_bytes": 130 * GIB, "free_bytes": {"0": 121 * GIB}}
    assert holder_plan([_outcome([_holder(10, "STALE", "op", 20)], memory)], {}, "op").blocked is None
    short = holder_plan([_outcome([_holder(10, "STALE", "op", 5)], memory)], {}, "op")
    assert short.blocked is not None and "GPU 0 would have 126.0 GiB free after the reclaim" in short.blocked
    other = holder_plan([_outcome([_holder(10, "STALE", "op", 20)], other=True)], {}, "op")
    assert other.blocked is not None and "python_env: no torch" in other.blocked


def test_memory_held_by_no_visible_process_refuses_the_reclaim_before_anything_is_stopped() -> None:
    out = _outcome([_holder(10, "STALE", "op", 20)])
    assert out.preflight is not None
    out.preflight.checks[0].details["unaccounted"] = [{"gpu": 0, "used_bytes": int(7.5 * GIB)}]
    plan = holder_plan([out], {}, "op")
    assert plan.blocked is not None and "GPU 0: 7.5 GiB is held by no process visible there" in plan.blocked
    assert "cannot be reclaimed from here" in plan.blocked
