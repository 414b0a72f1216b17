"""The agent on a real GPU: memory attribution, verified stop, and the orphan of failure 2 (real NVML)."""

from __future__ import annotations

import os
import signal
import sys

from tests.agent_harness import AgentProc, wait_for

HOLD = (
    "import sys, time, torch\n"
    "gib = float(sys.argv[1])\n"
    "x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device='cuda')\n"
    "x.fill_(1); torch.cuda.synchronize()\n"
    "print('holding', gib, 'GiB', flush=True)\n"
    "time.sleep(900)\n"
)

# a leader that starts a worker in its own session (as torchrun does), then waits
PARENT = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True)\n"
    "time.sleep(900)\n"
)


def gpu_procs(agent: AgentProc, run_id: str) -> list[dict]:
    snap = agent.cli_json("status", "--host", "local")
    return [p for g in snap["gpus"] for p in g.get("processes", []) if p.get("run_id") == run_id]


def test_holder_is_attributed_and_stop_frees_it(agent: AgentProc) -> None:
    rid = agent.cli_json("launch", "--gpus", "0", "--name", "holder", "--", sys.executable, "-c", HOLD, "3")["id"]
    procs = wait_for(
        lambda: [p for p in gpu_procs(agent, rid) if (p.get("used_bytes") or 0) >= 3 * 2**30], timeout=120, what="the holder on the GPU"
    )
    p = procs[0]
    assert p["attribution"] == "RUN" and p["gpu"] == 0
    print(f"\nstatus: pid {p['pid']} holds {p['used_bytes'] / 2**30:.2f} GiB on GPU 0, attributed {p['attribution']} {rid}")
    res = agent.cli_json("stop", rid, "--grace", "10")
    print(f"stop: verified={res['gpu_verified']} freed={res['freed_bytes'] / 2**30:.2f} GiB note={res['gpu_note']!r}")
    assert res["gpu_verified"] is True
    assert res["freed_bytes"] >= 2.9 * 2**30
    assert not gpu_procs(agent, rid)


def test_orphan_of_a_killed_leader_is_stale_then_reclaimed(agent: AgentProc) -> None:
    rid = agent.cli_json("launch", "--gpus", "0", "--", sys.executable, "-c", PARENT, HOLD, "2")["id"]
    wait_for(
        lambda: [p for p in gpu_procs(agent, rid) if (p.get("used_bytes") or 0) >= 2 * 2**30], timeout=120, what="the worker on the GPU"
    )
    runs = agent.cli_json("status", "--host", "local")["runs"]
    leader = next(m for r in runs if r["id"] == rid for m in r["members"] if m["role"] == "leader")
    os.kill(leader["pid"], signal.SIGKILL)  # the leader dies alone, like a SIGKILLed torchrun
    wait_for(lambda: next(r for r in agent.cli_json("runs") if r["id"] == rid)["state"] == "failed", what="the run to be failed")
    stale = gpu_procs(agent, rid)
    assert stale and all(p["attribution"] == "STALE" for p in stale), stale
    print(f"\norphan: pid {stale[0]['pid']} still holds {stale[0]['used_bytes'] / 2**30:.2f} GiB, attributed STALE to ended run {rid}")
    res = agent.cli_json("stop", rid, "--grace", "5")
    print(f"reclaim: verified={res['gpu_verified']} freed={res['freed_bytes'] / 2**30:.2f} GiB; {res['message']}")
    assert res["gpu_verified"] and res["freed_bytes"] >= 1.9 * 2**30
    assert not gpu_procs(agent, rid)
