"""Benchmark: what containment costs a launch and a stop, at each level this host allows, against the tag-only path.

Launch cost: from the launch request to the run's first user instruction
(the mtime of a file its ``sh`` writes as its first act), pre-flight included,
median of ``--launches`` runs per level. Stop cost: from the stop request to
the verified result (every member gone, NVML — here SIMULATED GPUs, one holder
per process — says none holds memory) for a run of ``--procs`` processes of
which a tenth ignore SIGTERM, so the kill phase is measured too.

Both levels run in the same process, one after the other, on the same host.
Goals (issue 21): containment's launch overhead under 20 ms; a stop of 500
processes verified within grace + 1 s.

Also the supervision tick's stall of the event loop with that run live:
``refresh()`` (everything on the calling thread, as tests call it) against
``tick()`` (what the agent's tick loop calls: every read in a worker thread,
the decisions on the loop), each as the worst wall-clock gap between two 1 ms
beats and as the most CPU the loop's own thread spent within one beat. The
stop's phases (TERM + grace + kill + wait for ``populated 0``; the GPU
verification; the rest) are timed by wrapping the stop sequence's functions.

Usage: python bench/containment.py [--procs 500] [--launches 7] [--grace 2] [--ticks 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudeck.agents.observe.gpus_sim import SimulatedGpuSampler
from gpudeck.agents.observe.procs import ProcTable
from gpudeck.agents.runs import stop
from gpudeck.agents.runs.supervisor import Supervisor
from gpudeck.agents.safety.containment import detect
from gpudeck.agents.server.snapshot import SnapshotBuilder
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.protocol import LaunchSpec

# the leader spawns N-1 sleepers (every tenth with SIGTERM ignored), then says how many are up
TREE = r"""
import os, sys, time
n = int(sys.argv[1])
for i in range(n - 1):
    if i % 10 == 0:
        os.posix_spawn("/bin/sh", ["sh", "-c", "trap '' TERM; exec sleep 100000"], os.environ)
    else:
        os.posix_spawn("/bin/sleep", ["sleep", "100000"], os.environ)
open(sys.argv[2], "w").write("up")
while True:
    time.sleep(1)
"""


async def loop_stall(coro_fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """While ``coro_fn()`` runs: the longest the loop went without running a 1 ms ticker (wall, ms), and the most CPU
    the loop's own thread spent between two beats (ms: work on the loop; the rest of a wall stall is waiting for a
    CPU or for the GIL held by the tick's worker thread)."""
    worst = busy = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst, busy
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not done:
            await asyncio.sleep(0.001)
            now, cpu = time.perf_counter(), time.thread_time()
            worst = max(worst, (now - last) * 1000 - 1.0)
            busy = max(busy, (cpu - last_cpu) * 1000)
            last, last_cpu = now, cpu

    t = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.005)
    await coro_fn()
    done = True
    await t
    return worst, busy


