"""Benchmark (issue 3): one console process following N hosts — gpudeck's snapshot stream against exec-per-tick polling.

For each N (default 16, 64, 256) a loopback fleet is brought up with
:class:`bench.fleet_hosts.FleetHosts`: N real agent processes with SIMULATED
GPUs (``8:H200`` each by default) behind one asyncssh in-process SSH server
process (not OpenSSH; see that module). Then, each in its own console process
so that process's CPU is measured alone:

- **gpudeck**: ``Fleet(config, ssh, interval_s=1.0, history=History(tmp))``
  following every host — one long-lived SSH connection per host running
  ``gpudeck agent dial``, the agent's pushed snapshot stream and its event
  journal into the history.
- **exec-per-tick** (the peer, gpustat-web's design): one asyncssh connection
  per host and, every second per host (the hosts staggered evenly across the
  second), one ``conn.run("gpudeck status --json")`` whose JSON is parsed
  with ``json.loads``.
- **exec-aligned**: the same peer with every host polled at the same instant
  of each tick (gpustat-web's per-host loops all start together; staggered is
  where they drift to). gpudeck's agents send on the wall clock's whole
  seconds, so its snapshots arrive in one burst a second too; the peer is
  measured both ways.
- **ssh-floor**: not a design but a yardstick: the stream gpudeck's console
  gets (the same connections, the agent bridge, the agent's compact snapshot
  stream) with a session that only counts the lines. What gpudeck costs over
  it is its own code; what a peer costs over it is the most any design that
  sends one SSH message per host per tick through asyncssh could beat it by.

Over a window of ``--seconds`` after every host is up, each prints: console
CPU per host-second (CPU seconds / (N x window)), the console's share of one
core, RSS, snapshot age at arrival (arrival wall time - ``snapshot.ts``; one
machine, one clock) p50/p99, and snapshots received against those expected;
then the ratio of CPU per host-second (exec-per-tick / gpudeck). The farm,
the agents and the machine's load over the same window are printed too: all
of them share this machine's cores with the console, so read the figures
with that line.

Host side: the agent's cost per snapshot (the snapshots' own ``sample_ms``,
and the agents' CPU over the window from psutil) against what exec-per-tick
costs a host per tick: an exec of ``python -m gpudeck.console.cli.main status --host local
--json`` against one of the agents (wall time and CPU of the process). gpustat
cannot run here (it needs NVML); its H200 figure from bench/RESULTS.md is
printed as a reference, not as a measurement of this run.

**watch** mode (``--designs watch,gpudeck``, issue 19): ``gpudeck watch``'s :class:`Watcher` (the same Fleet and
history sync, a notification rule, the metrics endpoint on loopback) following every host, scraped every
``--scrape-every`` seconds (5) by this process over the window: the watcher's CPU (share of one core; the goal is
under 5%), each scrape's wall time (the goal is under 100 ms) and the series it returned; the ``gpudeck`` design
(the console's Fleet alone) in the same run is its peer: the ratio says what the watcher adds.

Usage: python bench/fleet.py [--hosts 16,64,256] [--seconds 30] [--gpus 8:H200] [--execs 10]
                             [--ciphers ALG] [--profile | --py-spy PATH]
(``--profile``: cProfile of each console worker; ``--py-spy``: sampled, GIL-holding stacks summarised by package.)
Prints one line per figure (prefix ``fleet_bench``); ratios are peer / gpudeck.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import gzip
import io
import json
import os
import pstats
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil

from bench.fleet_hosts import (
    DIAL_COMMAND,
    FleetHosts,
    FleetSpec,
    FleetStartError,
    cpu_seconds,
    pin,
    pin_options,
    rss_bytes,
    runqueue_wait_s,
    start_worker,
    stop_on_signals,
    worker_messages,
)

STATUS_COMMAND = "gpudeck status --json"
UP_TIMEOUT_S = 300.0
WARM_S = 3.0  # after every host is up, before the window: the first snapshots and history syncs are past
GPUSTAT_REFERENCE = "gpustat --json, one exec: 743.5 ms mean, 771.8 ms p99 on one H200 (bench/RESULTS.md section 1; issue 3 quotes 515 ms)"
MIB = 1 << 20


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs, nearest rank; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def emit(ev: str, **data: Any) -> None:
    """One line of the worker -> parent protocol on stdout."""
    print(json.dumps({"ev": ev, **data}), flush=True)


# ----------------------------------------------------------------------------- console workers


@dataclass
class AgeRecorder:
    """Snapshot ages at arrival at the console, per host, while ``on``."""

    on: bool = False
    ages: list[float] = field(default_factory=list)
    sample_ms: list[float] = field(default_factory=list)
    # the fidelity check's inputs: each snapshot's send offset after its whole second (its own ``ts``), its arrival
    # offset after that second (as the console sees it); sizes are read from each host's last snapshot after the
    # window (encoding every one inside it would add to the console CPU being measured)
    ts_offsets: list[float] = field(default_factory=list)
    arrival_offsets: list[float] = field(default_factory=list)
    # how the snapshots bunch at the console: each one's arrival (wall clock, s), and how many were taken in each
    # event-loop pass (a pass that takes one opens a "wake-up", closed by a call_soon that runs in the next pass)
    arrivals: list[float] = field(default_factory=list)
    wakes: list[int] = field(default_factory=list)
    seen: int = 0  # new snapshots received, on or not
    _wake_open: bool = False
    _last: dict[str, object] = field(default_factory=dict)

    def callback(self, name: str):  # type: ignore[no-untyped-def]
        """A HostLink listener: records each new snapshot once (state changes repeat the last one)."""

        def on_status(status) -> None:  # type: ignore[no-untyped-def]
            snap = status.snapshot
            if snap is None or self._last.get(name) is snap:
                return
            self._last[name] = snap
            self.seen += 1
            if self.on:
                now = time.time()
                self.ages.append(now - snap.ts)
                self.sample_ms.append(snap.sample_ms)
                second = round(snap.ts)  # the whole second it was sent for (an offset past 0.5 s reads as early)
                self.ts_offsets.append(snap.ts - second)
                self.arrival_offsets.append(now - second)
                self.arrivals.append(now)
                if not self._wake_open:
                    self._wake_open = True
                    self.wakes.append(0)
                    asyncio.get_running_loop().call_soon(self._close_wake)
                self.wakes[-1] += 1

        return on_status

    def _close_wake(self) -> None:
        self._wake_open = False

    def take(self) -> tuple[list[float], list[float]]:
        """The ages and sample_ms recorded so far, cleared."""
        a, s = self.ages, self.sample_ms
        self.ages, self.sample_ms = [], []
        return a, s

    def take_shape(self) -> dict[str, Any]:
        """The fidelity inputs recorded so far (offsets in seconds, per snapshot), cleared."""
        from gpudeck.agents.wire.protocol import encode

        # each host's last snapshot as the console holds it (decoded; compact streams expanded), encoded again
        shapes = [(len(encode(sn)), len(sn.gpus), len(sn.processes), len(sn.runs)) for sn in self._last.values()]  # type: ignore[attr-defined]
        got = {
            "ts_offsets": self.ts_offsets,
            "arrival_offsets": self.arrival_offsets,
            "shapes": shapes,
            "arrivals": self.arrivals,
            "wakes": self.wakes,
        }
        self.ts_offsets, self.arrival_offsets, self.arrivals, self.wakes = [], [], [], []
        return got


class Window:
    """The console process's own CPU, RSS and wall time over a window. Nothing of the harness runs inside it: the
    peak RSS is the kernel's (getrusage), not a sampler that would wake the process every second and count its own
    CPU as the console's (it was 0.2 ms a second, 15% of gpudeck's console at 16 hosts)."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.gc_s = [0.0, 0.0, 0.0]  # time in the cyclic collector over the window, by generation
        self._gc_t0 = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0:
            self.gc_s[info["generation"]] += time.perf_counter() - self._gc_t0
            self._gc_t0 = 0.0

    def start(self) -> None:
        self.cpu0 = time.process_time()  # every thread of this process, in ns (psutil's cpu_times count 10 ms ticks)
        self.ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self.wait0 = runqueue_wait_s()
        self.io0 = _proc_io()
        self.t0 = time.monotonic()
        gc.callbacks.append(self._on_gc)

    def stop(self) -> dict[str, float]:
        cpu = time.process_time()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.monotonic() - self.t0
        io1 = _proc_io()
        gc.callbacks.remove(self._on_gc)
        rss = self.proc.memory_info().rss
        return {
            # the kernel's counts over the window: read/write system calls and their bytes (sockets and files),
            # and how often the process went to sleep (voluntary switches: one per wake-up of an idle loop)
            "io": {k: io1[k] - self.io0.get(k, 0) for k in io1},
            "cpu_s": cpu - self.cpu0,
            "sys_s": ru.ru_stime - self.ru0.ru_stime,
            "gc_s": self.gc_s,
            "rq_wait_s": runqueue_wait_s() - self.wait0,
            "wall_s": wall,
            "rss": rss,
            "rss_max": max(rss, ru.ru_maxrss * 1024),
        }


def _proc_io() -> dict[str, int]:
    """This process's read/write system calls and bytes (/proc/self/io) and its context switches (all threads)."""
    got: dict[str, int] = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, val = line.partition(":")
            if key in ("syscr", "syscw", "rchar", "wchar"):
                got[key] = int(val)
    except OSError:
        pass
    cs = psutil.Process().num_ctx_switches()
    got["vcs"], got["ivcs"] = cs.voluntary, cs.involuntary
    return got


def _profile_text(prof: cProfile.Profile, limit: int = 30) -> str:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(limit)
    st.sort_stats("cumulative").print_stats(limit)
    return buf.getvalue()


