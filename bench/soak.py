"""Benchmark (issue 7): the console following a 256-host fleet for minutes, with runs starting and ending and ~1,000 events/s.

The fleet is :class:`bench.fleet_hosts.FleetHosts` (real agent processes with
SIMULATED GPUs behind one asyncssh in-process SSH server; not OpenSSH). One
console process — ``Fleet(..., interval_s=1.0, history=History(tmp))``, as
the TUI runs it — follows every host and launches the load through the Fleet:
short runs on random hosts (``python -c`` programs that append telemetry
``checkpoint`` records to ``$GPUDECK_TELEMETRY`` at a fixed rate and a
``done`` record at the end). The agents journal every checkpoint record (steps
would be thinned to one per 10 s), so the runs' combined rate is the event
rate into the journals, and the console's history sync carries it into
``history.db``. Enough runs are kept live for ``--events-per-s`` overall.

Every ``--sample-s`` the console process reports: events/s inserted into the
history (and the agents' own journaling rate and the backlog: events the
history is behind, replies decoded but not consumed yet), the history file's
size, its CPU share and how long its event-loop thread waited for a CPU (so
starvation by the machine's load shows), RSS (anonymous / file-backed) and
live Python blocks, p50/p99 snapshot age at arrival, live and launched runs;
the bench adds the farm's, the agents' and the machine's CPU over the same
interval. At the end: least-squares slopes of RSS (MiB/min) and CPU (points of
one core per minute) over the intervals after the first (start-up), and again
over the intervals without a backlog; the runs the history still shows live
after every agent reported none (runs an agent lost track of); and a
completeness check of the history: for every host, ``History.seqs(host,
epoch)`` must be exactly ``1..`` the agent's last seq (0 gaps, 0 duplicates).

Usage: python bench/soak.py [--hosts 256] [--minutes 10] [--events-per-s 1000] [--run-rate 25] [--run-seconds 60]
                            [--sample-s 30] [--tracemalloc] [--keep]
Prints one line per figure (prefix ``soak``) and one per interval.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil

from bench.fleet import UP_TIMEOUT_S, AgeRecorder, emit, pct
from bench.fleet_hosts import (
    FleetHosts,
    FleetSpec,
    FleetStartError,
    cpu_seconds,
    rss_bytes,
    rss_parts,
    runqueue_wait_s,
    start_worker,
    stop_on_signals,
    worker_messages,
)

MIB = 1 << 20
MAX_LAUNCHES_IN_FLIGHT = 8

# a run: `rate` checkpoint records a second for `seconds`, then `done` (stdlib only, like trainers/common/telemetry.py)
WRITER = r"""
import json, os, sys, time
rate, dur = float(sys.argv[1]), float(sys.argv[2])
fh = open(os.environ["GPUDECK_TELEMETRY"], "a", buffering=1)
t0 = time.time()
i = 0
while True:
    el = time.time() - t0
    if el >= dur:
        break
    due = int(el * rate)
    while i < due:
        i += 1
        fh.write(json.dumps({"ts": time.time(), "rank": 0, "type": "checkpoint", "step": i, "path": "ckpt/step_%d" % i, "seconds": 0.0}) + "\n")
    time.sleep(0.1)
fh.write(json.dumps({"ts": time.time(), "rank": 0, "type": "done", "final_step": i}) + "\n")
"""


class LogHistogram:
    """Quantiles of a long series in fixed memory (1% bins from 1 us to 1000 s), so the bench itself does not grow."""

    LO = 1e-6
    STEP = 1.01

    def __init__(self) -> None:
        self.bins = array("q", bytes(8 * (int(math.log(1e9) / math.log(self.STEP)) + 2)))
        self.n = 0
        self.max = float("nan")

    def add(self, xs: list[float]) -> None:
        """Count these values."""
        top = len(self.bins) - 1
        for x in xs:
            i = 0 if x <= self.LO else min(top, int(math.log(x / self.LO) / math.log(self.STEP)) + 1)
            self.bins[i] += 1
            self.n += 1
            self.max = x if not self.max >= x else self.max

    def quantile(self, q: float) -> float:
        """The upper edge of the bin holding the q-quantile (at most 1% above the true value); NaN when empty."""
        if not self.n:
            return float("nan")
        want = q * (self.n - 1) + 1
        run = 0
        for i, c in enumerate(self.bins):
            run += c
            if run >= want:
                return self.LO * self.STEP**i
        return self.max


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (NaN with fewer than two points)."""
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


