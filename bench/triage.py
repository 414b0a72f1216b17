"""Benchmark: from the hang threshold to a stored triage, for a real torchrun of fsdp_lm on CPU (gloo) at 4 and 16 ranks.

A real agent (tests/agent_harness.py) launches ``fsdp_lm --model-config tiny`` under torchrun with
``--hang-after H``; the middle rank sleeps before step K (``GPUDECK_TEST_SLEEP_AT_STEP``), outside any
collective, so the others wait in FSDP's all-gather. Figures, per rank count:

- ``alert``: the hang alert's time minus the moment the threshold was crossed (the last step record's
  time + the threshold, both as the alert states them): the tick's share (goal: within 10 s);
- ``stored``: the journal event ``triage``'s time minus that moment (goal: 30 s at 16 ranks);
- ``gather``: the triage's own ``seconds`` (signals, CPU sampling, the dumps read);
- whether the culprit line names the sleeping rank, and by which method each rank's stacks came.

And the cost of the compute/wait measurement (``trainers/common/diagnostics.py``'s timed ``Work.wait``): the
time one gloo ``all_reduce`` + ``wait`` takes with and without the wrapper (one-rank group, same process,
alternating blocks), times the waits each step of the benchmarked run made (its ``waits`` field), over
that step's time (``step_time_s``): the share of a step the measurement costs.

And on the accelerator (``--gpu-overhead``): the trainers' tokens/s with and without the compute-time
measurement (CUDA events, ``GPUDECK_COMPUTE_TIMING=0`` turns it off) and with and without the Flight
Recorder at its default buffer (``TORCH_FR_BUFFER_SIZE=0`` turns it off): ``fsdp_lm`` on one GPU (the
``llama-1b`` preset, bf16, batch 8 x seq 1024), one process per setting in the order off, timing, fr, both, repeated ``--gpu-repeats`` times and
ended by one more off, each the median tokens/s of its steps after the warm-up; each setting against
the mean of the ``off`` runs, whose own spread is the noise floor. With ``--gpu-ab-steps N``, first one process of N steps with the
measurement on in alternate blocks of 20 steps (``GPUDECK_COMPUTE_TIMING=ab:20``; inside an "on" block
the trainer times one step in four, as it does by default): the mean step time of the "on" blocks
against the "off" blocks of the same run, free of the between-process noise. Goal: <= 1%.

Usage: python bench/triage.py [--ranks 4,16] [--hang-after 5] [--overhead-only] [--gpu-overhead [--gpu-steps N]]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudeck.agents.wire.protocol import GetEvents, GetRun
from tests.agent_harness import AgentProc, teardown_agent


def run_dir(a: AgentProc, rid: str) -> str:
    """The run's folder, as the agent has it."""
    return str(a.ask(GetRun(run_id=rid))["run"]["run_dir"])


def one(ranks: int, hang_after: float, sleep_at: int, per_wait: float) -> dict[str, Any]:
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
            evs = [e for e in a.ask(GetEvents(after_seq=0))["events"] if e.get("run_id") == rid]
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
        steps = [json.loads(x) for x in (Path(run_dir(a, rid)) / "telemetry.jsonl").read_text().splitlines() if '"step"' in x]
        shares = [
            r["waits"] * per_wait / r["step_time_s"] for r in steps if r.get("type") == "step" and r.get("waits") and r.get("step_time_s")
        ]
        alive = a.ask(GetRun(run_id=rid))["run"]["state"] == "running"
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
            "waits": statistics.median(r["waits"] for r in steps if r.get("type") == "step" and r.get("waits")) if shares else None,
            "overhead_pct": 100 * statistics.median(shares) if shares else None,
        }
    finally:
        teardown_agent(a)
        shutil.rmtree(home, ignore_errors=True)


def overhead(n: int = 4000) -> float:
    """Seconds the timed Work.wait adds to one wait (median of 5 alternating blocks of ``n``)."""
    import os

    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(4)
    original = dist.Work.wait

    def block() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x, async_op=True).wait()
        return (time.perf_counter() - t0) / n

    from gpudeck.trainers.common.diagnostics import CollectiveClock

    CollectiveClock(on_cuda=False)
    wrapped = dist.Work.wait
    plain_t, wrapped_t = [], []
    for _ in range(5):
        dist.Work.wait = original  # type: ignore[method-assign]
        plain_t.append(block())
        dist.Work.wait = wrapped  # type: ignore[method-assign]
        wrapped_t.append(block())
    p, w = statistics.median(plain_t), statistics.median(wrapped_t)
    dist.destroy_process_group()
    print(f"all_reduce+wait on a one-rank gloo group: {p * 1e6:.1f} us plain, {w * 1e6:.1f} us timed: {(w - p) * 1e6:+.2f} us per wait")
    return w - p


