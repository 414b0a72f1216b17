"""Benchmark: ``gpudeck ledger HOST:GPU --at TIME`` over a month of holds at 8 GPUs x 64 hosts (goal: under 100 ms).

A history.db is generated through the console's own ingest path (``History.submit``): for every host and GPU a
month of holds, each a ``start``, one ``level`` and an ``end`` record (the agent's ``gpu_hold`` events), a new hold
every ``--every-h`` hours on average (random lengths), plus a run id on half of them. Then, timed in-process:

* ``ledger_answer`` for ``--at`` a random time on a random ``HOST:GPU`` (the ledger index);
* the same for a whole host (``HOST`` alone, 8 GPUs);
* a run's footprint (``--run``);
* the peer, in the same run: the same ``--at`` answer folded from the history's ``events`` table without the
  ledger index (every ``gpu_hold`` record of the host up to that time, folded in Python), as a reader of the
  replica could do today;

and the real CLI, a fresh ``gpudeck ledger HOST:GPU --at TIME --no-sync --json`` process (wall time, median of
``--cli-rounds``), against ``python -c pass`` in the same rounds

and ``gpudeck history --no-sync --json limit:1`` (another history read through the CLI).

Usage: python bench/ledger.py [--hosts 64] [--gpus 8] [--days 30] [--every-h 2] [-n 200] [--cli-rounds 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpudeck.agents.wire.protocol import Event
from gpudeck.console.history.replica import History
from gpudeck.console.ops.ledger import LedgerQuery, ledger_answer

GIB = 2**30


def generate(history: History, hosts: int, gpus: int, days: float, every_h: float, end: float, seed: int = 7) -> tuple[int, int]:
    """A month of holds per host and GPU, ingested host by host; (holds, events)."""
    rng = random.Random(seed)
    start = end - days * 86400
    n_holds = n_events = 0
    futs = []
    for h in range(hosts):
        host = f"gpu{h:03d}"
        epoch = uuid.UUID(int=rng.getrandbits(128)).hex
        seq = 0
        evs: list[Event] = []
        for g in range(gpus):
            t = start + rng.uniform(0, every_h * 3600)
            pid = 1000 + g * 100000
            while t < end:
                length = rng.uniform(0.1, 2 * every_h) * 3600
                pid += rng.randint(1, 500)
                hold = uuid.UUID(int=rng.getrandbits(128)).hex[:16]
                run = f"r-{rng.getrandbits(32):08x}" if rng.random() < 0.5 else None
                base = {
                    "hold": hold,
                    "gpu": g,
                    "uuid": f"GPU-SIM-{h:03d}-{g}",
                    "pid": pid,
                    "create_time": t - 1.0,
                    "user": "alice",
                    "attribution": "RUN" if run else "FOREIGN",
                    "started": t,
                    **({"run": run, "rank": g} if run else {}),
                }
                first, peak = rng.randint(1, 20) * GIB, rng.randint(21, 140) * GIB
                recs = [
                    (t, {**base, "change": "start", "bytes": first, "peak": first}),
                    (t + length / 3, {**base, "change": "level", "bytes": peak, "peak": peak}),
                    (min(t + length, end - 1), {**base, "change": "end", "bytes": peak, "peak": peak, "evidence": "gone"}),
                ]
                for ts, data in recs:
                    seq += 1
                    evs.append(Event(seq=seq, ts=ts, kind="gpu_hold", run_id=run, data=data))
                n_holds += 1
                t += length + rng.uniform(0, every_h * 3600 * 0.2)
        evs.sort(key=lambda e: e.ts)
        for i, e in enumerate(evs, 1):  # seqs in time order, as the agent numbers them
            e.seq = i
        history.cursor(host, epoch)
        for i in range(0, len(evs), 5000):
            futs.append(history.submit(host, epoch, evs[i : i + 5000]))
        n_events += len(evs)
    for f in futs:
        f.result()
    return n_holds, n_events


def timeit(fn, n: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median and p99 in milliseconds of ``fn(i)`` over n calls."""
    xs = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        xs.append((time.perf_counter() - t0) * 1000)
    xs.sort()
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def line(name: str, med: float, p99: float, n: int, peer_of: float | None = None) -> None:
    ratio = f"  ({med / peer_of:.1f}x the index)" if peer_of else ""
    print(f"ledger {name:<44} p50 {med:9.3f} ms  p99 {p99:9.3f} ms  n={n}{ratio}", flush=True)