# ----------------------------------------------------------------------------- the console process


@dataclass
class Launcher:
    """Keeps enough short telemetry-writing runs live, on random hosts, for the target event rate."""

    fleet: Any
    names: list[str]
    cwd: str
    events_per_s: float
    run_rate: float
    run_seconds: float
    launched: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    launch_s: list[float] = field(default_factory=list)
    _ends: dict[int, float] = field(default_factory=dict)  # run number -> when it is expected to have ended
    _inflight: set[asyncio.Task] = field(default_factory=set)
    _k: int = 0

    @property
    def target_live(self) -> int:
        return max(1, round(self.events_per_s / self.run_rate))

    async def _launch_one(self, k: int, dur: float) -> None:
        from gpudeck.agents.wire.errors import AgentError
        from gpudeck.agents.wire.protocol import LaunchSpec

        host = random.choice(self.names)
        # force: the simulated GPUs show every GPUDECK_SIM_GPU_MEM process of this machine, other tests' holders included,
        # and the pre-flight rightly refuses those; the load here needs no GPU memory (force is recorded in the run)
        spec = LaunchSpec(
            argv=[sys.executable, "-c", WRITER, str(self.run_rate), f"{dur:.1f}"],
            name=f"soak-{k}",
            kind="command",
            cwd=self.cwd,
            force=True,
        )
        t0 = time.monotonic()
        try:
            reply = await self.fleet.launch(host, spec, request_id=f"soak-{os.getpid()}-{k}")
            if reply.run.state in ("failed", "preflight_failed"):
                raise AgentError(f"{reply.run.state}: {reply.run.cause}")
            self.launched += 1
            self.launch_s.append(time.monotonic() - t0)
            self._ends[k] = time.monotonic() + dur + 0.5  # it writes for `dur` from about now
        except AgentError as exc:
            self._ends.pop(k, None)
            self.failed += 1
            if len(self.errors) < 5:
                self.errors.append(f"{host}: {exc.message}")

    async def run(self) -> None:
        """Launch whenever fewer than the target are live (at most a few launches in flight)."""
        while True:
            now = time.monotonic()
            for k in [k for k, e in self._ends.items() if e <= now]:
                del self._ends[k]
            while len(self._ends) < self.target_live and len(self._inflight) < MAX_LAUNCHES_IN_FLIGHT:
                self._k += 1
                dur = random.uniform(0.5 * self.run_seconds, 1.5 * self.run_seconds)
                self._ends[self._k] = now + dur + 60.0  # counted live from the request on; set properly when it has started
                t = asyncio.ensure_future(self._launch_one(self._k, dur))
                self._inflight.add(t)
                t.add_done_callback(self._inflight.discard)
            await asyncio.sleep(0.2)

    async def drain(self) -> None:
        """Wait for launches in flight."""
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)


def _history_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(str(path) + "-wal"), Path(str(path) + "-shm")) if p.exists())


