"""Micro-benchmark (issue 19): the cost of one scrape of ``gpudeck watch --metrics`` at N hosts, without the fleet.

N synthetic hosts (8 GPUs each, one process per GPU, one run per host, as the 256-host fleet bench's simulated
agents report) are put behind a stand-in Fleet; the history holds one live run per host. Then, in this process:

- **build**: :class:`FleetCollector`'s families built (``list(collect())``), no formatting;
- **format**: prometheus_client's OpenMetrics and Prometheus-text encoders over those families, and gzip;
- **scrape**: the endpoint the watcher serves, asked as Prometheus asks (OpenMetrics, gzip) over loopback HTTP,
  ``--scrapes`` times: the wall time of each, quiet, then with a busy thread holding the GIL as a busy event
  loop would (``--busy``: how much of the time it computes, 0-1).

Usage: python bench/watch_metrics.py [--hosts 256] [--scrapes 20] [--busy 0.5]
Prints one line per figure (prefix ``watch_metrics``).
"""

from __future__ import annotations

import argparse
import gzip
import sqlite3
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROM_ACCEPT = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"


def synthetic_fleet(n: int, gpus: int = 8) -> Any:
    """A stand-in Fleet: ``links[name].status`` with ``state`` and a ``snapshot`` of ``gpus`` busy GPUs and one run."""
    from gpudeck.agents.wire.protocol import Gpu, GpuProcess, Member, Snapshot

    links = {}
    now = time.time()
    for h in range(n):
        name = f"h{h:03d}"
        rid = f"r-{h:06d}"
        snap = Snapshot(
            host=name,
            ts=now,
            epoch="e",
            simulated=True,
            gpus=[
                Gpu(
                    index=i,
                    memory_used=40 << 30,
                    memory_total=141 << 30,
                    util_gpu=97,
                    temperature_c=61,
                    power_w=612.5,
                    unaccounted_bytes=0,
                    processes=[GpuProcess(pid=1000 + i, gpu=i, used_bytes=40 << 30, attribution="RUN", run_id=rid, rank=i)],
                )
                for i in range(gpus)
            ],
            runs=[
                SimpleNamespace(id=rid, members=[Member(pid=1000 + i, create_time=now, rank=i) for i in range(gpus)])
            ],  # what the collector reads
        )
        links[name] = SimpleNamespace(status=SimpleNamespace(state="up", snapshot=snap))
    return SimpleNamespace(links=links)


def synthetic_history(n: int) -> sqlite3.Connection:
    """An in-memory history whose ``runs`` table holds one live run per host."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.execute(
        "CREATE TABLE runs(host, id, kind, state, last_step, last_loss, tokens_per_s, mfu, alerts, world_size, ranks_seen, spec, ended)"
    )
    conn.executemany(
        "INSERT INTO runs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        [(f"h{h:03d}", f"r-{h:06d}", "fsdp", "running", 1200, 2.5, 51000.0, 0.41, "[]", 8, 8, "{}", None) for h in range(n)],
    )
    return conn


def ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


def out(line: str) -> None:
    print(f"watch_metrics {line}", flush=True)


def scrape(url: str) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    req = urllib.request.Request(url, headers={"Accept": PROM_ACCEPT, "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=30) as resp:  # loopback, this process's own server
        raw = resp.read()
        body = gzip.decompress(raw) if resp.headers.get("Content-Encoding") == "gzip" else raw
    return time.perf_counter() - t0, body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=256)
    ap.add_argument("--scrapes", type=int, default=20)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between scrapes")
    ap.add_argument("--busy", type=float, default=0.5, help="share of the time the busy thread computes (0: none)")
    ap.add_argument("--live", action="store_true", help="serve as before the cache: build and format at each scrape")
    ap.add_argument("--render-every", type=float, default=1.0, help="the cached endpoint's render period (s)")
    args = ap.parse_args()

    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    from gpudeck.console.watch import metrics as wm

    fleet = synthetic_fleet(args.hosts)
    conn = synthetic_history(args.hosts)
    health = wm.WatchHealth()
    col = wm.FleetCollector(fleet, conn, health)  # type: ignore[arg-type]

    build, om, txt, gz = [], [], [], []
    for _ in range(5):
        c0 = time.thread_time()
        fams = list(col.collect())
        build.append(time.thread_time() - c0)
        frozen = SimpleNamespace(collect=lambda fams=fams: iter(fams))
        c0 = time.thread_time()
        body = om_latest(frozen)
        om.append(time.thread_time() - c0)
        c0 = time.thread_time()
        generate_latest(frozen)  # type: ignore[arg-type]
        txt.append(time.thread_time() - c0)
        c0 = time.thread_time()
        gzip.compress(body)
        gz.append(time.thread_time() - c0)
    series = sum(len(f.samples) for f in fams)
    out(f"N={args.hosts}: {series} series, {len(body)} bytes of OpenMetrics")
    out(
        f"N={args.hosts}: CPU build p50 {ms(build, 0.5):.1f} ms; format OpenMetrics p50 {ms(om, 0.5):.1f} ms "
        f"({1e6 * statistics.median(om) / series:.1f} us a series), Prometheus text p50 {ms(txt, 0.5):.1f} ms; gzip p50 {ms(gz, 0.5):.1f} ms"
    )

    if args.live:  # the endpoint before issue 19's cache: prometheus_client's server, building and formatting at each scrape
        from prometheus_client import CollectorRegistry, start_http_server

        reg = CollectorRegistry(auto_describe=False)
        reg.register(col)
        server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
        port = server.server_address[1]
    else:
        server = wm.MetricsEndpoint(col, every_s=args.render_every)
        port = server.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"
    scrape(url)  # the first (a cached endpoint renders on it)

    def run(label: str) -> None:
        walls = []
        for _ in range(args.scrapes):
            time.sleep(args.every)
            w, _body = scrape(url)
            walls.append(w)
        out(
            f"N={args.hosts} {label}: {args.scrapes} scrapes (OpenMetrics, gzip), wall p50 {ms(walls, 0.5):.1f} ms, max {ms(walls, 1.0):.1f} ms"
        )

    label = "live (build + format per scrape)" if args.live else f"cached (rendered every {args.render_every:g} s)"
    run(f"{label}, quiet")
    if args.busy > 0:
        stop = threading.Event()

        def busy() -> None:  # a busy event loop: computes args.busy of each 10 ms, sleeps the rest
            while not stop.is_set():
                t = time.perf_counter() + 0.010 * args.busy
                while time.perf_counter() < t:
                    pass
                time.sleep(0.010 * (1 - args.busy))

        th = threading.Thread(target=busy, daemon=True)
        th.start()
        run(f"{label}, busy thread {args.busy:.0%}")
        stop.set()
        th.join()
    if not args.live:
        out(
            f"N={args.hosts} cached: {server.renders} renders, the last took {1000 * col.last_render_cpu_s:.1f} ms CPU "
            f"({1000 * col.last_render_s:.1f} ms wall) to build, format and gzip"
        )
    server.shutdown()


if __name__ == "__main__":
    main()