def events_fold(history_path: Path, host: str, gpu: int, at: float) -> list[dict]:
    """The peer: the --at answer from the events table alone (no ledger index): every gpu_hold record of the host up
    to ``at``, folded per hold in Python."""
    import sqlite3

    conn = sqlite3.connect(f"file:{history_path}?mode=ro", uri=True)
    try:
        latest: dict[str, dict] = {}
        for (data,) in conn.execute("SELECT data FROM events WHERE host=? AND kind='gpu_hold' AND ts <= ? ORDER BY seq", (host, at)):
            d = json.loads(data)
            if d.get("gpu") == gpu:
                latest[d["hold"]] = d
        return [d for d in latest.values() if d.get("change") != "end"]
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--every-h", type=float, default=2.0, help="a new hold on each GPU this often on average (hours)")
    ap.add_argument("-n", type=int, default=200, help="queries timed per figure")
    ap.add_argument("--peer-n", type=int, default=20, help="queries timed for the peer (it is slow)")
    ap.add_argument("--cli-rounds", type=int, default=5)
    ap.add_argument("--keep", type=Path, default=None, help="generate into (or reuse) this folder's history.db")
    args = ap.parse_args()

    home = args.keep or Path(tempfile.mkdtemp(prefix="gd-ledger-bench-", dir="/tmp"))
    home.mkdir(parents=True, exist_ok=True)
    os.environ["GPUDECK_HOME"] = str(home)
    path = home / "history.db"
    end = time.time()
    fresh = not path.exists()
    history = History(path)
    try:
        if fresh:
            t0 = time.perf_counter()
            holds, events = generate(history, args.hosts, args.gpus, args.days, args.every_h, end)
            took = time.perf_counter() - t0
            print(
                f"ledger generated {holds} holds ({events} gpu_hold events) on {args.hosts} hosts x {args.gpus} GPUs over "
                f"{args.days:g} days through History.submit in {took:.1f} s; history.db {path.stat().st_size / 2**20:.0f} MiB",
                flush=True,
            )
        else:
            end = float(_read(path, "SELECT MAX(ts) FROM events")[0][0]) + 1
            print(f"ledger reusing {path} ({path.stat().st_size / 2**20:.0f} MiB)", flush=True)
        rng = random.Random(11)
        span = args.days * 86400
        qs = [(f"gpu{rng.randrange(args.hosts):03d}", rng.randrange(args.gpus), end - rng.uniform(0, span)) for _ in range(args.n)]

        def one_gpu(i: int) -> None:
            host, gpu, at = qs[i % len(qs)]
            ledger_answer(history, LedgerQuery(host=host, gpu=gpu, mode="at", at=at))

        def one_host(i: int) -> None:
            host, _gpu, at = qs[i % len(qs)]
            ledger_answer(history, LedgerQuery(host=host, gpu=None, mode="at", at=at))

        sample = ledger_answer(history, LedgerQuery(host=qs[0][0], gpu=qs[0][1], mode="at", at=qs[0][2]))
        print(f"ledger sample answer: {len(sample.holds)} hold(s) on {qs[0][0]}:{qs[0][1]} at {qs[0][2]:.0f}", flush=True)
        med, p99 = timeit(one_gpu, args.n)
        line("--at HOST:GPU (index)", med, p99, args.n)
        hmed, hp99 = timeit(one_host, args.n)
        line("--at HOST (8 GPUs, index)", hmed, hp99, args.n)
        hosts_of = {r: h for r, h in _read(path, "SELECT run_id, host FROM ledger_holds WHERE run_id IS NOT NULL LIMIT 200")}
        runs = sorted(hosts_of)

        def footprint(i: int) -> None:
            r = runs[i % len(runs)]
            history.ledger_of_run(hosts_of[r], r)

        fmed, fp99 = timeit(footprint, min(args.n, len(runs)))
        line("--run RUN footprint (index)", fmed, fp99, min(args.n, len(runs)))

        def peer(i: int) -> None:
            host, gpu, at = qs[i % len(qs)]
            events_fold(path, host, gpu, at)

        pmed, pp99 = timeit(peer, args.peer_n)
        line("--at HOST:GPU peer: events table folded", pmed, pp99, args.peer_n, peer_of=med)
        # the two agree
        for host, gpu, at in qs[:20]:
            a = {h.hold for h in ledger_answer(history, LedgerQuery(host=host, gpu=gpu, mode="at", at=at)).holds}
            b = {d["hold"] for d in events_fold(path, host, gpu, at)}
            if a != b:
                print(f"ledger MISMATCH on {host}:{gpu} at {at}: index {sorted(a)} events {sorted(b)}", flush=True)
    finally:
        history.close()

    env = {**os.environ, "GPUDECK_HOME": str(home), "PYTHONPATH": str(ROOT)}
    cli_t, base_t, hist_t = [], [], []
    for i in range(args.cli_rounds):
        host, gpu, at = qs[i]
        t0 = time.perf_counter()
        cp = subprocess.run(
            [sys.executable, "-m", "gpudeck.console.cli.main", "ledger", f"{host}:{gpu}", "--at", _iso(at), "--no-sync", "--json"],
            env=env,
            capture_output=True,
            text=True,
        )
        cli_t.append((time.perf_counter() - t0) * 1000)
        if cp.returncode != 0:
            print(f"ledger CLI failed ({cp.returncode}): {cp.stderr.strip()[-400:]}", flush=True)
            break
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        base_t.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "gpudeck.console.cli.main", "history", "--no-sync", "--json", "limit:1"]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        hist_t.append((time.perf_counter() - t0) * 1000)
    if cli_t and base_t:
        print(
            f"ledger CLI `gpudeck ledger HOST:GPU --at TIME --no-sync --json` wall p50 {statistics.median(cli_t):.1f} ms; "
            f"`gpudeck history --no-sync --json limit:1` p50 {statistics.median(hist_t):.1f} ms; "
            f"`python -c pass` p50 {statistics.median(base_t):.1f} ms (rounds={len(cli_t)}); "
            f"last answer: {len(json.loads(cp.stdout)['holds'])} hold(s)",
            flush=True,
        )
    if args.keep is None:
        shutil.rmtree(home, ignore_errors=True)


def _read(path: Path, sql: str) -> list[tuple]:
    """A read of the generated file through its own connection (which runs to time, where it stood)."""
    import sqlite3

    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _iso(ts: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts).isoformat(timespec="seconds")


if __name__ == "__main__":
    main()
