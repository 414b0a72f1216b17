"""The failures of ARCHITECTURE.md on a real GPU (real NVML): pre-flight against a real holder, reclaim, claims, CUDA OOM, orphaned torchrun workers."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.agent_harness import ROOT, AgentProc, wait_for
from tests.gpu.test_agent_gpu import HOLD, PARENT, gpu_procs


def _run(agent: AgentProc, rid: str) -> dict:
    return next(r for r in agent.cli_json("runs") if r["id"] == rid)


def test_a_20_gib_holder_blocks_a_130_gib_launch_by_name_and_reclaim_frees_it(agent: AgentProc) -> None:
    rid = agent.cli_json("launch", "--gpus", "0", "--name", "leaky", "--", sys.executable, "-c", PARENT, HOLD, "20")["id"]
    wait_for(lambda: [p for p in gpu_procs(agent, rid) if (p.get("used_bytes") or 0) >= 20 * 2**30], timeout=180, what="20 GiB on the GPU")
    leader = next(
        m for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid for m in r["members"] if m["role"] == "leader"
    )
    os.kill(leader["pid"], signal.SIGKILL)
    wait_for(lambda: _run(agent, rid)["state"] == "failed", what="the leaky run to end")
    holder = gpu_procs(agent, rid)[0]
    assert holder["attribution"] == "STALE"
    cp = agent.cli("launch", "--gpus", "0", "--need-gib", "130", "--name", "big", "--", "sleep", "30", check=False)
    print(f"\n$ gpudeck launch --gpus 0 --need-gib 130 -- sleep 30   (exit {cp.returncode})\n{cp.stderr}")
    assert cp.returncode == 1 and f"pid {holder['pid']}" in cp.stderr and rid in cp.stderr and "reclaim local:" in cp.stderr
    listing = agent.cli("reclaim", "local").stdout
    print(f"$ gpudeck reclaim local\n{listing}")
    res = json.loads(agent.cli("reclaim", f"local:{holder['pid']}", "--json").stdout)[0]
    print(f"$ gpudeck reclaim local:{holder['pid']}: {res['message']}")
    assert res["gpu_verified"] and res["freed_bytes"] >= 19.9 * 2**30
    ok = agent.cli_json("launch", "--gpus", "0", "--need-gib", "130", "--name", "big", "--", "sleep", "5")
    print(f"then: launch {ok['id']} {ok['state']}, pre-flight ok={ok['preflight']['ok']}")
    assert ok["state"] == "running" and ok["preflight"]["ok"]


def test_fsdp_lm_claimed_on_more_gpus_than_it_uses_is_flagged(agent: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "claims"
    rid = agent.cli_json(
        "launch",
        "--kind",
        "fsdp",
        "--gpus",
        "0",
        "--name",
        "tiny-4gpu",
        "--claim-gpus",
        "4",
        "--python",
        sys.executable,
        "--cwd",
        str(ROOT),
        "--fresh",
        "--",
        "--model-config",
        "tiny",
        "--out",
        str(out),
        "--max-steps",
        "100000",
        "--batch-size",
        "8",
        "--seq-len",
        "256",
        "--corpus-bytes",
        "2000000",
        "--no-export",
        "--checkpoint-every",
        "100000",
    )["id"]
    alerts = wait_for(
        lambda: [
            a
            for a in next((r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid), {}).get("alerts", [])
            if a["kind"] == "claim_mismatch"
        ],
        timeout=240,
        what="the claim alert",
    )
    print("\n" + "\n".join(f"alert: {a['message']}" for a in alerts))
    assert any("claimed 4 GPUs, observed 1: GPU 0" in a["message"] for a in alerts)
    cp = agent.cli("verify", rid, check=False)
    print(f"$ gpudeck verify {rid}   (exit {cp.returncode})\n{cp.stdout}")
    assert cp.returncode == 1 and "MISMATCH" in cp.stdout
    agent.cli("stop", rid, "--grace", "30")


def test_a_run_that_hits_cuda_oom_has_cause_oom(agent: AgentProc) -> None:
    code = "import torch; x = torch.empty(400 * 2**30, dtype=torch.uint8, device='cuda')"
    rid = agent.cli_json("launch", "--gpus", "0", "--name", "too-big", "--", sys.executable, "-c", code)["id"]
    wait_for(lambda: _run(agent, rid)["state"] == "failed", timeout=120, what="the OOM")
    row = agent.cli_json("show", rid)
    print(f"\ncause: {row['cause']}  (class {row['cause_class']})")
    assert row["cause_class"] == "oom"
    assert [r["id"] for r in agent.cli_json("history", "cause:oom")] == [rid]


def test_killing_torchrun_orphans_the_worker_on_the_gpu_and_reclaim_frees_it(agent: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "orphan"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "gpudeck.trainers.fsdp_lm",
        "--model-config",
        "llama-1b",
        "--out",
        str(out),
        "--max-steps",
        "100000",
        "--batch-size",
        "4",
        "--seq-len",
        "2048",
        "--corpus-bytes",
        "4000000",
        "--no-export",
        "--checkpoint-every",
        "100000",
        "--fresh",
    ]
    rid = agent.cli_json("launch", "--gpus", "0", "--name", "torchrun-1b", "--cwd", str(ROOT), "--", *argv)["id"]

    def training() -> dict | None:
        run = next((r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid), None)
        procs = gpu_procs(agent, rid)
        return run if run and procs and ((run.get("telemetry") or {}).get("step") or 0) >= 3 else None

    run = wait_for(training, timeout=300, what="llama-1b training under torchrun")
    leader = next(m for m in run["members"] if m["role"] == "leader")
    held = sum(p["used_bytes"] for p in gpu_procs(agent, rid))
    print(
        f"\ntorchrun pid {leader['pid']}, worker holds {held / 2**30:.1f} GiB; step {run['telemetry']['step']}, {run['telemetry']['tokens_per_s']:,.0f} tok/s"
    )
    os.kill(leader["pid"], signal.SIGKILL)
    last: dict = {}

    def ended() -> bool:
        last.clear()
        last.update(_run(agent, rid))
        return last["state"] == "failed"

    try:
        wait_for(ended, timeout=30, what="the run to end with torchrun")
    except AssertionError as exc:  # say what the agent showed instead
        members = [(m.get("pid"), m.get("role")) for m in last.get("members") or []]
        raise AssertionError(
            f"{exc}; the run last read: state {last.get('state')!r}, cause {last.get('cause')!r}, members {members}; "
            f"agent log tail: {agent.log()[-1500:]}"
        ) from None
    time.sleep(2)
    stale = gpu_procs(agent, rid)
    print(
        f"after SIGKILL of torchrun: {_run(agent, rid)['cause']}; on the GPU: "
        + ", ".join(f"pid {p['pid']} {p['attribution']} {p['used_bytes'] / 2**30:.1f} GiB" for p in stale)
    )
    assert stale and all(p["attribution"] == "STALE" for p in stale)
    print(f"$ gpudeck status --host local\n{agent.cli('status', '--host', 'local').stdout}")
    left = agent.cli_json("reclaim", "local")["leftovers"]
    pids = [lo["pid"] for lo in left if lo["run_id"] == rid]
    res = json.loads(agent.cli("reclaim", *[f"local:{p}" for p in pids], "--grace", "30", "--json").stdout)[0]
    print(f"$ gpudeck reclaim {' '.join(f'local:{p}' for p in pids)}: {res['message']}")
    assert res["gpu_verified"] and res["freed_bytes"] >= 0.9 * held
    pf = agent.cli(
        "preflight",
        "--gpus",
        "0",
        "--kind",
        "fsdp",
        "--python",
        sys.executable,
        "--cwd",
        str(ROOT),
        "--fresh",
        "--",
        "--model-config",
        "llama-1b",
        "--out",
        str(tmp_path / "next"),
        "--batch-size",
        "4",
        "--seq-len",
        "2048",
        check=False,
    )
    print(f"$ gpudeck preflight ... (exit {pf.returncode})\n{pf.stdout}")
    assert pf.returncode == 0


def test_stop_mid_training_checkpoints_then_resume_continues(agent: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "resume"
    args = [
        "--model-config",
        "llama-1b",
        "--out",
        str(out),
        "--max-steps",
        "100000",
        "--batch-size",
        "4",
        "--seq-len",
        "2048",
        "--corpus-bytes",
        "4000000",
        "--no-export",
        "--checkpoint-every",
        "100000",
    ]
    rid = agent.cli_json("launch", "--kind", "fsdp", "--gpus", "0", "--python", sys.executable, "--cwd", str(ROOT), "--fresh", "--", *args)[
        "id"
    ]
    wait_for(
        lambda: (
            (
                (next((r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid), {}).get("telemetry") or {}).get(
                    "step"
                )
                or 0
            )
            >= 5
        ),
        timeout=300,
        what="steps",
    )
    res = agent.cli_json("stop", rid, "--grace", "120")
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    print(f"\nstop: {res['message']}; checkpoints {steps}")
    assert res["gpu_verified"] and not res.get("needed_kill") and steps
    again = agent.cli_json("relaunch", rid, "--resume", str(steps[-1]))
    wait_for(
        lambda: (
            (
                (
                    next((r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == again["id"]), {}).get("telemetry")
                    or {}
                ).get("step")
                or 0
            )
            > steps[-1]
        ),
        timeout=300,
        what="resumed steps",
    )
    tel = next(r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == again["id"])["telemetry"]
    print(f"resumed {again['id']} from step {steps[-1]}: now step {tel['step']}, start {tel.get('start')!r}")
    assert tel.get("start") == f"resume {steps[-1]}"
    agent.cli("stop", again["id"], "--grace", "60")