async def wait_up(fleet: Any, t0: float) -> None:
    """Wait until every link of ``fleet`` is up (or UP_TIMEOUT_S from ``t0``), then emit ``up`` with the states and errors."""
    n = len(fleet.links)
    up = 0
    while time.monotonic() - t0 < UP_TIMEOUT_S:
        up = sum(ln.status.state == "up" for ln in fleet.links.values())
        if up == n:
            break
        await asyncio.sleep(0.2)
    states: dict[str, int] = {}
    for ln in fleet.links.values():
        states[ln.status.state] = states.get(ln.status.state, 0) + 1
    errors = sorted({ln.status.error for ln in fleet.links.values() if ln.status.state != "up" and ln.status.error})[:3]
    some = next((ln._ssh_link for ln in fleet.links.values() if ln._ssh_link is not None), None)
    cipher = some.conn.get_extra_info("recv_cipher") if some is not None else None
    emit("up", up=up, n=n, seconds=time.monotonic() - t0, states=states, errors=errors, cipher=cipher)


async def worker_gpudeck(spec: FleetSpec, seconds: float, interval: float, profile: Path | None) -> None:
    """gpudeck's console side: a Fleet with a History following every host; figures over the window."""
    from gpudeck.console.fleet.fleet import Fleet
    from gpudeck.console.history.replica import History

    hdir = Path(tempfile.mkdtemp(prefix="console-gpudeck-", dir=str(spec.base_dir)))
    hist = History(hdir / "history.db")
    fleet = Fleet(config=spec.config(), ssh=spec.ssh_options(), interval_s=interval, history=hist)
    rec = AgeRecorder()
    for name, link in fleet.links.items():
        link.subscribe(rec.callback(name))
    t0 = time.monotonic()
    fleet.start()
    n = len(fleet.links)
    await wait_up(fleet, t0)
    await asyncio.sleep(WARM_S)
    connects0 = sum(ln.status.connects for ln in fleet.links.values())
    prof = cProfile.Profile() if profile else None
    win = Window()
    rec.take()
    rec.take_shape()
    emit("window_start")
    events0 = hist.event_count()
    win.start()
    rec.on = True
    if prof:
        prof.enable()
    await asyncio.sleep(seconds)
    if prof:
        prof.disable()
    rec.on = False
    w = win.stop()
    events1 = hist.event_count()
    ages, sample_ms = rec.take()
    shape = rec.take_shape()
    connects1 = sum(ln.status.connects for ln in fleet.links.values())
    up_end = sum(ln.status.state == "up" for ln in fleet.links.values())
    emit(
        "window_end",
        **w,
        n=n,
        up=up_end,
        received=len(ages),
        expected=n * w["wall_s"] / interval,
        age_p50=pct(ages, 0.50),
        age_p99=pct(ages, 0.99),
        age_max=max(ages) if ages else float("nan"),
        sample_ms_mean=statistics.fmean(sample_ms) if sample_ms else float("nan"),
        sample_ms_p99=pct(sample_ms, 0.99),
        reconnects=connects1 - connects0,
        history_events=hist.event_count(),
        window_events=events1 - events0,
        **shape,
    )
    if prof and profile:
        profile.write_text(_profile_text(prof))
        prof.dump_stats(str(profile.with_suffix(".pstats")))
    await fleet.close()
    hist.close()


async def worker_watch(spec: FleetSpec, seconds: float, interval: float, profile: Path | None) -> None:
    """``gpudeck watch`` (issue 19): the Watcher with a rule and the metrics endpoint, its own GPUDECK_HOME; scraped by the parent."""
    hdir = Path(tempfile.mkdtemp(prefix="console-watch-", dir=str(spec.base_dir)))
    os.environ["GPUDECK_HOME"] = str(hdir)
    from gpudeck.console.core import config as cfg
    from gpudeck.console.watch.rules import compile_rules
    from gpudeck.console.watch.service import Watcher, WatchOptions

    rules = compile_rules((cfg.NotifyRule(to=("json://127.0.0.1:9/never",), on=("failed", "alert")),))
    w = Watcher(WatchOptions(config=spec.config(), rules=rules, metrics=("127.0.0.1", 0), interval_s=interval, ssh=spec.ssh_options()))
    stop = asyncio.Event()
    task = asyncio.ensure_future(w.run(stop))
    t0 = time.monotonic()
    while w.fleet is None or w.metrics_port is None:
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    fleet = w.fleet
    rec = AgeRecorder()
    for name, link in fleet.links.items():
        link.subscribe(rec.callback(name))
    n = len(fleet.links)
    await wait_up(fleet, t0)
    await asyncio.sleep(WARM_S)
    connects0 = sum(ln.status.connects for ln in fleet.links.values())
    win = Window()
    rec.take()
    emit("window_start", metrics_url=f"http://127.0.0.1:{w.metrics_port}/metrics")
    win.start()
    rec.on = True
    await asyncio.sleep(seconds)
    rec.on = False
    r = win.stop()
    ages, _ = rec.take()
    emit(
        "window_end",
        **r,
        n=n,
        up=sum(ln.status.state == "up" for ln in fleet.links.values()),
        received=len(ages),
        expected=n * r["wall_s"] / interval,
        age_p50=pct(ages, 0.50),
        age_p99=pct(ages, 0.99),
        age_max=max(ages) if ages else float("nan"),
        reconnects=sum(ln.status.connects for ln in fleet.links.values()) - connects0,
        events_read=w.health.events_read,
    )
    stop.set()
    await task


def journal_seqs(spec: FleetSpec) -> list[tuple[str, int, int]]:
    """Each host's journal as it is on disk now, read directly (read-only): (epoch, newest seq, event rows)."""
    import sqlite3

    from gpudeck.agents.wire import paths

    found: list[tuple[str, int, int]] = []
    for i in range(len(spec.names)):
        path = paths.journal_path(spec.state_dir(i))
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
            try:
                epoch = conn.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()
                top, rows = conn.execute("SELECT COALESCE(MAX(seq), 0), COUNT(*) FROM events").fetchone()
            finally:
                conn.close()
        except sqlite3.Error:
            found.append(("", 0, 0))
            continue
        found.append((str(epoch[0]) if epoch else "", int(top), int(rows)))
    return found


class Deliveries:
    """A FleetWatcher counting every event the fleet hands its policies, per (host, seq): a second delivery is a duplicate."""

    def __init__(self) -> None:
        self.seen: dict[str, set[int]] = {}
        self.duplicates = 0
        self.delivered = 0

    def on_events(self, host: str, events: list) -> None:
        got = self.seen.setdefault(host, set())
        for ev in events:
            self.delivered += 1
            if ev.seq in got:
                self.duplicates += 1
            got.add(ev.seq)

    def on_link_state(self, st: Any) -> None:
        pass


class GcClock:
    """A ``gc.callbacks`` entry: seconds spent in the cyclic collector, and collections, since it was added."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_gen = [[0, 0.0], [0, 0.0], [0, 0.0]]  # per generation: collections, seconds
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            dt = time.perf_counter() - self._t
            self.seconds += dt
            gen = self.by_gen[min(max(info.get("generation", 0), 0), 2)]
            gen[0] += 1
            gen[1] += dt

    def line(self) -> str:
        return ", ".join(f"gen{g}: {n} in {s:.2f} s" for g, (n, s) in enumerate(self.by_gen))


def writer_cpu_s() -> float:
    """CPU seconds of the history's writer thread (found by its name; 0 before it starts)."""
    for t in threading.enumerate():
        if t.name == "history-writer" and t.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return 0.0


