"""Issue 32 on a real GPU: the ledger of a real CUDA run (real NVML), and its report.

A run claimed as "4 GPUs" holds ~3 GiB on GPU 0 only (a torch CUDA allocation), is stopped, and then:
- ``gpudeck ledger local --run RID`` gives its footprint: GPU 0 alone, peak at least the allocation, with its pid;
- ``gpudeck ledger local:0 --at T`` (T while it held) names the run's process as a RUN holder;
- ``gpudeck report RID`` marks the GPUs claim CONTRADICTED (claimed 4, held 1, from the GPU ledger).

Run on the accelerator: ``.venv/bin/python -m pytest -q -p no:randomly -s tests/gpu/test_ledger_report_gpu.py``
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime

from tests.agent_harness import AgentProc, wait_for
from tests.gpu.test_agent_gpu import HOLD, gpu_procs

GIB = 2**30


def test_the_ledger_and_the_report_of_a_real_cuda_run(agent: AgentProc) -> None:
    rid = agent.cli_json("launch", "--gpus", "0", "--name", "ledger-gpu", "--claim-gpus", "4", "--", sys.executable, "-c", HOLD, "3")["id"]
    held = wait_for(
        lambda: [p for p in gpu_procs(agent, rid) if (p.get("used_bytes") or 0) >= 3 * GIB], timeout=120, what="the holder on GPU 0"
    )

    def footprint() -> dict | None:
        got = json.loads(agent.cli("ledger", "local", "--run", rid, "--json").stdout)
        return got if got["footprint"] and got["footprint"][0]["peak"] >= 3 * GIB else None

    wait_for(footprint, timeout=60, what="the hold at its level in the ledger")  # the ledger samples once a tick
    # `during` is cut to the whole second: taken 1.1 s after the level was seen, it falls after the level's record
    # (taken at once it could fall before it: one failure in a full tests/gpu run on the H200); the stop comes 1.1 s
    # after it, so the hold spans it on both sides
    time.sleep(1.1)
    during = datetime.now().astimezone().isoformat(timespec="seconds")
    time.sleep(1.1)
    agent.cli_json("stop", rid, "--grace", "10")

    def ended() -> dict | None:
        got = json.loads(agent.cli("ledger", "local", "--run", rid, "--json").stdout)
        return got if all(h.get("ended") for h in got["holds"]) else None

    fp = wait_for(ended, timeout=60, what="the end of every hold of the run in the ledger")
    print(f"\nledger --run: {json.dumps(fp['footprint'])}")
    print(agent.cli("ledger", "local", "--run", rid, "--no-sync").stdout)
    assert [f["gpu"] for f in fp["footprint"]] == [0], fp
    assert fp["footprint"][0]["peak"] >= 3 * GIB and held[0]["pid"] in fp["footprint"][0]["pids"]

    at = json.loads(agent.cli("ledger", "local:0", "--at", during, "--no-sync", "--json").stdout)
    print(agent.cli("ledger", "local:0", "--at", during, "--no-sync").stdout)
    mine = [h for h in at["holds"] if h.get("run_id") == rid]
    assert any(h["pid"] == held[0]["pid"] and h["attribution"] == "RUN" and h["at_bytes"] >= 3 * GIB for h in mine), at

    doc = json.loads(agent.cli("report", rid, "--json", "--no-sync").stdout)
    gpus = next(c for c in doc["claims"] if c["what"] == "GPUs")
    print(agent.cli("report", rid, "--no-sync").stdout)
    assert (gpus["claimed"], gpus["evidence"], gpus["verdict"]) == (4, 1, "CONTRADICTED"), gpus
    assert "ledger" in gpus["evidence_source"]