GPU_MODEL = "llama-1b"  # trainers/presets.py: a 1.1B Llama, the size the MFU benchmarks (RESULTS 14) use
AB_BLOCK = 20  # steps per block: with one step in 4 timed (trainers/common/diagnostics.py), 5 timed steps in each "on" block
GPU_SETTINGS = {  # name -> environment: the measurement and the Flight Recorder on or off
    "off": {"GPUDECK_COMPUTE_TIMING": "0", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"},
    "timing": {"GPUDECK_COMPUTE_TIMING": "1", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"},
    "fr": {"GPUDECK_COMPUTE_TIMING": "0"},
    "both": {"GPUDECK_COMPUTE_TIMING": "1"},
    # the same-run comparison: the measurement on in alternate blocks of AB_BLOCK steps, Flight Recorder off
    "ab": {"GPUDECK_COMPUTE_TIMING": f"ab:{AB_BLOCK}", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"},
}


def gpu_run(setting: str, steps: int, warmup: int, work: Path) -> dict[str, Any]:
    """One fsdp_lm process on the GPU under ``setting``; its median tokens/s after ``warmup`` steps."""
    import os
    import subprocess

    out = work / f"run-{setting}-{time.monotonic_ns()}"
    out.mkdir()
    tel = out / "telemetry.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_TRACE", "GPUDECK_"))}
    env.update(GPU_SETTINGS[setting], GPUDECK_TELEMETRY=str(tel), PYTHONUNBUFFERED="1")
    argv = [
        sys.executable, "-m", "gpudeck.trainers.fsdp_lm", "--model-config", GPU_MODEL, "--fresh", "--out", str(out / "out"),
        "--max-steps", str(steps), "--batch-size", "8", "--seq-len", "1024", "--checkpoint-every", "100000",
        "--no-final-checkpoint", "--corpus-bytes", "4000000", "--no-export", "--device", "cuda",
    ]  # fmt: skip
    cp = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    if cp.returncode != 0:
        raise SystemExit(f"fsdp_lm ({setting}) failed: {cp.stdout[-2000:]}{cp.stderr[-2000:]}")
    recs = [json.loads(x) for x in tel.read_text().splitlines()]
    man = next(r for r in recs if r["type"] == "manifest")
    st = [r for r in recs if r["type"] == "step" and r["step"] > warmup]
    timed = [r for r in st if "compute_s" in r]
    if setting == "ab":  # step s is the process's (s-1)-th: timed in blocks 0, 2, 4, ... of AB_BLOCK
        # the mean step time of each class (a cost on one step in four is in the mean, not in a median)
        on = [r["step_time_s"] for r in st if ((r["step"] - 1) // AB_BLOCK) % 2 == 0]
        off = [r["step_time_s"] for r in st if ((r["step"] - 1) // AB_BLOCK) % 2 == 1]
        tokens = st[0]["tokens_per_s"] * st[0]["step_time_s"]
        return {"setting": setting, "on": tokens / statistics.mean(on), "off": tokens / statistics.mean(off), "n": (len(on), len(off))}
    return {
        "setting": setting,
        "tps": statistics.median(r["tokens_per_s"] for r in st),
        "step_ms": 1000 * statistics.median(r["step_time_s"] for r in st),
        "timing": man.get("compute_timing"),
        "compute_ms": 1000 * statistics.median(r["compute_s"] for r in timed) if timed else None,
        "wait_ms": 1000 * statistics.median(r["wait_s"] for r in timed) if timed else None,
        "stalls": statistics.median(r["stalls"] for r in timed) if timed else None,
        "gpu": man.get("gpu_name"),
        "params": man.get("params_total"),
    }


def gpu_overhead(steps: int, warmup: int, repeats: int, ab_steps: int) -> None:
    """tokens/s of fsdp_lm with and without the measurement and the Flight Recorder (see the module docstring)."""
    work = Path(tempfile.mkdtemp(prefix="gdb-gpu-", dir="/tmp"))
    order = [*(("off", "timing", "fr", "both") * repeats), "off"]
    try:
        if ab_steps:
            ab = gpu_run("ab", ab_steps, warmup, work)
            print(
                f"RESULT overhead.same_run compute timing on {ab['on']:,.0f} tok/s, off {ab['off']:,.0f} tok/s "
                f"(mean step time of {ab['n'][0]} and {ab['n'][1]} steps after {warmup}, alternate blocks of {AB_BLOCK} in one "
                f"process): {100 * (1 - ab['on'] / ab['off']):+.2f}% cost",
                flush=True,
            )
        runs = [gpu_run(s, steps, warmup, work) for s in order] if repeats else []
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not runs:
        return
    base = [r["tps"] for r in runs if r["setting"] == "off"]
    ref = statistics.mean(base)
    print(
        f"fsdp_lm on {runs[0]['gpu']}, {runs[0]['params']:,} params, bf16, batch 8 x seq 1024, {steps} steps "
        f"(median of steps {warmup + 1}..{steps})",
        flush=True,
    )
    for r in runs:
        extra = ""
        if r["compute_ms"] is not None:
            extra = f"; compute {r['compute_ms']:.1f} ms + wait {r['wait_ms']:.1f} ms, {r['stalls']:.0f} stalls bracketed"
        print(
            f"RESULT overhead.{r['setting']} {r['tps']:,.0f} tok/s step {r['step_ms']:.1f} ms ({100 * (r['tps'] / ref - 1):+.2f}% vs off){extra}"
        )
    print(f"noise: the {len(base)} 'off' runs span {100 * (max(base) - min(base)) / ref:.2f}%", flush=True)
    for setting in ("timing", "fr", "both"):
        tps = [r["tps"] for r in runs if r["setting"] == setting]
        print(
            f"RESULT overhead.{setting}.mean {statistics.mean(tps):,.0f} tok/s over {len(tps)} runs: "
            f"{100 * (1 - statistics.mean(tps) / ref):+.2f}% cost vs the mean of the 'off' runs",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4,16")
    ap.add_argument("--hang-after", type=float, default=30.0, help="the threshold's floor (short floors misfire on a loaded host)")
    ap.add_argument("--sleep-at", type=int, default=6, help="the step the middle rank sleeps before")
    ap.add_argument("--overhead-only", action="store_true")
    ap.add_argument("--gpu-overhead", action="store_true", help="only the accelerator's tokens/s with and without (see above)")
    ap.add_argument("--gpu-steps", type=int, default=40)
    ap.add_argument("--gpu-warmup", type=int, default=10)
    ap.add_argument("--gpu-repeats", type=int, default=1, help="runs of the off/timing/fr/both cycle (one more 'off' ends it)")
    ap.add_argument("--gpu-ab-steps", type=int, default=0, help="first, one run of N steps timed in alternate blocks (0: none)")
    args = ap.parse_args()
    if args.gpu_overhead:
        gpu_overhead(args.gpu_steps, args.gpu_warmup, args.gpu_repeats, args.gpu_ab_steps)
        return
    per_wait = overhead()
    print(f"timed Work.wait: {per_wait * 1e6:+.2f} us per wait (one-rank gloo all_reduce, with vs without, alternating)", flush=True)
    if args.overhead_only:
        return
    for n in (int(x) for x in args.ranks.split(",")):
        r = one(n, args.hang_after, args.sleep_at, per_wait)
        print(
            f"{r['ranks']:>3} ranks: threshold {r['threshold_s']:.1f} s; hang alert {r['alert_s']:+.1f} s after it; "
            f"triage stored {r['stored_s']:+.1f} s after it (gathered in {r['gather_s']:.1f} s); "
            f"stacks from {r['ranks_with_stacks']}/{r['ranks']} ranks by {', '.join(r['methods'])}; "
            f"names the sleeping rank: {r['names_victim']}; run alive after: {r['alive_after']}",
            flush=True,
        )
        print(f"     culprit: {r['culprit']}", flush=True)
        if r["overhead_pct"] is not None:
            print(
                f"     compute/wait measurement: {r['waits']:.0f} timed waits a step, {r['overhead_pct']:.4f}% of a step (median)",
                flush=True,
            )


if __name__ == "__main__":
    main()
