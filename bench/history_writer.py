"""The console's history writer alone: N SIMULATED hosts' 12-hour journals into a fresh history.db (issue 33).

What ``bench/fleet.py``'s sync line cannot separate: the writer thread's own cost per event, without SSH, the event
loop or a live fleet beside it. One busy host's journal is written once through the real agent Journal (the stand-in's
template, bench/standin.py), read back, and handed to a real :class:`History` as every host's backlog: eight hosts at
a time (the console's CATCH_UP_AT_ONCE), each its whole journal as one batch, each host with its own name and epoch.
``--live-every S``: the hosts already in send one new event each every S seconds meanwhile, as caught-up hosts do.
``--busy N``: a second thread in the process meanwhile, in the place of the console's event loop: it reads and
changes N small objects at random (a working set the size of a big fleet's state) between decodes of a snapshot-like
message. Pin the process to one CPU (``taskset -c 0``) to see what sharing one core with such a loop costs the writer.

Prints the process's CPU and the writer thread's own CPU per event written, and the wall time.

Usage: python bench/history_writer.py --hosts 256,1024 [--live-every 10] [--hours 12] [--busy 1500000]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LANES = 8


def template_events(where: Path, hours: float) -> list:
    from bench import standin
    from gpudeck.agents.storage.journal import Journal

    path, _created, _step = standin.make_template(where / "template", hours, "8:H200:141", time.time())
    j = Journal(path, "template")
    try:
        return j.events_after(0, limit=10**8, wait=False)
    finally:
        j.close()


def busy_loop(objects: int, stop: threading.Event) -> None:
    """In the place of the console's loop: decode a snapshot-like message, touch objects of a large working set."""
    import msgspec

    blob = msgspec.json.encode(
        {
            "gpus": [
                {"index": i, "uuid": f"GPU-{i}", "used": 123456789 * i, "procs": [{"pid": p, "cmd": "python train.py"} for p in range(8)]}
                for i in range(8)
            ],
            "runs": [{"id": "r-1", "state": "running", "telemetry": {"step": 5, "loss": 1.5}}],
        }
    )
    state = [{"a": i, "b": str(i), "c": [i, i + 1], "d": {"x": float(i)}} for i in range(objects)]
    k = 0
    while not stop.is_set():
        for _ in range(50):
            snap = msgspec.json.decode(blob)
            sum(len(str(g)) for g in snap["gpus"])
        for j in range(2000):
            state[(k * 7919 + j * 104729) % objects]["a"] += 1
        k += 1


def run(n: int, events: list, live_every: float, base: Path, busy: int = 0) -> str:
    import msgspec

    from bench.fleet import writer_cpu_s
    from gpudeck.console.history.replica import History

    d = Path(tempfile.mkdtemp(prefix="history-writer-", dir=base))
    h = History(d / "history.db")
    order = iter(range(n))
    lock = threading.Lock()
    caught_up: dict[int, int] = {}
    last = events[-1]

    def lane() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            h.submit(f"sim{i:05d}", f"epoch-{i}", events).result()
            with lock:
                caught_up[i] = len(events)

    def live() -> None:
        while len(caught_up) < n:
            with lock:
                hosts = list(caught_up)
            for i in hosts:
                caught_up[i] += 1
                s = caught_up[i]
                h.submit(f"sim{i:05d}", f"epoch-{i}", [msgspec.structs.replace(last, seq=s, ts=last.ts + s)])
            time.sleep(live_every)

    threads = [threading.Thread(target=lane) for _ in range(LANES)]
    if live_every > 0:
        threads.append(threading.Thread(target=live))
    stop = threading.Event()
    if busy > 0:
        threading.Thread(target=busy_loop, args=(busy, stop), name="busy", daemon=True).start()
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    w0 = writer_cpu_s()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h.submit("sim-end", "end", []).result()  # queued last: every write before it is done
    wall = time.monotonic() - t0
    wcpu = writer_cpu_s() - w0
    stop.set()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    written = h.events_inserted
    size = (d / "history.db").stat().st_size
    h.close()
    shutil.rmtree(d, ignore_errors=True)
    return (
        f"history_writer N={n} SIMULATED hosts: {written} events written in {h.batches_committed} transactions, "
        f"{wall:.1f} s; CPU {cpu:.1f} s = {1e6 * cpu / max(written, 1):.2f} us per event ({written / max(wall, 1e-9):,.0f} events/s); "
        f"the writer thread {1e6 * wcpu / max(written, 1):.2f} us per event; history.db {size / 2**20:.0f} MiB; "
        f"busy loop {f'on, {busy} objects' if busy else 'off'}; live {'every ' + format(live_every, 'g') + ' s' if live_every > 0 else 'off'}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="256,1024", help="comma-separated host counts (default 256,1024)")
    ap.add_argument("--hours", type=float, default=12.0, help="hours of journal per host (default 12)")
    ap.add_argument("--live-every", type=float, default=0.0, help="seconds between caught-up hosts' live events (0: none)")
    ap.add_argument("--busy", type=int, default=0, help="a busy thread touching this many objects meanwhile (0: none; at most 10,000,000)")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.hosts.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--hosts {args.hosts!r}: give whole numbers separated by commas, e.g. 256,1024")
    if not sizes or any(n < 1 or n > 100_000 for n in sizes):
        ap.error("--hosts: each count must be 1..100000")
    if not 0 <= args.busy <= 10_000_000:
        ap.error("--busy: give 0..10000000 objects")
    if not 0 < args.hours <= 48:
        ap.error("--hours: give 0 < hours <= 48")
    base = Path(tempfile.mkdtemp(prefix="history-writer-bench-"))
    try:
        events = template_events(base, args.hours)
        print(f"history_writer one SIMULATED busy host's {args.hours:g} h journal: {len(events)} events", flush=True)
        for n in sizes:
            print(run(n, events, args.live_every, base, args.busy), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
