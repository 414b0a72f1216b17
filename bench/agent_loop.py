"""Benchmark: the agent's event loop while its journal's disk is slow.

A thread of this process holds the journal's SQLite write lock for ``--hold-ms`` (200 ms) again and again
(what a slow disk looks like to the agent: every commit waits), while a real agent supervises a run that
writes telemetry as fast as the agent journals it (one event per record), and a client pings the agent
every 20 ms and asks for a snapshot every 100 ms. Reported: ping and snapshot round trips (p50/p99/max),
and, where the agent has it (GPUDECK_LOOP_MONITOR), the worst lag of a 1 ms heartbeat on the agent's
event loop per second. Goal: the loop never stalls more than 5 ms while the disk is slow.

Usage: python bench/agent_loop.py [--seconds 30] [--hold-ms 200] [--gap-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.protocol import GetSnapshot, Launch, LaunchSpec, Ping

# telemetry as fast as the agent takes it: every record becomes one journal event (eval records are never thinned)
WRITER = r"""
import json, os, time
with open(os.environ["GPUDECK_TELEMETRY"], "a") as fh:
    i = 0
    while True:
        fh.write(json.dumps({"ts": time.time(), "rank": 0, "type": "eval", "step": i, "tau": 1.0}) + "\n"); fh.flush()
        i += 1
        time.sleep(0.01)
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def holder(db: Path, hold_s: float, gap_s: float, stop: threading.Event, held: list[float]) -> None:
    """Hold the journal's write lock for hold_s, let go for gap_s, until stop."""
    conn = sqlite3.connect(str(db), isolation_level=None, timeout=30)
    try:
        while not stop.is_set():
            conn.execute("BEGIN IMMEDIATE")
            t0 = time.monotonic()
            stop.wait(hold_s)
            conn.execute("COMMIT")
            held.append(time.monotonic() - t0)
            stop.wait(gap_s)
    finally:
        conn.close()


async def main_async(args: argparse.Namespace) -> None:
    home = Path(tempfile.mkdtemp(prefix="gd-loop-", dir="/tmp"))
    state = home / "agent"
    monitor = home / "loop.jsonl"
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "GPUDECK_HOME": str(home), "PYTHONPATH": pythonpath, "GPUDECK_LOOP_MONITOR": str(monitor)}
    errlog = open(home / "agent.stderr", "wb")
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpudeck.agents", "serve", "--state-dir", str(state)],
        env=env,
        start_new_session=True,
        stdout=errlog,
        stderr=errlog,
    )
    stop = threading.Event()
    client = None
    try:
        for _ in range(400):
            try:
                client = await AgentClient.connect_unix(state_dir=state, autostart=False)
                break
            except Exception:
                await asyncio.sleep(0.05)
        if client is None:
            raise SystemExit(f"agent did not start: {(home / 'agent.stderr').read_text()[-2000:]}")
        launched = await client.request(Launch(spec=LaunchSpec(argv=[sys.executable, "-c", WRITER], cwd=str(home))), timeout=60)
        run_id = launched.run.id  # type: ignore[attr-defined]
        await asyncio.sleep(2.0)
        held: list[float] = []
        t_lock = threading.Thread(
            target=holder, args=(state / "journal.db", args.hold_ms / 1000, args.gap_ms / 1000, stop, held), daemon=True
        )
        mon_from = monitor.stat().st_size if monitor.exists() else 0
        if args.hold_ms > 0:
            t_lock.start()
        pings: list[float] = []
        snaps: list[float] = []
        t_end = time.monotonic() + args.seconds
        next_snap = time.monotonic()
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            await client.request(Ping(), timeout=30)
            pings.append((time.monotonic() - t0) * 1000)
            if time.monotonic() >= next_snap:
                t0 = time.monotonic()
                await client.request(GetSnapshot(), timeout=30)
                snaps.append((time.monotonic() - t0) * 1000)
                next_snap += 0.1
            await asyncio.sleep(0.02)
        stop.set()
        if t_lock.is_alive():
            t_lock.join(10)
        print(
            f"agent_loop journal write lock held {len(held)} times, {statistics.fmean(held or [0]) * 1000:.0f} ms each (gap {args.gap_ms} ms), over {args.seconds:.0f} s; run {run_id} journaling telemetry",
            flush=True,
        )
        print(
            f"agent_loop ping RTT      p50 {pct(pings, 0.5):7.2f} ms  p99 {pct(pings, 0.99):7.2f} ms  max {max(pings):7.2f} ms  n={len(pings)}",
            flush=True,
        )
        print(
            f"agent_loop snapshot RTT  p50 {pct(snaps, 0.5):7.2f} ms  p99 {pct(snaps, 0.99):7.2f} ms  max {max(snaps):7.2f} ms  n={len(snaps)}",
            flush=True,
        )
        if monitor.exists():
            with open(monitor, "rb") as fh:
                fh.seek(mon_from)
                lines = [json.loads(x) for x in fh.read().splitlines() if x.strip()]
            lags = [x["max_lag_ms"] for x in lines]
            busy = [x["max_busy_ms"] for x in lines]
            print(
                f"agent_loop event-loop lag (1 ms heartbeat, worst per second): p50 {pct(lags, 0.5):.2f} ms  max {max(lags):.2f} ms; "
                f"{sum(1 for x in lags if x > 5.0)} of {len(lags)} seconds had a lag over 5 ms",
                flush=True,
            )
            print(
                f"agent_loop event-loop work (CPU the loop's thread spent within one beat, worst per second): p50 {pct(busy, 0.5):.2f} ms  "
                f"max {max(busy):.2f} ms; {sum(1 for x in busy if x > 5.0)} of {len(busy)} seconds over 5 ms (a lag beyond it is the host's scheduler)",
                flush=True,
            )
        else:
            print("agent_loop event-loop lag: this agent has no GPUDECK_LOOP_MONITOR (an older build); ping RTT stands for it", flush=True)
        db = sqlite3.connect(str(state / "journal.db"))
        n_ev = db.execute("SELECT COUNT(*) FROM events WHERE run_id=?", (run_id,)).fetchone()[0]
        db.close()
        print(f"agent_loop events journaled for the run: {n_ev}", flush=True)
    finally:
        stop.set()
        if client is not None:
            await client.close()
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        # the run outlives the agent by design: stop it by its pid from the journal's members
        try:
            db = sqlite3.connect(str(state / "journal.db"))
            for (members,) in db.execute("SELECT members FROM runs"):
                for m in json.loads(members):
                    try:
                        os.kill(int(m["pid"]), 9)
                    except (ProcessLookupError, KeyError, ValueError):
                        pass
            db.close()
        except sqlite3.Error:
            pass
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--hold-ms", type=float, default=200.0, help="how long each hold of the write lock lasts (0: never held, the control)")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause between holds")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