async def soak_worker(spec: FleetSpec, args: argparse.Namespace) -> None:
    """The console side of the soak: a Fleet with a History, launching the load, reporting every interval."""
    from gpudeck.console.fleet.fleet import Fleet
    from gpudeck.console.history.replica import History

    hdir = Path(tempfile.mkdtemp(prefix="console-soak-", dir=str(spec.base_dir)))
    hpath = hdir / "history.db"
    hist = History(hpath)
    fleet = Fleet(config=spec.config(), ssh=spec.ssh_options(), interval_s=1.0, history=hist)
    rec = AgeRecorder(on=True)
    for name, link in fleet.links.items():
        link.subscribe(rec.callback(name))
    t0 = time.monotonic()
    fleet.start()
    n = len(fleet.links)
    while time.monotonic() - t0 < UP_TIMEOUT_S:
        if all(ln.status.state == "up" for ln in fleet.links.values()):
            break
        await asyncio.sleep(0.2)
    up = sum(ln.status.state == "up" for ln in fleet.links.values())
    emit("up", up=up, n=n, seconds=time.monotonic() - t0)
    await asyncio.sleep(3.0)

    launcher = Launcher(fleet, list(spec.names), str(spec.base_dir), args.events_per_s, args.run_rate, args.run_seconds)
    me = psutil.Process()
    all_ages = LogHistogram()
    rec.take()
    connects0 = sum(ln.status.connects for ln in fleet.links.values())
    start = time.monotonic()
    prev_t, prev_cpu, prev_wait = start, time.process_time(), runqueue_wait_s()
    base_snap = None
    if args.tracemalloc:
        tracemalloc.start(6)
    prev_ins = hist.events_inserted

    def queued() -> int:
        # replies the agents sent that the console has decoded but not consumed yet (AgentClient's per-request
        # queues; private state, read here only to show where memory goes when the console falls behind)
        return sum(q.qsize() for ln in fleet.links.values() if ln._client is not None for q in list(ln._client._waiters.values()))

    def journaled() -> int:
        return sum(ln.status.snapshot.last_seq for ln in fleet.links.values() if ln.status.snapshot is not None)

    prev_j = journaled()
    prev_launched = prev_failed = 0
    emit("soak_start", target_live=launcher.target_live)
    ltask = asyncio.ensure_future(launcher.run())
    end = start + args.minutes * 60.0
    while True:
        now = time.monotonic()
        if now >= end - 1e-3:
            break
        await asyncio.sleep(min(args.sample_s, end - now))
        t, cpu, wait, ins, j = time.monotonic(), time.process_time(), runqueue_wait_s(), hist.events_inserted, journaled()
        if args.tracemalloc:
            if base_snap is None:
                base_snap = tracemalloc.take_snapshot()  # after the first interval: start-up allocations are behind
        ages, _ = rec.take()
        all_ages.add(ages)
        dt = t - prev_t
        live = sum(len(ln.status.snapshot.runs) for ln in fleet.links.values() if ln.status.snapshot is not None)
        # a streamed snapshot's last_seq can be a second older than the sync's cursor: count only hosts behind it
        lag = sum(
            max(0, ln.status.snapshot.last_seq - ln.status.synced_seq) for ln in fleet.links.values() if ln.status.snapshot is not None
        )
        emit(
            "interval",
            t=t - start,
            dt=dt,
            events_per_s=(ins - prev_ins) / dt,
            journaled_per_s=(j - prev_j) / dt,
            lag_events=lag,
            queued=queued(),
            history_bytes=_history_bytes(hpath),
            history_events=ins,
            cpu_pct=100.0 * (cpu - prev_cpu) / dt,
            wait_ms_per_s=1000.0 * (wait - prev_wait) / dt,
            rss=me.memory_info().rss,
            rss_parts=rss_parts(),
            py_blocks=sys.getallocatedblocks(),  # Python objects alive (free to read, unlike tracemalloc)
            traced=tracemalloc.get_traced_memory()[0] if args.tracemalloc else None,
            age_p50=pct(ages, 0.5),
            age_p99=pct(ages, 0.99),
            ages=len(ages),
            live_runs=live,
            launched=launcher.launched - prev_launched,
            failed=launcher.failed - prev_failed,
            up=sum(ln.status.state == "up" for ln in fleet.links.values()),
        )
        prev_t, prev_cpu, prev_wait, prev_ins, prev_j = t, cpu, wait, ins, j
        prev_launched, prev_failed = launcher.launched, launcher.failed

    if args.tracemalloc and base_snap is not None:
        diff = tracemalloc.take_snapshot().compare_to(base_snap, "traceback")
        for d in diff[:12]:
            frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(list(d.traceback)[-5:]))  # innermost first
            emit("tracemalloc_top", size_diff=d.size_diff, count_diff=d.count_diff, where=frames)
        tracemalloc.stop()
    # the load stops; the runs end by themselves; then every host's journal must be in the history, exactly
    ltask.cancel()
    try:
        await ltask
    except asyncio.CancelledError:
        pass
    await launcher.drain()
    settle0 = time.monotonic()
    while time.monotonic() - settle0 < 1.5 * args.run_seconds + 90:
        if all(ln.status.snapshot is not None and not ln.status.snapshot.runs for ln in fleet.links.values()):
            break
        await asyncio.sleep(1.0)
    runs_ended_s = time.monotonic() - settle0
    last: dict[str, int] = {}
    epochs: dict[str, str] = {}
    errors: list[str] = []
    snaps = await asyncio.gather(*(fleet.snapshot(h) for h in spec.names), return_exceptions=True)
    for h, s in zip(spec.names, snaps):
        if isinstance(s, BaseException):
            errors.append(f"{h}: {s}")
        else:
            last[h] = s.last_seq
            epochs[h] = s.epoch
    sync0 = time.monotonic()
    while time.monotonic() - sync0 < 180:
        if all(fleet.links[h].status.synced_seq >= last[h] for h in last):
            break
        await asyncio.sleep(0.5)
    synced_s = time.monotonic() - sync0
    await asyncio.sleep(1.0)  # the writer's last commit

    def check() -> dict[str, Any]:
        gaps = dups = extra = bad_hosts = total = 0
        epoch_mismatch = 0
        for h, lst in last.items():
            if fleet.links[h].status.epoch != epochs[h]:
                epoch_mismatch += 1
            seqs = hist.seqs(h, epochs[h])
            total += len(seqs)
            uniq = set(seqs)
            d = len(seqs) - len(uniq)
            g = sum(1 for s in range(1, lst + 1) if s not in uniq)
            x = sum(1 for s in uniq if s > lst or s < 1)
            dups += d
            gaps += g
            extra += x
            if d or g or x:
                bad_hosts += 1
        states: dict[str, int] = {}
        stuck: list[str] = []
        for r in hist.query("name:~soak- limit:1000000"):
            states[r["state"]] = states.get(r["state"], 0) + 1
            if r["state"] in ("pending", "starting", "running", "stopping"):
                # every agent reports no live run now: a live row here is a run the agent lost track of
                kinds = [f"{e['kind']}:{e['data'].get('state', '')}" for e in hist.events(r["host"], r["id"]) if e["kind"] == "run_state"]
                stuck.append(f"{r['host']}/{r['id']} state changes {' -> '.join(kinds)}")
        return {
            "hosts_checked": len(last),
            "events": total,
            "agent_events": sum(last.values()),
            "gaps": gaps,
            "duplicates": dups,
            "beyond_last": extra,
            "bad_hosts": bad_hosts,
            "epoch_mismatch": epoch_mismatch,
            "run_states": states,
            "stuck": stuck,
        }

    result = await asyncio.to_thread(check)
    connects1 = sum(ln.status.connects for ln in fleet.links.values())
    emit(
        "complete",
        **result,
        errors=errors[:5],
        runs_ended_s=runs_ended_s,
        synced_s=synced_s,
        reconnects=connects1 - connects0,
        launched=launcher.launched,
        launch_failed=launcher.failed,
        launch_errors=launcher.errors,
        launch_p50=pct(launcher.launch_s, 0.5),
        launch_p99=pct(launcher.launch_s, 0.99),
        age_p50=all_ages.quantile(0.5),
        age_p99=all_ages.quantile(0.99),
        age_max=all_ages.max,
        ages=all_ages.n,
        history_bytes=_history_bytes(hpath),
    )
    await fleet.close()
    hist.close()