async def worker_scale(spec: FleetSpec, seconds: float, interval: float, profile: Path | None) -> None:
    """issue 33: the console's Fleet + History following a (SIMULATED stand-in) fleet from a cold start: time until
    every host is shown, the history sync of the journals' backlog, then the steady window (CPU, RSS, fds, snapshot
    ages), then every journal event checked against the history (none lost) and the policies' deliveries (none twice)."""
    from bench.standin import host_failure
    from gpudeck.console.core import gcpolicy
    from gpudeck.console.fleet import fleet as fleet_mod
    from gpudeck.console.fleet.fleet import Fleet
    from gpudeck.console.history.replica import History

    if os.environ.get("BENCH_ONE_PHASE"):  # every host's snapshots in one phase of the second, as before 35-phase
        fleet_mod.SNAPSHOT_GROUP = 1 << 30
    if os.environ.get("BENCH_CATCH_UP"):  # how many hosts pull their journals at once (the console's CATCH_UP_AT_ONCE)
        fleet_mod.CATCH_UP_AT_ONCE = int(os.environ["BENCH_CATCH_UP"])

    before = journal_seqs(spec)
    backlog = sum(top for _e, top, _r in before)
    hdir = Path(tempfile.mkdtemp(prefix="console-scale-", dir=str(spec.base_dir)))
    hist = History(hdir / "history.db")
    fleet = Fleet(config=spec.config(), ssh=spec.ssh_options(), interval_s=interval, history=hist)
    deliveries = Deliveries()
    fleet.add_watcher(deliveries)
    rec = AgeRecorder()
    shown: dict[str, float] = {}
    failing = {nm for i, nm in enumerate(spec.names) if host_failure(i, True) != "none"}
    healthy_ages: list[float] = []
    n = len(spec.names)
    t0 = time.monotonic()

    def first_seen(name: str):  # type: ignore[no-untyped-def]
        inner = rec.callback(name)

        def on_status(status) -> None:  # type: ignore[no-untyped-def]
            if status.snapshot is not None and name not in shown:
                shown[name] = time.monotonic() - t0
            k = len(rec.ages)
            inner(status)
            if rec.on and len(rec.ages) > k and name not in failing:
                healthy_ages.append(rec.ages[-1])

        return on_status

    for name, link in fleet.links.items():
        link.subscribe(first_seen(name))
    gc_clock = GcClock()
    gc.callbacks.append(gc_clock)
    cpu0 = time.process_time()
    fleet.start()
    while len(shown) < n and time.monotonic() - t0 < UP_TIMEOUT_S:
        await asyncio.sleep(0.05)
    t_all = time.monotonic() - t0 if len(shown) == n else float("nan")
    times = sorted(shown.values())
    emit(
        "shown",
        n=n,
        shown=len(shown),
        all_s=t_all,
        p50_s=pct(times, 0.5),
        within_10s=sum(t <= 10.0 for t in times),
        cpu_s=time.process_time() - cpu0,
        states={s: sum(ln.status.state == s for ln in fleet.links.values()) for s in {ln.status.state for ln in fleet.links.values()}},
    )
    # the collector as `gpudeck watch` and the console set it once the fleet is connected (console/watch/service.py,
    # console/tui/app.py): the start-up heap frozen out of full collections. Without it, this worker's full
    # collections walk every link's objects, 4x more of them at 4x the hosts, and the sync's cost per event grows
    # with the fleet for a reason the console does not have (bench/RESULTS.md 32-sync).
    gcpolicy.freeze_startup_heap(gcpolicy.HEADLESS_THRESHOLDS)
    # the backlog: every host's journal as it was before the console started, into the history
    t_sync0 = time.monotonic()
    cpu1 = time.process_time()
    writer_cpu0, gc0, snaps0 = writer_cpu_s(), gc_clock.seconds, rec.seen
    txns0, batches0, inserted0 = hist.batches_committed, hist.host_batches, hist.events_inserted
    target = {nm: top for nm, (_e, top, _r) in zip(spec.names, before)}
    while time.monotonic() - t_sync0 < 900:
        behind = [nm for nm, ln in fleet.links.items() if ln.status.synced_seq < target[nm]]
        if len(behind) <= len(failing):
            if not behind or all(nm in failing for nm in behind):
                break
        await asyncio.sleep(0.1)
    sync_s = time.monotonic() - t0
    synced = sum(min(ln.status.synced_seq, target[nm]) for nm, ln in fleet.links.items())
    emit(
        "synced",
        backlog=backlog,
        synced=synced,
        seconds_from_start=sync_s,
        seconds_after_shown=time.monotonic() - t_sync0,
        cpu_s=time.process_time() - cpu1,
        cpu_from_start_s=time.process_time() - cpu0,
        # where the console's CPU after shown went: the history writer thread, the collector; and the live fleet's
        # work meanwhile (snapshots received) and the writer's transactions (bench/RESULTS.md 32-sync, 33-sync)
        writer_cpu_s=writer_cpu_s() - writer_cpu0,
        gc_s=gc_clock.seconds - gc0,
        gc_from_start_s=gc_clock.seconds,
        gc_line=gc_clock.line(),
        snapshots=rec.seen - snaps0,
        txns=hist.batches_committed - txns0,
        batches=hist.host_batches - batches0,
        inserted=hist.events_inserted - inserted0,
    )
    await asyncio.sleep(WARM_S)
    connects0 = sum(ln.status.connects for ln in fleet.links.values())
    win = Window()
    rec.take()
    emit("window_start")
    win.start()
    rec.on = True
    await asyncio.sleep(seconds)
    rec.on = False
    w = win.stop()
    fds = len(os.listdir("/proc/self/fd"))
    ages, sample_ms = rec.take()
    connects1 = sum(ln.status.connects for ln in fleet.links.values())
    up_end = sum(ln.status.state == "up" for ln in fleet.links.values())
    window = dict(
        **w,
        n=n,
        up=up_end,
        fds=fds,
        received=len(ages),
        expected=n * w["wall_s"] / interval,
        age_p50=pct(ages, 0.50),
        age_p99=pct(ages, 0.99),
        age_max=max(ages) if ages else float("nan"),
        healthy_p99=pct(healthy_ages, 0.99),
        healthy_n=n - len(failing),
        reconnects=connects1 - connects0,
    )
    healthy_ages.clear()
    # none lost, none twice: each journal as it is now, against the history once it has caught up
    now = journal_seqs(spec)
    t_check = time.monotonic()
    while time.monotonic() - t_check < 120:
        if all(ln.status.synced_seq >= top for ln, (_e, top, _r) in zip(fleet.links.values(), now)):
            break
        await asyncio.sleep(0.2)
    missing = extra = journal_events = 0
    lagging = []
    for nm, (epoch, top, rows) in zip(spec.names, now):
        held = [s for s in hist.seqs(nm, epoch) if s <= top]
        journal_events += rows
        missing += len(set(range(1, top + 1)) - set(held))
        extra += len(held) - len(set(held))
        if fleet.links[nm].status.synced_seq < top:
            lagging.append(nm)
    emit(
        "window_end",
        **window,
        journal_events=journal_events,
        history_events=hist.event_count(),
        missing=missing,
        extra=extra,
        lagging=[
            f"{nm} ({fleet.links[nm].status.state}, {fleet.links[nm].status.connects} connects, synced {fleet.links[nm].status.synced_seq}: "
            f"{(fleet.links[nm].status.error or '')[:160]})"
            for nm in lagging[:5]
        ],
        n_lagging=len(lagging),
        delivered=deliveries.delivered,
        duplicates=deliveries.duplicates,
    )
    await fleet.close()
    hist.close()


PROM_ACCEPT = "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"


