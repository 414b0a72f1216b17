"""A GPU-holding run whose shim is SIGKILLed stays live, and `stop` frees its memory (real NVML).

On the H200 this once left rank 0 filling the GPU after the run was recorded ``failed``: the run's life is now
judged by its group (or its members), not by the shim. Runs at the level the host gives (cgroupfs where the
agent may create groups, else tag + ancestry).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.agent_harness import AgentProc, wait_for

HOLD = (
    "import sys, time, torch\n"
    "x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device='cuda'); x.fill_(1)\n"
    "torch.cuda.synchronize(); print('holding', flush=True); time.sleep(900)\n"
)


def _run(a: AgentProc, rid: str) -> dict | None:
    return next((r for r in a.cli_json("status", "--host", "local")["runs"] if r["id"] == rid), None)


def _held(a: AgentProc, rid: str, pid: int) -> int:
    snap = a.cli_json("status", "--host", "local")
    return sum(p.get("used_bytes") or 0 for g in snap["gpus"] for p in g.get("processes", []) if p["pid"] == pid)


def test_a_gpu_run_whose_shim_is_killed_stays_live_and_stop_frees_its_memory(agent: AgentProc) -> None:
    gib = 8.0
    rid = agent.cli_json("launch", "--gpus", "0", "--name", "shimless", "--", sys.executable, "-c", HOLD, str(gib))["id"]
    run = wait_for(lambda: _run(agent, rid), what="the run")
    leader = next(m for m in run["members"] if m.get("role") == "leader")
    shim = next(m for m in run["members"] if m.get("role") == "shim")
    wait_for(lambda: _held(agent, rid, leader["pid"]) >= gib * 2**30 * 0.95, timeout=180, what="the run to hold its GiB on GPU 0")
    os.kill(shim["pid"], signal.SIGKILL)
    time.sleep(5)  # several ticks: the run is still live, its memory still held by its (live) leader
    run = _run(agent, rid)
    assert run is not None and run["state"] == "running", run
    events = json.loads(agent.cli("show", rid, "--json").stdout)["events"]
    assert any(e["kind"] == "shim_lost" and "killed (SIGKILL)" in e["data"]["note"] for e in events)
    assert _held(agent, rid, leader["pid"]) >= gib * 2**30 * 0.95
    res = agent.cli_json("stop", rid, "--grace", "10")
    print(
        f"\nstop of a GPU run whose shim was killed: verified={res['gpu_verified']} freed={res['freed_bytes'] / 2**30:.2f} GiB "
        f"in {res['seconds']:.2f} s; {res['group_note']}; {res['gpu_note']}"
    )
    assert res["state"] == "stopped" and res["gpu_verified"] is True and not res.get("survivors")
    assert res["freed_bytes"] >= gib * 2**30 * 0.95
    row = next(r for r in agent.cli_json("runs") if r["id"] == rid)
    assert row["state"] == "stopped" and "exit status is not known" in row["cause"]
    assert not Path(f"/proc/{leader['pid']}").exists() or _held(agent, rid, leader["pid"]) == 0