# ----------------------------------------------------------------------------- the bench process


def out(text: str) -> None:
    """One result line."""
    print(f"soak {text}", flush=True)


def _busy() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=256)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--events-per-s", type=float, default=1000.0, help="telemetry events a second into the journals, all hosts together")
    ap.add_argument("--run-rate", type=float, default=25.0, help="checkpoint records a second each run writes")
    ap.add_argument("--run-seconds", type=float, default=60.0, help="mean run length (uniform in 0.5x..1.5x)")
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--gpus", default="8:H200")
    ap.add_argument(
        "--tracemalloc",
        action="store_true",
        help="trace the console's allocations (slower) and print what grew from the first interval to the end",
    )
    ap.add_argument("--keep", action="store_true", help="keep the fleet's folder (journals, history) for a look afterwards")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        asyncio.run(soak_worker(FleetSpec.load(args.spec), args))
        return

    stop_on_signals()
    out(
        f"machine: {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.1f} GiB; {args.hosts} hosts, SIMULATED GPUs ({args.gpus} each), "
        f"SSH server side asyncssh in-process (not OpenSSH); {args.minutes:g} min, target {args.events_per_s:g} events/s "
        f"({args.run_rate:g} records/s per run, runs of {0.5 * args.run_seconds:.0f}-{1.5 * args.run_seconds:.0f} s); load average at start "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    try:
        fh = FleetHosts(
            args.hosts, args.gpus, keep=args.keep, progress=lambda m: print(f"soak (progress) {m}", file=sys.stderr, flush=True)
        )
    except FleetStartError as exc:
        out(f"COULD NOT BRING UP {args.hosts} hosts: {exc}")
        sys.exit(1)
    try:
        assert fh.spec is not None
        out(f"fleet up in {fh.start_seconds:.1f} s: {args.hosts} agents ({rss_bytes(fh.agent_pids) / MIB:.0f} MiB RSS together) + SSH farm")
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--spec",
            str(fh.spec.path),
            "--minutes",
            str(args.minutes),
            "--events-per-s",
            str(args.events_per_s),
            "--run-rate",
            str(args.run_rate),
            "--run-seconds",
            str(args.run_seconds),
            "--sample-s",
            str(args.sample_s),
        ] + (["--tracemalloc"] if args.tracemalloc else [])
        proc = start_worker(argv, fh.base_dir / "soak-worker.stderr")
        series: list[dict[str, Any]] = []
        complete: dict[str, Any] | None = None
        prev = None
        for msg in worker_messages(proc):
            ev = msg.get("ev")
            now = (time.monotonic(), cpu_seconds([fh.farm_pid]), cpu_seconds(fh.agent_pids), _busy(), runqueue_wait_s(fh.agent_pids))
            if ev == "up":
                out(f"console: {msg['up']}/{msg['n']} hosts up after {msg['seconds']:.1f} s")
            elif ev == "soak_start":
                out(f"load: keeping {msg['target_live']} runs live")
                prev = now
            elif ev == "interval" and prev is not None:
                dt = now[0] - prev[0]
                msg["farm_cores"] = (now[1] - prev[1]) / dt
                msg["agents_cores"] = (now[2] - prev[2]) / dt
                msg["machine_cores"] = (now[3] - prev[3]) / dt
                msg["agent_wait_ms_per_s"] = 1000.0 * (now[4] - prev[4]) / (dt * len(fh.agent_pids))
                msg["load1"] = os.getloadavg()[0]
                prev = now
                series.append(msg)
                out(
                    f"t={msg['t']:5.0f}s events/s into history {msg['events_per_s']:7.1f} (agents journaled {msg['journaled_per_s']:7.1f}/s, lag {msg['lag_events']} events, {msg['queued']} replies queued in the console) "
                    f"history {msg['history_bytes'] / MIB:7.1f} MiB  console CPU {msg['cpu_pct']:5.1f}% (loop thread waited for a CPU {msg['wait_ms_per_s']:4.0f} ms/s) "
                    f"RSS {msg['rss'] / MIB:6.1f} MiB (anon {msg['rss_parts']['RssAnon'] / MIB:.1f}, file {msg['rss_parts']['RssFile'] / MIB:.1f}, shmem {msg['rss_parts']['RssShmem'] / MIB:.1f}"
                    + (f", Python heap traced {msg['traced'] / MIB:.1f}" if msg.get("traced") is not None else "")
                    + f", {msg['py_blocks']} Python blocks)  "
                    f"age p50 {1000 * msg['age_p50']:6.1f} ms p99 {1000 * msg['age_p99']:7.1f} ms (n={msg['ages']})  runs live {msg['live_runs']} "
                    f"launched {msg['launched']} failed {msg['failed']} up {msg['up']}  farm {msg['farm_cores']:.2f} agents {msg['agents_cores']:.2f} "
                    f"(each main thread waited {msg['agent_wait_ms_per_s']:.0f} ms/s) machine {msg['machine_cores']:.2f}/{psutil.cpu_count()} cores, load {msg['load1']:.1f}"
                )
            elif ev == "tracemalloc_top":
                out(f"tracemalloc grew {msg['size_diff'] / 1024:+.0f} KiB ({msg['count_diff']:+d} blocks) at {msg['where']}")
            elif ev == "complete":
                complete = msg
        proc.wait(300)
        if complete is None:
            tail = (fh.base_dir / "soak-worker.stderr").read_text(errors="replace")[-3000:]
            out(f"FAILED: the console worker exited {proc.returncode} before the end: {tail}")
            sys.exit(1)
        summarize(series, complete, args)
        if args.keep:
            out(f"kept {fh.base_dir}")
    finally:
        fh.close()