@contextlib.contextmanager
def phases_timed():  # type: ignore[no-untyped-def]
    """Wall time of the stop's phases (TERM + grace + kill + wait; the GPU verification), by wrapping the stop sequence's functions."""
    phases: dict[str, float] = {}
    saved = stop.terminate, stop.verify_gpu

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        async def wrapper(*a, **kw):  # type: ignore[no-untyped-def]
            t0 = time.monotonic()
            try:
                return await fn(*a, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + time.monotonic() - t0

        return wrapper

    stop.terminate = timed("term+grace+kill+wait", stop.terminate)  # type: ignore[assignment]
    stop.verify_gpu = timed("GPU verification", stop.verify_gpu)  # type: ignore[assignment]
    try:
        yield phases
    finally:
        stop.terminate, stop.verify_gpu = saved


def out(name: str, value: float, unit: str, note: str = "") -> None:
    print(f"containment {name:<44} {value:10.1f} {unit}{('  ' + note) if note else ''}", flush=True)


async def one_level(level: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    home = tmp / level
    runs = home / "runs"
    runs.mkdir(parents=True)
    procs = ProcTable(runs)
    os.environ["GPUDECK_HOME"] = str(home)  # the simulated GPUs see this home's holders
    sampler = SimulatedGpuSampler("1:H200:141", procs)
    containment = detect(runs, forced=level)
    if containment.level != level:
        print(f"containment {level}: not available here ({containment.label})", flush=True)
        return {}
    sup = Supervisor(Journal(home / "journal.db", "bench"), runs, "bench", sampler, procs, containment=containment)
    sup.attribute = SnapshotBuilder("bench", sup.journal.epoch, sampler, procs, sup).attribute  # as the agent wires it
    launch_ms: list[float] = []
    for i in range(args.launches):
        mark = home / f"first-{i}"
        t0 = time.time_ns()
        run, _ = await sup.launch(LaunchSpec(argv=["/bin/sh", "-c", 'echo up > "$0"; exec sleep 30', str(mark)], cwd=str(home)))
        while not mark.exists():
            await asyncio.sleep(0.001)
        launch_ms.append((mark.stat().st_mtime_ns - t0) / 1e6)
        await sup.stop(run.id, grace_s=1)
    # a big run: every process holds a little simulated GPU memory, so the verification waits for each
    up = home / "big-up"
    run, _ = await sup.launch(
        LaunchSpec(argv=[sys.executable, "-c", TREE, str(args.procs), str(up)], cwd=str(home), env={"GPUDECK_SIM_GPU_MEM": "0:0.01"})
    )
    while not up.exists():
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        await sup.tick()
        live = sup.live_runs()
        if live and len([m for m in live[0].members if m.role != "shim"]) >= args.procs:
            break
        await asyncio.sleep(0.2)
    members = len([m for m in sup.live_runs()[0].members if m.role != "shim"])
    # the tick's cost on the event loop: all of it (refresh, as the agent calls it today) against tick() (scans in a thread)
    for name, fn in (("refresh() on the loop", None), ("tick(), scans off the loop", sup.tick)):
        stalls, busy = [], []
        for _ in range(args.ticks):
            if fn is None:
                t1, c1 = time.perf_counter(), time.thread_time()
                sup.refresh()
                stalls.append((time.perf_counter() - t1) * 1000)
                busy.append((time.thread_time() - c1) * 1000)
            else:
                wall, cpu = await loop_stall(fn)
                stalls.append(wall)
                busy.append(cpu)
        out(
            f"{level}: tick {name}, worst loop stall",
            max(stalls),
            "ms",
            f"median {statistics.median(stalls):.2f} ms, n={len(stalls)}, {members} processes in the run, {len(os.listdir('/proc'))} /proc entries",
        )
        out(
            f"{level}: tick {name}, loop's own CPU in one beat",
            max(busy),
            "ms",
            f"median {statistics.median(busy):.2f} ms (work on the loop's thread; the wall stall adds the scheduler and the GIL)",
        )
    t0 = time.monotonic()
    with phases_timed() as phases:
        res = await sup.stop(run.id, grace_s=args.grace)
    stop_s = time.monotonic() - t0
    ok = res.gpu_verified and not res.survivors
    out(
        f"{level}: launch to first instruction (median)",
        statistics.median(launch_ms),
        "ms",
        f"n={len(launch_ms)} min {min(launch_ms):.1f} max {max(launch_ms):.1f}",
    )
    out(
        f"{level}: stop of {members} processes, verified",
        stop_s * 1000,
        "ms",
        f"grace {args.grace:g} s; over grace {stop_s - args.grace:+.2f} s; {len(res.needed_kill)} needed kill; verified={ok}; {res.group_note[:80]}",
    )
    known = sum(phases.values())
    print(
        f"containment {level}: stop phases "
        + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in phases.items())
        + f", the rest (members, classify, journal) {(stop_s - known) * 1000:.1f} ms",
        flush=True,
    )
    sup.journal.close()
    return {"launch": statistics.median(launch_ms), "stop": stop_s, "verified": float(ok)}


async def main_async(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gd-bench-contain-", dir="/tmp"))
    try:
        got = {level: await one_level(level, args, tmp) for level in ("tag", "cgroupfs")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tag, cg = got.get("tag"), got.get("cgroupfs")
    if tag and cg:
        out("cgroupfs launch overhead over tag (goal < 20 ms)", cg["launch"] - tag["launch"], "ms")
        out(
            "cgroupfs stop over grace (goal < 1000 ms)",
            (cg["stop"] - args.grace) * 1000,
            "ms",
            f"tag: {(tag['stop'] - args.grace) * 1000:.1f} ms; ratio tag/cgroupfs {tag['stop'] / cg['stop']:.2f}x",
        )


def main() -> None:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=500)
    ap.add_argument("--launches", type=int, default=7)
    ap.add_argument("--grace", type=float, default=2.0)
    ap.add_argument("--ticks", type=int, default=10)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
