"""The agent reads run telemetry: live figures in snapshots, records journaled exactly once across restarts."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from tests.agent_harness import ROOT, AgentProc, run_state, wait_for

PROG = Path(__file__).parent / "progs" / "telemetry_writer.py"


def telemetry_events(agent: AgentProc, rid: str) -> list[dict]:
    import json

    db = sqlite3.connect(agent.state_dir / "journal.db")
    try:
        rows = db.execute("SELECT data FROM events WHERE run_id=? AND kind='telemetry' ORDER BY seq", (rid,)).fetchall()
    finally:
        db.close()
    return [json.loads(r[0])["record"] for r in rows]


def test_telemetry_is_live_and_journaled_once(agent: AgentProc, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    rid = agent.cli_json("launch", "--", sys.executable, str(PROG), str(ROOT), str(gate))["id"]
    wait_for(lambda: Path(str(gate) + ".ready").exists(), what="the first records")

    def live_tel() -> dict | None:
        run = next((r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid), None)
        tel = (run or {}).get("telemetry") or {}
        return tel if tel.get("step") == 5 else None

    tel = wait_for(live_tel, what="step 5 in the snapshot")
    assert tel["loss"] == 2.0 and tel["tokens_per_s"] == 5000.0
    assert tel["params_total"] == 771_000_000 and tel["world_size"] == 1 and tel["last_checkpoint"] == 5
    assert tel["ranks"]["0"]["device"] == "cpu"

    agent.kill9()  # records already journaled must not be journaled again
    agent.start()
    gate.touch()
    wait_for(lambda: run_state(agent, rid) == "succeeded", what="the run to finish")
    kinds = [r["type"] for r in telemetry_events(agent, rid)]
    assert kinds.count("manifest") == 1
    assert kinds.count("checkpoint") == 1
    assert kinds.count("done") == 1
    # a run's first 100 steps are all journaled (its figures are over every step, not its warm-up and last one); the
    # rate limit (one per 10 s, plus the held ones below) starts after them
    assert kinds.count("step") == 8
    assert "heartbeat" not in kinds
    records = telemetry_events(agent, rid)
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert steps == sorted(set(steps)) and steps[0] == 1
    # the step a later record follows is journaled before it, and the last step before the run ends: the history's
    # figures as of the checkpoint and at the end are the run's, not those of up to 10 s before
    assert records[kinds.index("checkpoint") - 1] == {**records[kinds.index("checkpoint") - 1], "type": "step", "step": 5}
    assert records[kinds.index("done") - 1]["step"] == 8 and steps[-1] == 8


def test_a_stopped_run_records_its_last_step_not_the_last_journaled_one(agent: AgentProc, tmp_path: Path) -> None:
    """After a run's first 100 steps, steps reach the journal at most once in 10 s; a run stopped 1 s after its last
    journaled step still has its last step and loss in the record (found by hand: the history said step 241 of a run
    stopped at step 275)."""
    script = tmp_path / "steps.py"
    script.write_text(
        "import json, os, time\n"
        "tel = open(os.environ['GPUDECK_TELEMETRY'], 'a', buffering=1)\n"
        "for step in range(1, 100000):\n"
        "    tel.write(json.dumps({'type': 'step', 'step': step, 'loss': 1000.0 / step}) + '\\n')\n"
        "    print('step', step, flush=True)\n"
        "    time.sleep(0.02)\n"
    )
    rid = agent.cli_json("launch", "--", sys.executable, str(script))["id"]
    tel = agent.state_dir / "runs" / rid / "telemetry.jsonl"
    wait_for(lambda: tel.exists() and tel.read_text().count("\n") >= 160, what="160 steps")
    agent.cli("stop", rid, "--grace", "5")
    wait_for(lambda: run_state(agent, rid) == "stopped", what="the stop")
    written = [json.loads(line) for line in tel.read_text().splitlines()]
    steps = [r for r in telemetry_events(agent, rid) if r["type"] == "step"]
    assert [r["step"] for r in steps[:100]] == list(range(1, 101))  # the first 100: every one
    assert len(steps) <= 100 + 3 and steps[-1]["step"] == written[-1]["step"] > 160  # then one per 10 s, and the last
    assert steps[-1]["loss"] == written[-1]["loss"]


def test_metrics_series_for_a_finished_run(agent: AgentProc, tmp_path: Path) -> None:
    import asyncio

    from gpudeck.agents.wire.protocol import GetMetrics, Metrics

    gate = tmp_path / "go"
    gate.touch()  # no pause: the writer runs straight through
    rid = agent.cli_json("launch", "--", sys.executable, str(PROG), str(ROOT), str(gate))["id"]
    wait_for(lambda: run_state(agent, rid) == "succeeded", what="the run to finish")

    async def fetch(points: int) -> Metrics:
        c = await agent.client()
        try:
            m = await c.request(GetMetrics(run_id=rid, max_points=points))
        finally:
            await c.close()
        assert isinstance(m, Metrics)
        return m

    m = asyncio.run(fetch(100))
    assert m.steps == list(range(1, 9)) and m.total_steps == 8
    assert m.loss[0] == 10.0 and m.loss[-1] == 10.0 / 8 and m.tokens_per_s[-1] == 8000.0
    thin = asyncio.run(fetch(3))
    assert thin.steps[0] == 1 and thin.steps[-1] == 8 and len(thin.steps) == 3 and thin.total_steps == 8
    # the history's figure is the median over every step of this short run (1,000 .. 8,000 tokens/s), not over its
    # first (warm-up) and last step alone (found in a tmux walk: two 20-step runs compared the wrong way round)
    shown = json.loads(agent.cli("show", rid, "--json").stdout)
    recorded = [e for e in shown["events"] if e["kind"] == "telemetry" and e["data"]["record"]["type"] == "step"]
    assert len(recorded) == 8
    assert shown["figures"]["tokens_per_s"] == 4500.0


def test_hostile_telemetry_lines_are_rejected_one_by_one_and_supervision_goes_on(agent: AgentProc, tmp_path: Path) -> None:
    """Deep nesting, 2**64, 5000-digit numbers, invalid UTF-8 and 1e999 in a run's telemetry: each line is refused
    by itself, the good lines around them are read, another run is supervised meanwhile, and the agent restarts."""
    gate = tmp_path / "go"
    hostile = agent.cli_json(
        "launch", "--name", "hostile", "--", sys.executable, str(Path(__file__).parent / "progs" / "hostile_telemetry.py"), str(gate)
    )["id"]
    wait_for(lambda: Path(str(gate) + ".ready").exists(), timeout=60, what="the hostile lines")

    def live() -> dict | None:
        run = next((r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == hostile), None)
        tel = (run or {}).get("telemetry") or {}
        return tel if tel.get("step") == 3 and tel.get("bad_lines") == 6 else None

    tel = wait_for(live, timeout=60, what="step 3 and 6 rejected lines in the snapshot")
    assert tel["loss"] == 2.0
    other = agent.cli_json("launch", "--", sys.executable, "-c", "print('fine')")["id"]
    wait_for(
        lambda: next(r for r in agent.cli_json("runs") if r["id"] == other)["state"] == "succeeded",
        timeout=60,
        what="another run to be supervised to its end",
    )
    agent.kill9()
    agent.start()  # the file is still there: the agent starts and reads it again
    gate.touch()
    wait_for(
        lambda: next(r for r in agent.cli_json("runs") if r["id"] == hostile)["state"] == "succeeded",
        timeout=60,
        what="the hostile run to end",
    )
    kinds = [r["type"] for r in telemetry_events(agent, hostile)]
    assert kinds.count("manifest") == 0 and "error" not in kinds and "eval" not in kinds, kinds
