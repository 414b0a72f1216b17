"""One stop of a GPU-holding run under cgroupfs containment (real NVML): the group empties, the GiB are freed and verified.

The holder clears its environment (``env -i``) and double-forks out of the
leader's session, so only the run's cgroup says it belongs to the run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.agents.safety.containment import CgroupFs, detect
from tests.agent_harness import AgentProc, teardown_agent, wait_for

HOLD = (
    "import sys, time, torch\n"
    "x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device='cuda'); x.fill_(1)\n"
    "torch.cuda.synchronize(); print('holding', flush=True); time.sleep(900)\n"
)
# the leader double-forks a holder with an empty environment (no GPUDECK_RUN_ID, no RANK) in its own session
LEADER = (
    "import os, sys, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        env = {'PATH': os.environ['PATH'], 'CUDA_VISIBLE_DEVICES': os.environ.get('CUDA_VISIBLE_DEVICES', '0')}\n"
    "        os.execve(sys.executable, [sys.executable, '-c', sys.argv[1], sys.argv[2]], env)\n"
    "    os._exit(0)\n"
    "time.sleep(900)\n"
)


@pytest.fixture
def cg_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    probe = detect(gpudeck_home / "agent" / "runs", forced="cgroupfs")
    if not isinstance(probe, CgroupFs):
        pytest.skip(f"no cgroupfs containment here: {probe.reason}")
    monkeypatch.setenv("GPUDECK_CONTAINMENT", "cgroupfs")
    a = AgentProc(gpudeck_home).start()
    yield a
    teardown_agent(a)


def test_a_gpu_run_stopped_through_its_cgroup_frees_its_memory(cg_agent: AgentProc) -> None:
    a = cg_agent
    gib = 8.0
    rid = a.cli_json("launch", "--gpus", "0", "--name", "contained", "--", sys.executable, "-c", LEADER, HOLD, str(gib))["id"]

    def holders() -> list[dict]:
        snap = a.cli_json("status", "--host", "local")
        run = next(r for r in snap["runs"] if r["id"] == rid)
        members = {m["pid"] for m in run["members"] if m.get("found_by") == "cgroup" and m.get("tagged") is False}
        return [
            p
            for g in snap["gpus"]
            for p in g.get("processes", [])
            if p["pid"] in members and (p.get("used_bytes") or 0) >= gib * 2**30 * 0.95
        ]

    got = wait_for(holders, timeout=180, what="the env-cleared holder on GPU 0, a member of the run through its cgroup")
    run = next(r for r in a.cli_json("status", "--host", "local")["runs"] if r["id"] == rid)
    assert run["containment"]["label"] == "cgroup (cgroupfs)" and got[0]["pid"] in run["containment"]["untagged"]
    res = a.cli_json("stop", rid, "--grace", "10")
    print(
        f"\ncgroupfs stop of a GPU run: verified={res['gpu_verified']} freed={res['freed_bytes'] / 2**30:.2f} GiB in {res['seconds']:.2f} s; "
        f"{res['group_note']}; {res['gpu_note']}"
    )
    assert res["gpu_verified"] is True and not res.get("survivors")
    assert res["freed_bytes"] >= gib * 2**30 * 0.95
    assert "emptied (populated 0)" in res["group_note"]
    assert not Path(run["containment"]["group"]).exists()
