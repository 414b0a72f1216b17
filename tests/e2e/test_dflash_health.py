"""Failure 4 with the real trainer: a split DFlash job (2 target ranks + 1 drafter rank, gloo on CPU) under gpudeck; the drafter dies.

The multi-GPU version (target and drafter on separate H200s) needs a machine of
several GPUs; this is the same flow on CPU: the agent must raise the rank-death
alert within 10 s and name the rank, and the run's end names who died first.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.agent_harness import ROOT, AgentProc, wait_for
from tests.trainer_harness import DFLASH_SMALL, DFLASH_SPLIT

pytest.importorskip("torch")
pytestmark = pytest.mark.slow
SMALL = [
    *DFLASH_SMALL,
    "--no-eval",
    "--log-every",
    "1",
]


def test_a_dead_drafter_rank_raises_the_alert_within_10_s_and_is_named_in_the_cause(agent: AgentProc, tmp_path: Path) -> None:
    run = agent.cli_json(
        "launch",
        "--kind",
        "dflash",
        "--nproc-per-node",
        "3",
        "--python",
        sys.executable,
        "--cwd",
        str(ROOT),
        "--name",
        "split-drafter",
        "--env",
        "OMP_NUM_THREADS=1",
        "--fresh",
        "--",
        *SMALL,
        *DFLASH_SPLIT,
        "--max-steps",
        "100000",
        "--out",
        str(tmp_path / "out"),
    )
    rid = run["id"]
    assert run["spec"]["argv"][:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]

    def live() -> dict | None:
        return next((r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid), None)

    def drafter_training() -> dict | None:
        r = live()
        if not r:
            return None
        ranks = {m["rank"]: m for m in r["members"] if m.get("rank") is not None}
        return ranks.get(2) if len(ranks) == 3 and ((r.get("telemetry") or {}).get("step") or 0) >= 3 else None

    drafter = wait_for(drafter_training, timeout=240, interval=0.5, what="the split job training (3 ranks, steps)")
    t_kill = time.time()
    os.kill(drafter["pid"], signal.SIGKILL)

    # either the run goes on and the alert is raised, or torchrun tears the job down at once and the end says who died first
    def noticed() -> tuple[str, dict] | None:
        r = live()
        if r is not None:
            a = next((a for a in r.get("alerts", []) if a["kind"] == "rank_exited"), None)
            return ("alert", a) if a else None
        return "ended", next(x for x in agent.cli_json("runs") if x["id"] == rid)

    how, what = wait_for(noticed, timeout=60, interval=0.2, what="the rank death noticed (alert, or the run's end)")
    took = time.time() - t_kill
    print(f"\n{how} {took:.1f} s after the kill: {what.get('message') or what.get('cause')}")
    # within 10 s on a quiet machine (the promise); a loaded test machine stretches the time, so only the outcome is asserted
    if how == "alert":
        assert what["rank"] == 2 and str(drafter["pid"]) in what["message"]
    ended = wait_for(
        lambda: (r := next((x for x in agent.cli_json("runs") if x["id"] == rid), None)) and r["state"] != "running" and r,
        timeout=120,
        what="the run to end",
    )
    print(f"run: {ended['state']}: {ended['cause']}")
    assert ended["state"] == "failed" and "rank 2 died first" in ended["cause"], ended["cause"]
    assert agent.cli_json("show", rid)["cause_class"] == "rank_died"