class Scraper:
    """Scrapes a metrics URL every ``every`` seconds on a thread (as Prometheus would): wall time and series of each scrape."""

    def __init__(self, url: str, every: float) -> None:
        import threading

        self.url, self.every = url, every
        self.times: list[float] = []
        self.series: list[int] = []
        self.cpu: list[float] = []
        self.ages: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(self.every):
            t0, t_asked = time.perf_counter(), time.time()
            try:
                # asked as Prometheus asks: OpenMetrics preferred, gzip (the watcher pays for the compression)
                req = urllib.request.Request(self.url, headers={"Accept": PROM_ACCEPT, "Accept-Encoding": "gzip"})
                with urllib.request.urlopen(req, timeout=30) as resp:  # loopback, built by the worker
                    raw = resp.read()
                    body = (gzip.decompress(raw) if resp.headers.get("Content-Encoding") == "gzip" else raw).decode()
            except OSError as exc:
                self.errors.append(str(exc))
                continue
            self.times.append(time.perf_counter() - t0)
            self.series.append(sum(1 for ln in body.splitlines() if ln and not ln.startswith("#")))
            # the watcher's own figure for its previous render: CPU to build, format and gzip the text, off the scrape path
            m = re.search(r"^gpudeck_watch_render_cpu_seconds ([0-9.e+-]+)$", body, re.M)
            if m and float(m.group(1)) > 0:
                self.cpu.append(float(m.group(1)))
            # how old the text served was when this scrape asked for it (one machine, one clock)
            m = re.search(r"^gpudeck_watch_render_timestamp_seconds ([0-9.e+-]+)$", body, re.M)
            if m:
                self.ages.append(t_asked - float(m.group(1)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(35)


async def plain_connections(spec: FleetSpec) -> list:
    """One plain asyncssh connection per host (as gpustat-web makes them), in the cipher order gpudeck asks for:
    the designs differ, not the cipher. Importing gpudeck.console.fleet.transport also gives them gpudeck's AES-GCM shim (one
    AESGCM per key), so the peers pay no more per packet for the cipher than gpudeck does. Emits ``up``."""
    import asyncssh

    from gpudeck.console.fleet.transport import encryption_preference

    opts = spec.ssh_options()
    algs = encryption_preference(opts.config_paths())
    sem = asyncio.Semaphore(32)  # gpustat-web connects to its hosts at start; a bound keeps the handshakes from timing out

    async def connect(name: str) -> asyncssh.SSHClientConnection | BaseException:
        async with sem:
            try:
                return await asyncssh.connect(
                    name,
                    config=opts.config_paths(),
                    known_hosts=str(spec.known_hosts),
                    agent_forwarding=False,
                    keepalive_interval=opts.keepalive_s,
                    connect_timeout=60,
                    login_timeout=120,
                    **({"encryption_algs": algs} if algs is not None else {}),
                )
            except (OSError, asyncssh.Error) as exc:
                return exc

    t0 = time.monotonic()
    conns = await asyncio.gather(*(connect(nm) for nm in spec.names))
    ok = [c for c in conns if not isinstance(c, BaseException)]
    errors = sorted({str(c) for c in conns if isinstance(c, BaseException)})[:3]
    cipher = ok[0].get_extra_info("recv_cipher") if ok else None
    emit("up", up=len(ok), n=len(spec.names), seconds=time.monotonic() - t0, states={"up": len(ok)}, errors=errors, cipher=cipher)
    return ok


async def worker_floor(spec: FleetSpec, seconds: float, interval: float, profile: Path | None) -> None:
    """The transport's floor under gpudeck: the same stream as gpudeck's console gets (one connection per host
    running the agent bridge, the agent's compact snapshot stream on it, the channel's idle packet log skipped as
    gpudeck skips it), but the session only counts the lines that arrive: no decode, no host state, no listeners,
    no history. gpudeck's console CPU above this line is gpudeck's own code."""
    import asyncssh

    from gpudeck.agents.wire.protocol import Hello, WatchSnapshots, encode
    from gpudeck.console.fleet.transport import _skip_idle_packet_log

    ok = await plain_connections(spec)
    n = len(spec.names)
    lines = [0]

    class Count(asyncssh.SSHClientSession):
        def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:  # type: ignore[override]
            lines[0] += data.count(b"\n")

    for conn in ok:
        chan, _ = await conn.create_session(Count, DIAL_COMMAND, encoding=None)
        _skip_idle_packet_log(chan)
        conn.set_keepalive(0)  # gpudeck's stream is its own keepalive
        chan.write(
            encode(Hello(request_id="h", client="floor")) + encode(WatchSnapshots(request_id="w", interval_s=interval, compact=True))
        )
    await asyncio.sleep(WARM_S)
    prof = cProfile.Profile() if profile else None
    win = Window()
    emit("window_start")
    l0 = lines[0]
    win.start()
    if prof:
        prof.enable()
    await asyncio.sleep(seconds)
    if prof:
        prof.disable()
    w = win.stop()
    got = lines[0] - l0
    nan = float("nan")
    emit(
        "window_end",
        **w,
        n=n,
        up=len(ok),
        received=got,
        expected=n * w["wall_s"] / interval,
        age_p50=nan,
        age_p99=nan,
        age_max=nan,
        reconnects=0,
    )
    if prof and profile:
        profile.write_text(_profile_text(prof))
    for c in ok:
        c.close()


async def worker_exec(spec: FleetSpec, seconds: float, interval: float, profile: Path | None, aligned: bool = False) -> None:
    """The exec-per-tick peer: one asyncssh connection per host, one `gpudeck status --json` exec per host per tick;
    the hosts staggered evenly across the tick, or (``aligned``) all polled at the same instant."""
    import asyncssh

    ok = await plain_connections(spec)
    n = len(spec.names)

    state = {"on": False, "stop": False}
    ages: list[float] = []
    rtts: list[float] = []
    sample_ms: list[float] = []
    failures = [0]
    skipped = [0]
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.5

    async def poll(i: int, conn: asyncssh.SSHClientConnection) -> None:
        # staggered evenly across the tick, as gpustat-web's per-host loops drift apart; or all at once, as they start
        nxt = start if aligned else start + i * interval / n
        while not state["stop"]:
            delay = nxt - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            t_req = time.time()
            try:
                r = await conn.run(STATUS_COMMAND, check=True, timeout=30)
                doc = json.loads(r.stdout)
                arrival = time.time()
                if state["on"]:
                    ages.append(arrival - float(doc["ts"]))
                    rtts.append(arrival - t_req)
                    sample_ms.append(float(doc.get("sample_ms", 0.0)))
            except (TimeoutError, asyncssh.Error, OSError, ValueError, KeyError):
                if state["on"]:
                    failures[0] += 1
            nxt += interval
            now = loop.time()
            if nxt < now:  # behind: skip the ticks that passed rather than bursting
                missed = int((now - nxt) / interval) + 1
                if state["on"]:
                    skipped[0] += missed
                nxt += missed * interval

    tasks = [asyncio.ensure_future(poll(i, c)) for i, c in enumerate(ok)]
    await asyncio.sleep(0.5 + WARM_S)
    prof = cProfile.Profile() if profile else None
    win = Window()
    emit("window_start")
    win.start()
    state["on"] = True
    if prof:
        prof.enable()
    await asyncio.sleep(seconds)
    if prof:
        prof.disable()
    state["on"] = False
    w = win.stop()
    got = list(ages)
    emit(
        "window_end",
        **w,
        n=n,
        up=len(ok),
        received=len(got),
        expected=n * w["wall_s"] / interval,
        age_p50=pct(got, 0.50),
        age_p99=pct(got, 0.99),
        age_max=max(got) if got else float("nan"),
        rtt_p50=pct(rtts, 0.50),
        rtt_p99=pct(rtts, 0.99),
        sample_ms_mean=statistics.fmean(sample_ms) if sample_ms else float("nan"),
        sample_ms_p99=pct(sample_ms, 0.99),
        failures=failures[0],
        skipped=skipped[0],
    )
    if prof and profile:
        profile.write_text(_profile_text(prof))
    state["stop"] = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in ok:
        c.close()


# ----------------------------------------------------------------------------- parent


@dataclass
class Side:
    """What the rest of the machine did over a window: the farm, the agents, everything."""

    farm_cpu_s: float
    agents_cpu_s: float
    agents_wait_s: float
    parent_cpu_s: float
    machine_busy_s: float
    wall_s: float
    load: tuple[float, float, float]
    ncpu: int


class SideMeter:
    """Measures farm, agents, this process and the whole machine between start() and stop()."""

    def __init__(self, fh: Any) -> None:  # FleetHosts or bench.standin.StandinHosts
        self.fh = fh
        self.me = psutil.Process()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def _own(self) -> float:
        t = self.me.cpu_times()
        return t.user + t.system

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.farm0 = cpu_seconds([self.fh.farm_pid])
        self.agents0 = cpu_seconds(self.fh.agent_pids)
        self.agents_wait0 = runqueue_wait_s(self.fh.agent_pids)
        self.own0 = self._own()
        self.busy0 = self._busy()

    def stop(self) -> Side:
        return Side(
            farm_cpu_s=cpu_seconds([self.fh.farm_pid]) - self.farm0,
            agents_cpu_s=cpu_seconds(self.fh.agent_pids) - self.agents0,
            agents_wait_s=runqueue_wait_s(self.fh.agent_pids) - self.agents_wait0,
            parent_cpu_s=self._own() - self.own0,
            machine_busy_s=self._busy() - self.busy0,
            wall_s=time.monotonic() - self.t0,
            load=os.getloadavg(),
            ncpu=psutil.cpu_count() or 1,
        )


def out(text: str) -> None:
    """One result line."""
    print(f"fleet_bench {text}", flush=True)


def run_worker(design: str, fh: Any, args: argparse.Namespace) -> tuple[dict[str, Any], Side] | None:
    """Run one console worker in its own process; the window's figures and the machine's over the same window."""
    assert fh.spec is not None
    prof_path = fh.base_dir / f"profile-{design}-{fh.n}.txt" if args.profile else None
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        design,
        "--spec",
        str(fh.spec.path),
        "--seconds",
        str(args.seconds),
        "--interval",
        str(args.interval),
    ]
    if prof_path:
        argv += ["--profile-out", str(prof_path)]
    proc = start_worker(argv, fh.base_dir / f"worker-{design}.stderr")
    pin(proc.pid, "console")
    farm_cpu0, t_start = cpu_seconds([fh.farm_pid]), time.monotonic()
    extras_timeout = 1800 if design == "scale" else 120
    meter = SideMeter(fh)
    spy: subprocess.Popen | None = None
    scraper: Scraper | None = None
    spy_path = fh.base_dir / f"pyspy-{design}-{fh.n}.txt"
    result: dict[str, Any] | None = None
    side: Side | None = None
    extras: dict[str, Any] = {}
    for msg in worker_messages(proc):
        ev = msg.get("ev")
        if ev == "up":
            err = f"; not up: {msg['states']} e.g. {msg['errors']}" if msg["up"] < msg["n"] else ""
            out(f"N={fh.n} {design:<13} hosts up: {msg['up']}/{msg['n']} after {msg['seconds']:.1f} s (cipher {msg.get('cipher')}){err}")
        elif ev in ("shown", "synced"):
            # the stand-in's CPU from the console's start: a stand-in that used all of its CPUs sets the pace
            msg["standin_cpu_s"], msg["standin_wall_s"] = cpu_seconds([fh.farm_pid]) - farm_cpu0, time.monotonic() - t_start
            extras[ev] = msg
            report_startup(fh.n, ev, msg)
        elif ev == "window_start":
            meter.start()
            if msg.get("metrics_url"):
                scraper = Scraper(msg["metrics_url"], args.scrape_every)
            if args.py_spy:
                spy = subprocess.Popen(
                    [
                        args.py_spy,
                        "record",
                        "--pid",
                        str(proc.pid),
                        "--duration",
                        str(max(1, int(args.seconds) - 1)),
                        "--rate",
                        "1000",
                        "--format",
                        "raw",
                        "--full-filenames",
                        "--gil",
                        "--nonblocking",
                        "--output",
                        str(spy_path),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        elif ev == "window_end":
            side = meter.stop()
            result = msg
            if scraper is not None:
                scraper.stop()
                result["scrapes"] = (scraper.times, scraper.series, scraper.errors, scraper.cpu, scraper.ages)
    try:
        proc.wait(extras_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    if result is None or side is None:
        tail = (fh.base_dir / f"worker-{design}.stderr").read_text(errors="replace")[-2000:]
        out(f"N={fh.n} {design:<13} FAILED: the console worker exited {proc.returncode} without a result: {tail}")
        return None
    result["pid"] = proc.pid
    result.update(extras)
    if spy is not None:
        spy.wait(60)
        for text in spy_summary(spy_path):
            out(f"N={fh.n} {design:<13} py-spy {text}")
    if prof_path and args.profile_keep and prof_path.with_suffix(".pstats").exists():
        args.profile_keep.mkdir(parents=True, exist_ok=True)
        kept = args.profile_keep / f"{design}-{fh.n}-{type(fh).__name__}-{int(time.time())}.pstats"
        shutil.copyfile(prof_path.with_suffix(".pstats"), kept)
        out(f"N={fh.n} {design:<13} cProfile stats kept in {kept}")
    if prof_path and prof_path.exists():
        print(
            f"fleet_bench N={fh.n} {design} cProfile of the console over the window (CPU figures of a profiled run are inflated):",
            flush=True,
        )
        print(prof_path.read_text(), flush=True)
    return result, side


_PARTS = (
    ("asyncssh", "/asyncssh/"),
    ("cryptography", "/cryptography/"),
    ("msgspec", "/msgspec/"),
    ("asyncio", "/asyncio/"),
    ("gpudeck console/", str(ROOT / "console") + "/"),
    ("gpudeck agents/", str(ROOT / "agents") + "/"),
    ("bench", str(ROOT / "bench") + "/"),
    ("sqlite/json/stdlib", "/lib/python3"),
)


def spy_summary(path: Path, top: int = 12) -> list[str]:
    """Where the sampled CPU went: share of samples by the package of the innermost frame, and the top functions."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return ["no samples (py-spy wrote nothing)"]
    by_part: dict[str, int] = {}
    by_fn: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    no_frames = 0
    for ln in lines:
        stack, _, count = ln.rpartition(" ")
        try:
            k = int(count)
        except ValueError:
            continue
        if not stack.strip():
            no_frames += k  # a sample without a Python frame (a thread in native code)
            continue
        frames = stack.split(";")
        leaf = frames[-1]
        if "select (" in leaf and "selectors.py" in leaf:
            continue  # waiting in epoll: idle, not CPU
        total += k
        part = next((name for name, key in _PARTS if key in leaf), "other")
        by_part[part] = by_part.get(part, 0) + k
        fn = leaf.replace(str(ROOT) + "/", "").split("/site-packages/")[-1]
        by_fn[fn] = by_fn.get(fn, 0) + k
        seen: set[str] = set()
        for f in frames:
            for tag, key in (
                ("gpudeck console/", str(ROOT / "console") + "/"),
                ("gpudeck agents/", str(ROOT / "agents") + "/"),
                ("asyncssh", "/asyncssh/"),
            ):
                if key in f and tag not in seen:
                    seen.add(tag)
                    inclusive[tag] = inclusive.get(tag, 0) + k
    if not total:
        return ["no CPU samples"]
    out_lines = [
        f"{total} samples holding the GIL ({no_frames} more without a Python frame, left out); self time by package: "
        + ", ".join(f"{p} {100 * c / total:.0f}%" for p, c in sorted(by_part.items(), key=lambda x: -x[1]))
    ]
    out_lines.append(
        "inclusive (a frame of it anywhere on the stack): "
        + ", ".join(f"{p} {100 * c / total:.0f}%" for p, c in sorted(inclusive.items(), key=lambda x: -x[1]))
    )
    for fn, c in sorted(by_fn.items(), key=lambda x: -x[1])[:top]:
        out_lines.append(f"  {100 * c / total:5.1f}% {fn}")
    return out_lines


def report(design: str, n: int, r: dict[str, Any], side: Side) -> tuple[float, float]:
    """Print a design's lines; returns its CPU per host-second and per snapshot received (ms)."""
    per_host_s = 1000.0 * r["cpu_s"] / (n * r["wall_s"])
    per_snap = 1000.0 * r["cpu_s"] / max(1, r["received"])
    core = 100.0 * r["cpu_s"] / r["wall_s"]
    tag = f"N={n} {design:<13}"
    out(f"{tag} console CPU per host-second: {per_host_s:.3f} ms")
    # a design that falls behind receives fewer snapshots and looks cheaper per host-second: this line shows it
    out(f"{tag} console CPU per snapshot received: {per_snap:.3f} ms")
    out(
        f"{tag} console CPU: {core:.1f}% of one core ({r['cpu_s']:.2f} s CPU in {r['wall_s']:.1f} s, {100 * r['sys_s'] / max(r['cpu_s'], 1e-9):.0f}% of it in the kernel); its event-loop thread waited for a CPU {1000 * r['rq_wait_s'] / r['wall_s']:.0f} ms per second (runnable, not running)"
    )
    out(
        f"{tag} console time in Python's cyclic GC: "
        + ", ".join(f"gen{g} {1000 * t:.1f} ms" for g, t in enumerate(r["gc_s"]))
        + f" over {r['wall_s']:.0f} s"
    )
    out(f"{tag} console RSS: {r['rss'] / MIB:.1f} MiB at the end, {r['rss_max'] / MIB:.1f} MiB at its peak (getrusage)")
    if design == "ssh-floor":
        out(f"{tag} snapshot age at arrival: not read (the floor decodes nothing)")
    else:
        out(
            f"{tag} snapshot age at arrival: p50 {1000 * r['age_p50']:.1f} ms, p99 {1000 * r['age_p99']:.1f} ms, max {1000 * r['age_max']:.1f} ms"
        )
    extra = ""
    if design.startswith("exec"):
        extra = f"; exec round trip p50 {1000 * r['rtt_p50']:.1f} ms p99 {1000 * r['rtt_p99']:.1f} ms; {r['failures']} failed, {r['skipped']} ticks skipped (behind)"
    else:
        extra = f"; {r['reconnects']} reconnects, {r['up']}/{n} up at the end"
    out(
        f"{tag} snapshots received: {r['received']} of {r['expected']:.0f} expected ({100 * r['received'] / max(1, r['expected']):.1f}%){extra}"
    )
    busy = side.machine_busy_s / side.wall_s
    console_c = r["cpu_s"] / r["wall_s"]
    farm_c = side.farm_cpu_s / side.wall_s
    agents_c = side.agents_cpu_s / side.wall_s
    parent_c = side.parent_cpu_s / side.wall_s
    rest = busy - console_c - farm_c - agents_c - parent_c
    out(
        f"{tag} machine over the window: {busy:.2f} of {side.ncpu} cores busy (console {console_c:.2f}, SSH farm {farm_c:.2f}, "
        f"{n} agents {agents_c:.2f}, bench {parent_c:.2f}, everything else on the machine {rest:.2f}); each agent's main thread waited for a CPU "
        f"{1000 * side.agents_wait_s / (n * side.wall_s):.0f} ms per second; load average {side.load[0]:.2f} {side.load[1]:.2f} {side.load[2]:.2f}"
    )
    return per_host_s, per_snap


def report_watch(n: int, r: dict[str, Any], console: tuple[float, float] | None) -> None:
    """The watch mode's own lines: the watcher's share of a core, the scrapes, and the ratio to the console's Fleet alone."""
    tag = f"N={n} {'watch':<13}"
    core = 100.0 * r["cpu_s"] / r["wall_s"]
    out(f"{tag} watcher CPU: {core:.2f}% of one core (goal < 5%), scrapes included; {r['events_read']} history events read")
    times, series, errors, cpu, ages = r.get("scrapes", ([], [], [], [], []))
    if times:
        out(
            f"{tag} scrapes: {len(times)} in {r['wall_s']:.0f} s, wall p50 {1000 * pct(times, 0.5):.1f} ms, "
            f"max {1000 * max(times):.1f} ms (goal < 100 ms); {series[-1]} series in the last one; {len(errors)} failed"
            + (f" (first: {errors[0][:120]})" if errors else "")
        )
        out(f"{tag} each scrape's wall, in order (ms): {' '.join(f'{1000 * t:.1f}' for t in times)}")
        if cpu:
            out(
                f"{tag} render CPU (the watcher's gpudeck_watch_render_cpu_seconds: build + format + gzip, off the scrape path): "
                f"p50 {1000 * pct(cpu, 0.5):.1f} ms, max {1000 * max(cpu):.1f} ms (n={len(cpu)})"
            )
        if ages:
            out(f"{tag} age of the text served when scraped: p50 {pct(ages, 0.5):.2f} s, max {max(ages):.2f} s (n={len(ages)})")
    else:
        out(f"{tag} no scrape succeeded: {errors[:2]}")
    if console is not None and console[0] > 0:
        per_host_s = 1000.0 * r["cpu_s"] / (n * r["wall_s"])
        out(f"{tag} ratio watcher / console Fleet (gpudeck design) CPU per host-second: {per_host_s / console[0]:.2f}x")


def host_exec_cost(fh: FleetHosts, n_execs: int) -> tuple[list[float], list[float]] | str:
    """Wall and CPU seconds of `python -m gpudeck.console.cli.main status --host local --json` against agent 0, run n times."""
    env = fh.agent_env(0)
    env.pop("GPUDECK_SIMULATE_GPUS", None)
    argv = [sys.executable, "-m", "gpudeck.console.cli.main", "status", "--host", "local", "--json"]
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(n_execs + 1):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        cp = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=str(ROOT))
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if cp.returncode != 0:
            return f"exit {cp.returncode}: {cp.stderr.strip()[-400:]}"
        doc = json.loads(cp.stdout)
        if not doc.get("simulated") or "ts" not in doc:
            return f"unexpected output: {cp.stdout[:200]}"
        walls.append(wall)
        cpus.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
    return walls[1:], cpus[1:]  # the first exec warms the page cache


# ----------------------------------------------------------------------------- issue 33: the stand-in, fidelity and scale


def load_line() -> str:
    """The machine's load average now (every figure is read with it)."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def report_startup(n: int, ev: str, msg: dict[str, Any]) -> None:
    """The scale worker's start-up lines: every host shown, the backlog synced."""
    tag = f"N={n} SIMULATED stand-in"
    if ev == "shown":
        out(
            f"{tag} console start to every host shown (first snapshot of each received): {msg['all_s']:.2f} s "
            f"(p50 {msg['p50_s']:.2f} s; {msg['within_10s']}/{msg['n']} within 10 s; {msg['shown']}/{msg['n']} shown); "
            f"console CPU over it {msg['cpu_s']:.1f} s; link states then {msg['states']}; {load_line()}"
        )
    else:
        rate = msg["synced"] / max(msg["seconds_after_shown"], 1e-9)
        whole = msg["synced"] / max(msg["seconds_from_start"], 1e-9)
        cpu_all = msg.get("cpu_from_start_s", float("nan"))
        out(
            f"{tag} history sync of the backlog: {msg['synced']} of {msg['backlog']} journal events in the history {msg['seconds_from_start']:.1f} s "
            f"after console start ({msg['seconds_after_shown']:.1f} s after every host was shown): {whole:,.0f} events/s from console start "
            f"({rate:,.0f} a second of the time after shown, a figure that flatters a small fleet: more of its pull is over by then); "
            f"console CPU from start to synced {cpu_all:.1f} s = {1e6 * cpu_all / max(msg['synced'], 1):.1f} us per event, "
            f"{1000 * cpu_all / n:.1f} ms per host (connect and backlog; {msg['cpu_s']:.1f} s of it after shown); {load_line()}"
        )
        if "writer_cpu_s" in msg:
            inserted = max(msg["inserted"], 1)
            out(
                f"{tag} history sync, after shown: console CPU {msg['cpu_s']:.1f} s, of it the history writer thread {msg['writer_cpu_s']:.1f} s "
                f"({1e6 * msg['writer_cpu_s'] / inserted:.1f} us per event written), the rest {msg['cpu_s'] - msg['writer_cpu_s']:.1f} s "
                f"({1e6 * (msg['cpu_s'] - msg['writer_cpu_s']) / inserted:.1f} us per event); collector {msg['gc_s']:.2f} s "
                f"({msg['gc_from_start_s']:.2f} s from start: {msg.get('gc_line')}); {msg['inserted']} events written in {msg['txns']} transactions ({msg.get('batches', 0)} hosts' batches); "
                f"{msg['snapshots']} snapshots received meanwhile; stand-in CPU from console start {msg['standin_cpu_s']:.1f} s "
                f"in {msg['standin_wall_s']:.1f} s ({100 * msg['standin_cpu_s'] / max(msg['standin_wall_s'], 1e-9):.0f}% of one CPU)"
            )


def report_scale(n: int, r: dict[str, Any], side: Side) -> dict[str, float]:
    """The steady window's lines for one N; returns the figures the growth table compares."""
    tag = f"N={n} SIMULATED stand-in"
    core = r["cpu_s"] / r["wall_s"]
    per_host_ms = 1000.0 * r["cpu_s"] / (n * r["wall_s"])
    load = f"load average {side.load[0]:.2f} {side.load[1]:.2f} {side.load[2]:.2f}"
    out(
        f"{tag} console CPU: {100 * core:.1f}% of one core, {per_host_ms:.3f} ms per host-second ({r['cpu_s']:.2f} s in {r['wall_s']:.1f} s); "
        f"its loop waited for a CPU {1000 * r['rq_wait_s'] / r['wall_s']:.0f} ms/s; {load}"
    )
    out(
        f"{tag} console RSS {r['rss'] / MIB:.0f} MiB ({r['rss'] / MIB / n:.2f} MiB per host), peak {r['rss_max'] / MIB:.0f} MiB; "
        f"{r['fds']} file descriptors ({r['fds'] / n:.2f} per host); {load}"
    )
    out(
        f"{tag} snapshot age at arrival: p50 {1000 * r['age_p50']:.0f} ms, p99 {1000 * r['age_p99']:.0f} ms, max {1000 * r['age_max']:.0f} ms "
        f"(the {r['healthy_n']} hosts that play no failure: p99 {1000 * r['healthy_p99']:.0f} ms); received {r['received']} of {r['expected']:.0f} expected "
        f"({100 * r['received'] / max(1, r['expected']):.1f}%); {r['reconnects']} reconnects, {r['up']}/{n} up at the end; {load}"
    )
    out(
        f"{tag} events: journals hold {r['journal_events']}, the history {r['history_events']}; lost (in a journal, not in the history) {r['missing']}, "
        f"duplicated in the history {r['extra']}; handed to the policies {r['delivered']} times, {r['duplicates']} of them twice; "
        f"{r['n_lagging']} hosts not caught up at the check {r['lagging']}"
    )
    busy = side.machine_busy_s / side.wall_s
    out(
        f"{tag} machine over the window: {busy:.2f} of {side.ncpu} cores busy (console {core:.2f}, stand-in {side.farm_cpu_s / side.wall_s:.2f}, "
        f"everything else {busy - core - side.farm_cpu_s / side.wall_s - side.parent_cpu_s / side.wall_s:.2f}); {load}"
    )
    shown, synced = r.get("shown", {}), r.get("synced", {})
    # the sync's own cost: the console's CPU after every host was shown, less what the live fleet costs it in the
    # steady window (its snapshots arrive all through the sync, and a 4x fleet's sync lasts longer, on the same CPU)
    live_s = core * synced.get("seconds_after_shown", float("nan"))
    marginal_us = 1e6 * (synced.get("cpu_s", float("nan")) - live_s) / max(synced.get("inserted", 0), 1)
    if synced:
        out(
            f"{tag} history sync, less the live fleet: console CPU after shown {synced['cpu_s']:.1f} s, less the steady window's "
            f"{100 * core:.1f}% of one core over its {synced['seconds_after_shown']:.1f} s ({live_s:.1f} s) = "
            f"{synced['cpu_s'] - live_s:.1f} s for {synced['inserted']} events written = {marginal_us:.1f} us per event; {load}"
        )
    return {
        "cpu_core": core,
        "cpu_per_host_ms": per_host_ms,
        "rss_mib": r["rss"] / MIB,
        "fds": float(r["fds"]),
        "age_p50_ms": 1000 * r["age_p50"],
        "age_p99_ms": 1000 * r["age_p99"],
        "shown_s": float(shown.get("all_s", float("nan"))),
        "sync_eps": synced.get("synced", 0) / max(synced.get("seconds_from_start", 0.0), 1e-9),
        "sync_cpu_us_per_event": 1e6 * synced.get("cpu_from_start_s", float("nan")) / max(synced.get("synced", 0), 1),
        "sync_marginal_us_per_event": marginal_us,
    }


def report_growth(rows: dict[int, dict[str, float]]) -> None:
    """Each figure at every N, per host, and its ratio to the smallest N."""
    if not rows:
        return
    sizes = sorted(rows)
    base = sizes[0]
    per_host = ("cpu_per_host_ms", "rss_mib", "fds")
    for key in (
        "cpu_core",
        "cpu_per_host_ms",
        "rss_mib",
        "fds",
        "age_p50_ms",
        "age_p99_ms",
        "shown_s",
        "sync_eps",
        "sync_cpu_us_per_event",
        "sync_marginal_us_per_event",
    ):
        cells = []
        for n in sizes:
            v = rows[n][key]
            cell = f"N={n} {v:.3f}" if key in ("cpu_core", "cpu_per_host_ms") else f"N={n} {v:.1f}"
            if key in ("rss_mib", "fds"):
                cell += f" ({v / n:.3f}/host)"
            cells.append(cell)
        b = rows[base][key] / (base if key in per_host[1:] else 1)
        ratios = []
        for n in sizes[1:]:
            v = rows[n][key] / (n if key in per_host[1:] else 1)
            ratios.append(f"{n}/{base}: {v / b:.2f}x" if b else f"{n}/{base}: n/a")
        what = " (per host)" if key in per_host else ""
        out(f"growth {key}: {'; '.join(cells)}; ratio{what} {', '.join(ratios)}")
    # what one more host adds (the fixed part of a process left out): between each N and the next
    for key, unit in (("rss_mib", "MiB"), ("fds", "fds"), ("cpu_core", "cores")):
        steps = [
            f"{a}->{b}: {(rows[b][key] - rows[a][key]) / (b - a) * (1000 if key == 'cpu_core' else 1):.4f} {unit if key != 'cpu_core' else 'ms/s'}"
            for a, b in zip(sizes, sizes[1:])
        ]
        if steps:
            out(f"growth {key} per added host: {'; '.join(steps)}")


def run_scale(sizes: list[int], args: argparse.Namespace) -> None:
    """issue 33: the console against N SIMULATED stand-in hosts (bench/standin.py), from a cold start with a backlog."""
    from bench.standin import StandinHosts

    rows: dict[int, dict[str, float]] = {}
    for n in sizes:
        try:
            sh = StandinHosts(
                n,
                args.gpus,
                profile=args.host_profile,
                failures=not args.no_failures,
                backlog_hours=args.backlog_hours,
                spread_s=args.spread_ms / 1000,
                ciphers=args.ciphers,
                progress=lambda m: print(f"fleet_bench (progress) {m}", file=sys.stderr, flush=True),
            )
        except FleetStartError as exc:
            out(f"N={n} SIMULATED stand-in COULD NOT BE BROUGHT UP: {exc}")
            continue
        pin(sh.farm_pid, "standin")
        try:
            mem = psutil.virtual_memory()
            out(
                f"N={n} SIMULATED stand-in up in {sh.start_seconds:.1f} s ({args.host_profile}, failures {'off' if args.no_failures else 'on: 3 hosts in 256'}; "
                f"backlog {args.backlog_hours:g} h = {sh.ready.get('backlog_events', 0)} journal events written in {sh.ready.get('backlog_s', 0.0):.1f} s): "
                f"stand-in RSS {rss_bytes([sh.farm_pid]) / MIB:.0f} MiB; machine memory available {mem.available / 2**30:.1f} GiB; {load_line()}"
            )
            got = run_worker("scale", sh, args)
            if got is not None:
                rows[n] = report_scale(n, *got)
                out(
                    f"N={n} SIMULATED stand-in RSS at the end {rss_bytes([sh.farm_pid]) / MIB:.0f} MiB ({rss_bytes([sh.farm_pid]) / MIB / n:.2f} MiB per host)"
                )
        finally:
            sh.close()
    report_growth(rows)


def _offsets_line(xs: list[float]) -> str:
    """An offset distribution in ms: percentiles and the mean."""
    if not xs:
        return "none"
    cells = " ".join(f"p{int(q * 100)} {1000 * pct(xs, q):.1f}" for q in (0.10, 0.50, 0.90, 0.99))
    return f"{cells} max {1000 * max(xs):.1f} mean {1000 * statistics.fmean(xs):.1f} ms ({len(xs)} snapshots)"


_SIZE_BINS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 1 << 30))


def _sizes_line(sizes: list[int], wall_s: float) -> str:
    """A distribution of bunch sizes: the share of snapshots in bunches of each size (and of the bunches), the mean."""
    if not sizes:
        return "none"
    total = sum(sizes)
    cells = []
    for lo, hi in _SIZE_BINS:
        ks = [k for k in sizes if lo <= k <= hi]
        if ks:
            label = str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+")
            cells.append(f"{label}: {100 * sum(ks) / total:.0f}% ({len(ks)})")
    return (
        f"{len(sizes) / wall_s:.1f}/s, mean {total / len(sizes):.2f}, p50 {pct([float(k) for k in sizes], 0.5):.0f}, "
        f"max {max(sizes)}; snapshots (bunches) by size {', '.join(cells)}"
    )


FIDELITY_KINDS = {
    "real": "real agents",
    "clusters": "stand-in, measured clusters",
    "clusters-uncorked": "stand-in, clusters uncorked",
    "passes": "stand-in, measured passes",
    "offsets": "stand-in, measured offsets",
}


def run_fidelity(sizes: list[int], args: argparse.Namespace) -> None:
    """issue 33: the console's cost per host against real agents (FleetHosts) and against the stand-in (idle
    profile: the same 8 idle SIMULATED GPUs as the real agents, no failures), one after the other in this run.

    The real agents go first. The console records, for every snapshot in the window, its send offset after the
    whole second (the snapshot's own ``ts``), its arrival (the console's clock) and how many snapshots each pass
    of its event loop took. The arrivals cut into clusters (less than --cluster-gap-ms apart) give the measured
    arrival shape: each cluster's size and its offset after the whole second. The stand-in then runs with

    - ``measured clusters`` (the model): every second its hosts are dealt into groups whose (size, offset) pairs are
      drawn from the real agents' clusters; a group's snapshots are written in one pass of its loop at the offset;
    - ``measured offsets`` (the previous model): every host's send offset drawn from the real agents' send offsets;
    - ``spread`` (the scale runs' setting): a fixed phase per host in [0, --spread-ms).

    The other inputs of the console's cost are printed side by side: the bunching (clusters and snapshots per
    loop pass), snapshot bytes, GPUs, processes, runs per host, the events per second, the offsets."""
    from bench.standin import CLUSTER_GAP_S, StandinHosts, arrival_clusters, loop_passes

    gap_s = args.cluster_gap_ms / 1000 if args.cluster_gap_ms else CLUSTER_GAP_S
    spread = f"stand-in, spread {args.spread_ms:g} ms"
    chosen = [k.strip() for k in args.fidelity_kinds.split(",") if k.strip()]
    kinds = [FIDELITY_KINDS.get(k, spread if k == "spread" else k) for k in chosen]
    for n in sizes:
        figures: dict[str, tuple[float, float]] = {}
        shapes: dict[str, dict[str, Any]] = {}
        measured: list[float] = []
        clusters: list[tuple[int, float]] = []
        passes: list[tuple[int, float]] = []
        for kind in kinds:
            try:
                if kind == "real agents":
                    fh: Any = FleetHosts(n, args.gpus, batch=args.batch, ciphers=args.ciphers)
                elif kind in ("stand-in, measured clusters", "stand-in, clusters uncorked", "stand-in, measured passes"):
                    groups = passes if kind.endswith("passes") else clusters
                    if not groups:
                        out(f"N={n} fidelity {kind}: no arrival clusters were measured from the real agents; skipped")
                        continue
                    fh = StandinHosts(
                        n,
                        args.gpus,
                        profile="idle",
                        failures=False,
                        ciphers=args.ciphers,
                        clusters=groups,
                        cork=not kind.endswith("uncorked"),
                    )
                elif kind == "stand-in, measured offsets":
                    if not measured:
                        out(f"N={n} fidelity {kind}: no offsets were measured from the real agents; skipped")
                        continue
                    fh = StandinHosts(n, args.gpus, profile="idle", failures=False, ciphers=args.ciphers, offsets=measured)
                elif kind == spread:
                    fh = StandinHosts(n, args.gpus, profile="idle", failures=False, ciphers=args.ciphers, spread_s=args.spread_ms / 1000)
                else:
                    out(f"fidelity kind {kind!r} unknown (real, clusters, offsets, spread)")
                    continue
            except FleetStartError as exc:
                out(f"N={n} fidelity {kind} COULD NOT BE BROUGHT UP: {exc}")
                continue
            try:
                got = run_worker("gpudeck", fh, args)
            finally:
                fh.close()
            if got is None:
                continue
            r, side = got
            per_host = 1000.0 * r["cpu_s"] / (n * r["wall_s"])
            figures[kind] = (per_host, r["rss"] / MIB)
            shapes[kind] = r
            r["load"] = side.load
            if kind == "real agents":
                measured = [float(x) for x in r.get("ts_offsets", [])]
                clusters = arrival_clusters([float(x) for x in r.get("arrivals", [])], gap_s)
                passes = loop_passes([float(x) for x in r.get("arrivals", [])], [int(k) for k in r.get("wakes", [])])
            load = f"load average {side.load[0]:.2f} {side.load[1]:.2f} {side.load[2]:.2f}"
            out(
                f"N={n} fidelity {kind}: console CPU {per_host:.3f} ms per host-second ({100 * r['cpu_s'] / r['wall_s']:.2f}% of one core), "
                f"RSS {r['rss'] / MIB:.1f} MiB, snapshot age p50 {1000 * r['age_p50']:.1f} ms p99 {1000 * r['age_p99']:.1f} ms, "
                f"received {r['received']} of {r['expected']:.0f}; server side {side.farm_cpu_s / side.wall_s:.2f} + agents {side.agents_cpu_s / side.wall_s:.2f} cores; "
                f"{100 * r['sys_s'] / max(r['cpu_s'], 1e-9):.0f}% of its CPU in the kernel, its loop waited for a CPU {1000 * r['rq_wait_s'] / r['wall_s']:.0f} ms/s; {load}"
            )
        # the inputs of the console's cost, side by side: first how the snapshots bunch at the console
        for kind, r in shapes.items():
            cl = arrival_clusters([float(x) for x in r.get("arrivals", [])], gap_s)
            out(
                f"N={n} fidelity bunching {kind:<27}: clusters (arrivals < {1000 * gap_s:g} ms apart) {_sizes_line([k for k, _o in cl], r['wall_s'])}"
            )
            out(
                f"N={n} fidelity bunching {kind:<27}: snapshots per console loop pass {_sizes_line([int(k) for k in r.get('wakes', [])], r['wall_s'])}"
            )
            out(
                f"N={n} fidelity bunching {kind:<27}: cluster offset after the whole second {_offsets_line([o for _k, o in cl]).replace('snapshots', 'clusters')}"
            )
        for kind, r in shapes.items():
            io, hs = r.get("io") or {}, n * r["wall_s"]  # socket reads are not in /proc's read counts: switches only
            if io:
                out(
                    f"N={n} fidelity wake-ups {kind:<27}: the console went to sleep {io.get('vcs', 0) / r['wall_s']:.1f} times a second "
                    f"({io.get('vcs', 0) / hs:.3f} per host-second; voluntary context switches, every thread), was preempted {io.get('ivcs', 0) / r['wall_s']:.1f}/s"
                )
        for kind, r in shapes.items():
            sh = r.get("shapes") or []
            ts_off = [float(x) for x in r.get("ts_offsets", [])]
            early = sum(x < 0 for x in ts_off)

            def mean(i: int, sh: list[Any] = sh) -> float:
                return statistics.fmean(x[i] for x in sh) if sh else float("nan")

            out(
                f"N={n} fidelity inputs {kind:<27}: send offset (snapshot ts after its whole second) {_offsets_line(ts_off)}, {early} early; "
                f"arrival offset at the console {_offsets_line([float(x) for x in r.get('arrival_offsets', [])])}"
            )
            out(
                f"N={n} fidelity inputs {kind:<27}: snapshot {mean(0):.0f} bytes per host (re-encoded as the console holds it, {len(sh)} hosts), "
                f"{mean(1):.1f} GPUs, {mean(2):.1f} processes, {mean(3):.1f} runs; events {r.get('window_events', 0) / r['wall_s']:.2f}/s into the history "
                f"({r.get('window_events', 0)} in {r['wall_s']:.1f} s)"
            )
        if "real agents" in figures:
            c_real, m_real = figures["real agents"]
            for kind in figures:
                if kind == "real agents":
                    continue
                c_sim, m_sim = figures[kind]
                verdict = "within 20%" if abs(c_sim / c_real - 1) <= 0.2 else "NOT within 20%"
                out(
                    f"N={n} fidelity ratio {kind} / real agents: console CPU per host-second {c_sim / c_real:.2f}x ({verdict}), "
                    f"console RSS {m_sim / m_real:.2f}x; {load_line()}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="16,64,256", help="fleet sizes, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0, help="measurement window per design and size")
    ap.add_argument("--interval", type=float, default=1.0, help="snapshot interval / poll tick (s)")
    ap.add_argument("--gpus", default="8:H200", help="GPUDECK_SIMULATE_GPUS of every agent")
    ap.add_argument("--execs", type=int, default=10, help="execs of the status CLI for the host-side cost (0: skip)")
    ap.add_argument(
        "--designs",
        default="gpudeck,exec-per-tick,exec-aligned,ssh-floor",
        help="which console workers to run (ssh-floor: the stream gpudeck gets, counted, not read)",
    )
    ap.add_argument(
        "--ciphers",
        default=None,
        help="a `Ciphers` line for every host in the generated ssh config, which both designs then follow (default: none, so gpudeck's order, AES-GCM first, for both)",
    )
    ap.add_argument("--batch", type=int, default=16, help="agents started at a time")
    ap.add_argument("--profile", action="store_true", help="cProfile each console worker over its window and print the top functions")
    ap.add_argument("--profile-keep", type=Path, default=None, help="with --profile: keep each worker's pstats file in this folder")
    ap.add_argument(
        "--py-spy",
        default=None,
        metavar="PATH",
        help="sample each console worker with this py-spy binary over its window and print where its CPU goes",
    )
    ap.add_argument("--scrape-every", type=float, default=5.0, help="watch mode: seconds between scrapes of the watcher's metrics")
    ap.add_argument(
        "--fleet",
        choices=["real", "standin"],
        default="real",
        help="real: N real agents (bench/fleet_hosts.py); standin: N SIMULATED hosts in one process (bench/standin.py, issue 33)",
    )
    ap.add_argument(
        "--fidelity", action="store_true", help="the console's cost per host against real agents and against the stand-in, each N"
    )
    ap.add_argument(
        "--fidelity-kinds",
        default="real,clusters,passes,offsets,spread",
        help="--fidelity: which consoles to measure, in order (real agents first: the stand-in's models draw from them)",
    )
    ap.add_argument(
        "--cluster-gap-ms", type=float, default=0.0, help="--fidelity: arrivals closer than this form one cluster (0: the stand-in's 1 ms)"
    )
    ap.add_argument(
        "--host-profile", default="mixed", choices=["idle", "mixed", "busy"], help="stand-in: which hosts carry a SIMULATED run"
    )
    ap.add_argument("--no-failures", action="store_true", help="stand-in: no silent, restarting or slow hosts")
    ap.add_argument(
        "--spread-ms", type=float, default=20.0, help="stand-in: each host's snapshot phase after the whole second, in [0, this)"
    )
    ap.add_argument(
        "--backlog-hours", type=float, default=12.0, help="stand-in: hours of journal each host holds before the console starts"
    )
    ap.add_argument(
        "--console-cpus",
        default="",
        help="pin the console worker to these CPUs (taskset's list, e.g. 0-1): an operator's machine of that size",
    )
    ap.add_argument(
        "--standin-cpus",
        default="",
        help="pin the stand-in (or the agents and farm) and this driver to these CPUs, so the SIMULATED hosts do not take the console's",
    )
    ap.add_argument("--worker", choices=["gpudeck", "exec-per-tick", "exec-aligned", "ssh-floor", "watch", "scale"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        spec = FleetSpec.load(args.spec)
        if args.worker == "gpudeck":
            asyncio.run(worker_gpudeck(spec, args.seconds, args.interval, args.profile_out))
        elif args.worker == "watch":
            asyncio.run(worker_watch(spec, args.seconds, args.interval, args.profile_out))
        elif args.worker == "scale":
            asyncio.run(worker_scale(spec, args.seconds, args.interval, args.profile_out))
        elif args.worker == "ssh-floor":
            asyncio.run(worker_floor(spec, args.seconds, args.interval, args.profile_out))
        else:
            asyncio.run(worker_exec(spec, args.seconds, args.interval, args.profile_out, aligned=args.worker == "exec-aligned"))
        return

    stop_on_signals()
    sizes = [int(x) for x in args.hosts.split(",") if x.strip()]
    designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    pin_options(ap, args.console_cpus, args.standin_cpus)
    out(
        f"machine: {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.1f} GiB; python {sys.version.split()[0]}; "
        f"pinning: console {'on CPUs ' + args.console_cpus if args.console_cpus else 'not pinned'}, "
        f"SIMULATED hosts and this driver {'on CPUs ' + args.standin_cpus if args.standin_cpus else 'not pinned'}; "
        f"SIMULATED GPUs ({args.gpus} per agent); SSH server side: asyncssh in-process (one farm process, no MSG_IGNORE before every packet, as sshd), not OpenSSH; "
        f"ciphers: {args.ciphers or 'gpudeck default order (AES-GCM first), the same for both designs'}; "
        f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if args.fidelity:
        run_fidelity(sizes, args)
        return
    if args.fleet == "standin":
        run_scale(sizes, args)
        return
    for n in sizes:
        try:
            fh = FleetHosts(
                n,
                args.gpus,
                batch=args.batch,
                ciphers=args.ciphers,
                progress=lambda m: print(f"fleet_bench (progress) {m}", file=sys.stderr, flush=True),
            )
        except FleetStartError as exc:
            out(f"N={n} COULD NOT BE BROUGHT UP: {exc}")
            continue
        for pid in (fh.farm_pid, *fh.agent_pids):
            pin(pid, "standin")
        try:
            mem = psutil.virtual_memory()
            out(
                f"N={n} fleet up in {fh.start_seconds:.1f} s: {n} agents ({rss_bytes(fh.agent_pids) / MIB:.0f} MiB RSS together) + SSH farm "
                f"({rss_bytes([fh.farm_pid]) / MIB:.0f} MiB); machine memory available {mem.available / 2**30:.1f} GiB"
            )
            per: dict[str, tuple[float, float]] = {}
            results: dict[str, tuple[dict[str, Any], Side]] = {}
            for design in designs:
                got = run_worker(design, fh, args)
                if got is None:
                    continue
                results[design] = got
                per[design] = report(design, n, *got)
            if "watch" in results:
                report_watch(n, results["watch"][0], per.get("gpudeck"))
            peers = [d for d in ("exec-per-tick", "exec-aligned") if d in per]
            if "gpudeck" in per and peers and per["gpudeck"][0] > 0:
                for d in peers:
                    out(
                        f"N={n} ratio console CPU per host-second, {d} / gpudeck: {per[d][0] / per['gpudeck'][0]:.1f}x "
                        f"(per snapshot received: {per[d][1] / per['gpudeck'][1]:.1f}x)"
                    )
                best = min(peers, key=lambda d: per[d][0])
                out(f"N={n} ratio against the cheaper peer ({best}): {per[best][0] / per['gpudeck'][0]:.1f}x")
            if "gpudeck" in per and "ssh-floor" in per and per["ssh-floor"][0] > 0:
                floor = per["ssh-floor"][0]
                out(
                    f"N={n} gpudeck's console over the transport's floor (ssh-floor): {per['gpudeck'][0] / floor:.2f}x "
                    f"({1000 * (per['gpudeck'][0] - floor):.1f} us per host-second of gpudeck's own code)"
                )
                for d in peers:
                    out(
                        f"N={n} ratio {d} / ssh-floor: {per[d][0] / floor:.1f}x (the most any design of one SSH message per host per tick could reach against it)"
                    )
            if "gpudeck" in results:
                r, side = results["gpudeck"]
                rate = r["received"] / (n * r["wall_s"])  # snapshots per host-second actually sent
                agent_ms = 1000.0 * side.agents_cpu_s / (n * side.wall_s)
                out(
                    f"N={n} host agent snapshot build (the snapshots' sample_ms): mean {r['sample_ms_mean']:.3f} ms, p99 {r['sample_ms_p99']:.3f} ms"
                )
                out(
                    f"N={n} host agent CPU while streaming to gpudeck: {agent_ms:.2f} ms per host-second ({agent_ms / 10:.2f}% of one core per agent), "
                    f"{agent_ms / max(rate, 1e-9):.2f} ms per snapshot sent (tick loop included)"
                )
            if "exec-per-tick" in results:
                r, side = results["exec-per-tick"]
                agent_ms = 1000.0 * side.agents_cpu_s / (n * side.wall_s)
                out(
                    f"N={n} host agent CPU while answering exec-per-tick (Hello+GetSnapshot per exec, answered in the farm): {agent_ms:.2f} ms per host-second"
                )
            if args.execs > 0 and n == sizes[-1]:
                cost = host_exec_cost(fh, args.execs)
                if isinstance(cost, str):
                    out(f"N={n} host exec of `python -m gpudeck.console.cli.main status --host local --json` FAILED: {cost}")
                else:
                    walls, cpus = cost
                    cpu_ms = 1000 * statistics.fmean(cpus)
                    line = (
                        f"N={n} host exec-per-tick cost, one exec of `python -m gpudeck.console.cli.main status --host local --json` against an agent: "
                        f"wall mean {1000 * statistics.fmean(walls):.0f} ms, p99 {1000 * pct(walls, 0.99):.0f} ms; CPU mean {cpu_ms:.0f} ms (n={len(walls)})"
                    )
                    if "gpudeck" in results:
                        r, side = results["gpudeck"]
                        rate = r["received"] / (n * r["wall_s"])
                        agent_snap_ms = 1000.0 * side.agents_cpu_s / (n * side.wall_s) / max(rate, 1e-9)
                        line += f"; {cpu_ms / max(agent_snap_ms, 1e-9):.0f}x the agent's CPU per streamed snapshot"
                    out(line)
                out(
                    f"N={n} host reference, NOT measured in this run: {GPUSTAT_REFERENCE}; gpustat cannot run on this machine (it needs NVML: an NVIDIA driver)"
                )
        finally:
            fh.close()


if __name__ == "__main__":
    main()
