"""Benchmark: from the hang threshold to a stored triage, for a real torchrun of fsdp_lm on CPU (gloo) at 4 and 16 ranks.

A real agent (tests/agent_harness.py) launches ``fsdp_lm --model-config tiny`` under torchrun with
``--hang-after H``; the middle rank sleeps before step K (``GPUDECK_TEST_SLEEP_AT_STEP``), outside any
collective, so the others wait in FSDP's all-gather. Figures, per rank count:

- ``alert``: the hang alert's time minus the moment the threshold was crossed (the last step record's
  time + the threshold, both as the alert states them): the tick's share (goal: within 10 s);
- ``stored``: the journal event ``triage``'s time minus that moment (goal: 30 s at 16 ranks);
- ``gather``: the triage's own ``seconds`` (signals, CPU sampling, the dumps read);
- whether the culprit line names the sleeping rank, and by which method each rank's stacks came.

Usage: python bench/triage.py [--ranks 4,16] [--hang-after 5]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudeck.agents.protocol import GetEvents, GetRun, to_builtins
from tests.agent_harness import AgentProc, teardown_agent


def ask(a: AgentProc, msg: Any) -> Any:
    """One request to the agent's socket."""

    async def go() -> Any:
        c = await a.client()
        try:
            return to_builtins(await c.request(msg, timeout=120))
        finally:
            await c.close()

    return asyncio.run(go())


def one(ranks: int, hang_after: float, sleep_at: int) -> dict[str, Any]:
    """Launch, wait for the triage, measure, stop."""
    home = Path(tempfile.mkdtemp(prefix="gdb-", dir="/tmp"))
    a = AgentProc(home).start()
    try:
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "gpudeck.trainers.fsdp_lm", "--model-config", "tiny", "--fresh", "--out", str(home / "out"),
            "--max-steps", "100000", "--batch-size", "1", "--seq-len", "32", "--checkpoint-every", "100000",
            "--no-final-checkpoint", "--corpus-bytes", "200000", "--no-export", "--device", "cpu",
        ]  # fmt: skip
        victim = ranks // 2
        rid = a.cli_json(
            "launch", "--name", f"bench-hang-{ranks}", "--cwd", str(ROOT), "--hang-after", str(hang_after),
            "--env", f"GPUDECK_TEST_SLEEP_AT_STEP={sleep_at}:{victim}:900", "--env", "OMP_NUM_THREADS=1", "--", *argv,
        )["id"]  # fmt: skip
        t0 = time.monotonic()
        while True:
            evs = [e for e in ask(a, GetEvents(after_seq=0))["events"] if e.get("run_id") == rid]
            tri = [e for e in evs if e["kind"] == "triage"]
            hang = [e for e in evs if e["kind"] == "alert" and e["data"]["alert"]["kind"] == "hang"]
            if tri and hang:
                break
            if time.monotonic() - t0 > 900:
                raise SystemExit(f"{ranks} ranks: no triage after 900 s; agent log: {a.log()}")
            time.sleep(0.5)
        alert = hang[0]["data"]["alert"]
        crossed = alert["ts"] - (alert["data"]["seconds"] - alert["data"]["threshold_s"])
        t = tri[0]["data"]["triage"]
        alive = ask(a, GetRun(run_id=rid))["run"]["state"] == "running"
        a.cli("stop", rid, "--grace", "2", check=False, timeout=300)
        return {
            "ranks": ranks,
            "threshold_s": alert["data"]["threshold_s"],
            "alert_s": alert["ts"] - crossed,
            "stored_s": tri[0]["ts"] - crossed,
            "gather_s": t["seconds"],
            "names_victim": t["culprit"].startswith(f"rank {victim} "),
            "methods": sorted({e["method"] for e in t["ranks"]}),
            "ranks_with_stacks": sum(1 for e in t["ranks"] if e["stacks"]),
            "alive_after": alive,
            "culprit": t["culprit"],
        }
    finally:
        teardown_agent(a)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4,16")
    ap.add_argument("--hang-after", type=float, default=5.0)
    ap.add_argument("--sleep-at", type=int, default=4, help="the step the middle rank sleeps before")
    args = ap.parse_args()
    for n in (int(x) for x in args.ranks.split(",")):
        r = one(n, args.hang_after, args.sleep_at)
        print(
            f"{r['ranks']:>3} ranks: threshold {r['threshold_s']:.1f} s; hang alert {r['alert_s']:+.1f} s after it; "
            f"triage stored {r['stored_s']:+.1f} s after it (gathered in {r['gather_s']:.1f} s); "
            f"stacks from {r['ranks_with_stacks']}/{r['ranks']} ranks by {', '.join(r['methods'])}; "
            f"names the sleeping rank: {r['names_victim']}; run alive after: {r['alive_after']}",
            flush=True,
        )
        print(f"     culprit: {r['culprit']}", flush=True)


if __name__ == "__main__":
    main()
