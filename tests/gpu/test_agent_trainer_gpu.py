"""A real fsdp_lm run on the GPU under the agent: attributed memory, claims vs observed raw data, verified stop."""

from __future__ import annotations

from pathlib import Path

from tests.agent_harness import ROOT, AgentProc, wait_for
from tests.trainer_harness import fsdp_lm_argv


def test_trainer_on_gpu_is_attributed_and_stop_frees_its_memory(agent: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = fsdp_lm_argv(out, "--checkpoint-every", "100000", "--log-every", "1", batch_size=8, seq_len=256, corpus_bytes=2_000_000)
    rid = agent.cli_json("launch", "--gpus", "0", "--name", "gpu-tiny", "--cwd", str(ROOT), "--", *argv)["id"]

    def ready() -> dict | None:
        snap = agent.cli_json("status", "--host", "local")
        run = next((r for r in snap["runs"] if r["id"] == rid), None)
        procs = [p for g in snap["gpus"] for p in g.get("processes", []) if p.get("run_id") == rid]
        if run and procs and ((run.get("telemetry") or {}).get("step") or 0) >= 5:
            return {"snap": snap, "run": run, "procs": procs}
        return None

    got = wait_for(ready, timeout=180, what="the trainer on GPU 0 with steps in telemetry")
    snap, run, procs = got["snap"], got["run"], got["procs"]
    tel = run["telemetry"]
    rank0 = tel["ranks"]["0"]
    # what the trainer claims (its manifest) and what NVML observes agree: same GPU, same pid
    assert rank0["device"] == "cuda:0"
    assert rank0["gpu_uuid"] == snap["gpus"][0]["uuid"], (rank0, snap["gpus"][0]["uuid"])
    assert procs[0]["attribution"] == "RUN" and procs[0]["gpu"] == 0
    held = sum(p.get("used_bytes") or 0 for p in procs)
    print(
        f"\ntrainer pid {procs[0]['pid']} holds {held / 2**30:.2f} GiB on GPU 0 ({rank0['gpu_uuid']}); "
        f"step {tel['step']} loss {tel['loss']:.4f} {tel['tokens_per_s']:,.0f} tok/s; world size {tel['world_size']}, {tel['params_total']:,} params"
    )
    res = agent.cli_json("stop", rid, "--grace", "60")
    print(f"stop: {res['message']}")
    assert res["gpu_verified"] and res["freed_bytes"] >= 0.9 * held
    assert not res.get("needed_kill") and not res.get("survivors")
    assert any((out / "checkpoints").glob("step_*")), "SIGTERM should have left a checkpoint"