def summarize(series: list[dict[str, Any]], c: dict[str, Any], args: argparse.Namespace) -> None:
    """The figures of the whole soak."""
    steady = series[1:] if len(series) > 1 else series  # the first interval holds the start-up
    if steady:
        ev = [s["events_per_s"] for s in steady]
        out(
            f"events/s sustained into history: mean {statistics.fmean(ev):.1f}, min {min(ev):.1f}, max {max(ev):.1f} over {len(steady)} intervals "
            f"after the first (target {args.events_per_s:g}); agents journaled mean {statistics.fmean(s['journaled_per_s'] for s in steady):.1f}/s"
        )
        out(f"history lag at the samples: max {max(s['lag_events'] for s in steady)} events behind the agents' journals")
        xs = [s["t"] / 60.0 for s in steady]
        rss = [s["rss"] / MIB for s in steady]
        cpu = [s["cpu_pct"] for s in steady]
        out(
            f"console RSS: {rss[0]:.1f} MiB at t={steady[0]['t']:.0f}s, {rss[-1]:.1f} MiB at the end, max {max(rss):.1f}; least-squares slope {slope(xs, rss):+.3f} MiB/min"
        )
        anon = [s["rss_parts"]["RssAnon"] / MIB for s in steady]
        filed = [s["rss_parts"]["RssFile"] / MIB + s["rss_parts"]["RssShmem"] / MIB for s in steady]
        line = f"console RSS parts: anonymous {anon[0]:.1f} -> {anon[-1]:.1f} MiB (slope {slope(xs, anon):+.3f} MiB/min), file+shmem {filed[0]:.1f} -> {filed[-1]:.1f} MiB (slope {slope(xs, filed):+.3f})"
        blocks = [s["py_blocks"] / 1000 for s in steady]
        line += f"; Python blocks allocated {blocks[0]:.0f}k -> {blocks[-1]:.0f}k (slope {slope(xs, blocks):+.1f}k/min)"
        if steady[0].get("traced") is not None:
            tr = [s["traced"] / MIB for s in steady]
            line += f"; Python heap (tracemalloc) {tr[0]:.1f} -> {tr[-1]:.1f} MiB (slope {slope(xs, tr):+.3f})"
        out(line)
        calm = [s for s in steady if s["lag_events"] == 0 and s["queued"] <= 1]
        if len(calm) >= 2:
            cx = [s["t"] / 60.0 for s in calm]
            out(
                f"console over the {len(calm)} intervals with no backlog (lag 0, nothing queued): RSS {calm[0]['rss'] / MIB:.1f} -> {calm[-1]['rss'] / MIB:.1f} MiB, "
                f"slope {slope(cx, [s['rss'] / MIB for s in calm]):+.3f} MiB/min; Python blocks slope {slope(cx, [s['py_blocks'] / 1000 for s in calm]):+.1f}k/min; "
                f"CPU mean {statistics.fmean(s['cpu_pct'] for s in calm):.1f}%, slope {slope(cx, [s['cpu_pct'] for s in calm]):+.3f} points/min; "
                f"events/s mean {statistics.fmean(s['events_per_s'] for s in calm):.1f}; snapshot age p99 max {1000 * max(s['age_p99'] for s in calm):.1f} ms"
            )
        out(
            f"console CPU: mean {statistics.fmean(cpu):.1f}% of one core, max {max(cpu):.1f}%; least-squares slope {slope(xs, cpu):+.3f} points/min"
        )
        out(
            f"CPU starvation: the console's event-loop thread waited for a CPU {statistics.fmean(s['wait_ms_per_s'] for s in steady):.0f} ms/s on average "
            f"(max {max(s['wait_ms_per_s'] for s in steady):.0f}); each agent's main thread {statistics.fmean(s['agent_wait_ms_per_s'] for s in steady):.0f} ms/s "
            f"(max {max(s['agent_wait_ms_per_s'] for s in steady):.0f})"
        )
        out(
            f"snapshot age p99 per interval: max {1000 * max(s['age_p99'] for s in steady):.1f} ms, median {1000 * statistics.median(s['age_p99'] for s in steady):.1f} ms"
        )
        out(
            f"machine: mean {statistics.fmean(s['machine_cores'] for s in steady):.2f} cores busy (farm {statistics.fmean(s['farm_cores'] for s in steady):.2f}, "
            f"agents {statistics.fmean(s['agents_cores'] for s in steady):.2f}); load average max {max(s['load1'] for s in steady):.1f}"
        )
    out(
        f"snapshot age over the whole soak: p50 {1000 * c['age_p50']:.1f} ms, p99 {1000 * c['age_p99']:.1f} ms, max {1000 * c['age_max']:.1f} ms (n={c['ages']})"
    )
    out(
        f"history size at the end: {c['history_bytes'] / MIB:.1f} MiB for {c['events']} events ({c['history_bytes'] / max(1, c['events']):.0f} bytes/event, db+wal)"
    )
    out(
        f"runs: {c['launched']} launched, {c['launch_failed']} launches failed {c['launch_errors'] or ''}; launch round trip p50 {1000 * c['launch_p50']:.0f} ms, "
        f"p99 {1000 * c['launch_p99']:.0f} ms; in the history by state: {c['run_states']}; all ended {c['runs_ended_s']:.0f} s after the load stopped"
    )
    if c["stuck"]:
        out(f"runs the history still shows live after every agent reported none: {len(c['stuck'])}: " + "; ".join(c["stuck"][:5]))
    verdict = (
        "COMPLETE"
        if c["gaps"] == 0
        and c["duplicates"] == 0
        and c["beyond_last"] == 0
        and c["bad_hosts"] == 0
        and not c["errors"]
        and c["epoch_mismatch"] == 0
        else "INCOMPLETE"
    )
    out(
        f"history completeness: {verdict}: {c['hosts_checked']} hosts, {c['events']} events held vs {c['agent_events']} in the agents' journals; "
        f"{c['gaps']} gaps, {c['duplicates']} duplicates, {c['beyond_last']} beyond the agent's last seq, {c['bad_hosts']} hosts off, "
        f"{c['epoch_mismatch']} epoch changes, {c['reconnects']} reconnects; synced {c['synced_s']:.1f} s after the runs ended"
        + (f"; snapshot errors: {c['errors']}" if c["errors"] else "")
    )


if __name__ == "__main__":
    main()
