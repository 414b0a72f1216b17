"""The agent supervising a real torchrun job of gpudeck.trainers.fsdp_lm (CPU, gloo): ranks, telemetry, verified stop."""

from __future__ import annotations

from pathlib import Path

from gpudeck.agents.observe.procs import alive
from tests.agent_harness import ROOT, AgentProc, wait_for
from tests.trainer_harness import fsdp_endless_argv


def test_torchrun_job_is_supervised_end_to_end(agent: AgentProc, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = fsdp_endless_argv(out, 2, "--checkpoint-every", "1000", "--log-every", "1")
    rid = agent.cli_json("launch", "--name", "fsdp-tiny", "--cwd", str(ROOT), "--", *argv)["id"]

    def running_ranks() -> dict | None:
        run = next((r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid), None)
        if run is None:
            return None
        ranks = {m.get("rank") for m in run["members"] if m.get("rank") is not None}
        tel = run.get("telemetry") or {}
        return run if ranks >= {0, 1} and (tel.get("step") or 0) >= 3 else None

    run = wait_for(running_ranks, timeout=120, what="both ranks found by tag and steps in telemetry")
    tel = run["telemetry"]
    # failure 7's raw material: what the trainer claims about itself, per rank
    assert tel["world_size"] == 2 and tel["params_total"] > 0 and tel["loss"] > 0
    assert {r["rank"] for r in tel["ranks"].values()} == {0, 1}
    members = run["members"]
    workers = [m for m in members if m.get("rank") is not None]

    res = agent.cli_json("stop", rid, "--grace", "60")
    assert res["state"] == "stopped" and not res.get("survivors")
    assert not res.get("needed_kill"), "the trainer should finish its checkpoint within the grace period"
    for m in members:
        assert not alive(m["pid"], m["create_time"]), m
    final = next(r for r in agent.cli_json("runs") if r["id"] == rid)
    assert final["cause"].startswith("stopped by operator")
    # SIGTERM gave the trainer its checkpoint: a later --resume has somewhere to start
    assert any((out / "checkpoints").glob("step_*")), "no checkpoint written on SIGTERM"
    assert len(workers) == 2
    # torchrun's own logs are the run's, in its folder, not a /tmp/torchelastic_* folder left behind
    attempts = list(Path(final["run_dir"], "torchelastic").glob("*/attempt_*"))
    assert attempts, f"no torchrun attempt folder in {final['run_dir']}/torchelastic"
