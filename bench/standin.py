"""Provides a light host stand-in for the scale benchmarks (issue 33): ONE process serving many SIMULATED hosts.

256 real agents (bench/fleet_hosts.py) take about 9 GB on the 2-core test machine, so 1,024 cannot be reached
that way. This module serves N simulated hosts from one process, over the same path the console uses for a real
host. What is real and what is SIMULATED, so nobody reads more into a figure than it holds:

- **Real**: the SSH server (asyncssh, in this process: one listener per host on 127.0.0.1, one generated
  ed25519 host key, the console's generated key authorised, exactly as the fleet bench's farm); the agent
  protocol end to end: every ``gpudeck agent dial`` channel is served by the agent daemon's own connection
  class (:class:`gpudeck.agents.server.daemon.Connection`: framing, ``Hello`` and its version check, the snapshot
  stream on the wall clock's grid with compact snapshots, the event long poll, backpressure, typed errors);
  each host's journal is a real :class:`gpudeck.agents.storage.journal.Journal` (SQLite, WAL, its own writer
  thread) in its own ``GPUDECK_HOME/agent``, so the console's history sync reads real journals.
- **SIMULATED**: the GPUs (the agents' own simulated sampler, ``SIMULATED`` in every GPU name, ``simulated`` in
  every snapshot and hello); the runs and their processes (a "busy" host carries one 8-rank run whose pids,
  members, telemetry and GPU memory are made up, and whose journal gets one step record per 10 s, the real
  agent's rate, plus a checkpoint every 30 min); the failures: a host that stops answering (``silent``), one
  whose agent restarts (``restart``: every connection cut, ``agent_started`` journaled), one that is slow
  (``slow``: every reply and snapshot late). There is no supervisor, no process scan, no launch: requests other
  than hello, snapshots, events, runs and ping get a typed ``Error`` saying the host is a SIMULATED stand-in.
- **Not per host**: one process, one event loop, one tick for all hosts (a real host has its own CPU); the
  stand-in's CPU shares this machine's cores with the console. Its hello's ``pid`` is this process's.
- **When snapshots arrive** (SIMULATED, three models): a fixed phase per host in [0, ``spread_s``) after the whole
  second (the scale runs' default); a send offset drawn per snapshot from measured ones (``offsets``); or the
  arrival model (``clusters``, what bench/fleet.py --fidelity checks against real agents): the hosts sent in groups
  whose sizes and offsets are drawn from how real agents' snapshots bunched at a console in the same run
  (:func:`arrival_clusters`, :class:`GroupClock`). The console's cost per host follows how many snapshots it
  takes per wake-up (bench/RESULTS.md 30-fid2), so this is part of what the stand-in must imitate.

``host`` in every snapshot and hello is ``SIMULATED-<name>``. :class:`StandinHosts` has the interface of
:class:`bench.fleet_hosts.FleetHosts` that bench/fleet.py uses (``spec``, ``farm_pid``, ``agent_pids`` (empty),
``close()``), so the same console workers follow it.

Usage: python bench/standin.py smoke [--hosts 8] [--profile mixed] [--backlog-hours 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.fleet_hosts import (
    DIAL_COMMAND,
    STATUS_COMMAND,
    FleetSpec,
    FleetStartError,
    client_spec,
    make_keys,
    smoke,
    start_server,
)

START_TIMEOUT_S = 600.0  # the stand-in writes every host's backlog before it listens
LABEL = "SIMULATED"
PROFILES = ("idle", "mixed", "busy")  # idle: as the fleet bench's real agents (8 idle GPUs); mixed: every other host busy
STEP_EVERY_S = 10.0  # agents/runs/run_telemetry.py STEP_EVENT_EVERY_S: a run's step records reach the journal this often
CHECKPOINT_EVERY_S = 1800.0
SLOW_S = 0.8  # a slow host answers and samples this late
# Real hosts do not send at the same microsecond: each wakes on the whole second by its own clock and CPU, and its
# snapshot crosses its own network path. One process building every host's snapshot in one pass would hand the
# console the whole fleet in one burst (fewer wake-ups than it gets from real hosts), so each host keeps a fixed
# phase in [0, spread) after the whole second. 20 ms is what 64 real agents on this machine spread over (their
# snapshot age p99, bench/RESULTS.md 28-scale). It is the dearer setting for the console: real agents' snapshots
# reach it in bunches (the arrival model below, bench/RESULTS.md 30-fid2: 1.15-1.75x real agents' cost at 16 and 64).
SPREAD_S = 0.020
SILENT_EVERY_S, SILENT_FOR_S, SILENT_FIRST_S = 120.0, 25.0, 90.0  # a silent host: from 90 s after start, 25 s of silence every 120 s
BACKLOG_QUEUED_MAX = 50_000  # backlog events queued in journals' writers at once while the stand-in writes them
RESTART_EVERY_S, RESTART_DOWN_S, RESTART_FIRST_S = 60.0, 2.0, 75.0  # a restarting host: down 2 s every 60 s
# The arrival model (--fidelity's "measured clusters"): snapshots reaching a console less than this apart form one
# cluster (the console takes them in one or a few passes of its loop). A group's hosts build their snapshots this long
# before the group's instant, so at the instant every one of them is only encoded and written.
CLUSTER_GAP_S = 0.001
GROUP_PREP_S = 0.003


def host_kind(i: int, profile: str) -> bool:
    """Whether host ``i`` carries a (SIMULATED) training run."""
    return profile == "busy" or (profile == "mixed" and i % 2 == 0)


def host_failure(i: int, failures: bool) -> str:
    """The failure host ``i`` plays (``none`` for most): 3 hosts in every 256 fail, one of each kind."""
    if not failures:
        return "none"
    return {37: "silent", 101: "restart", 165: "slow"}.get(i % 256, "none")


def arrival_clusters(arrivals: list[float], gap_s: float = CLUSTER_GAP_S) -> list[tuple[int, float]]:
    """Snapshot arrivals at a console (wall clock, s) cut into clusters: a run of arrivals each less than ``gap_s``
    after the one before. Each cluster as (its size, its first arrival's offset after that arrival's whole second)."""
    clusters: list[tuple[int, float]] = []
    last = float("-inf")
    for t in sorted(arrivals):
        if t - last < gap_s:
            size, off = clusters[-1]
            clusters[-1] = (size + 1, off)
        else:
            clusters.append((1, t - int(t)))
        last = t
    return clusters


def loop_passes(arrivals: list[float], wakes: list[int]) -> list[tuple[int, float]]:
    """The snapshots a console took in each pass of its event loop (``wakes``: the counts, in order; ``arrivals``:
    every snapshot's arrival in the order it was taken), as (count, the pass's first arrival's offset after its
    whole second): the same shape as :func:`arrival_clusters`, cut by the console's own passes instead of a gap."""
    got: list[tuple[int, float]] = []
    i = 0
    for k in wakes:
        if k < 1 or i >= len(arrivals):
            continue
        t = arrivals[i]
        got.append((k, t - int(t)))
        i += k
    return got


class GroupClock:
    """The SIMULATED arrival pattern of the measured-clusters model: every second the hosts are dealt (shuffled) into
    groups whose (size, offset after the whole second) pairs are drawn from clusters measured at a console that
    followed real agents (:func:`arrival_clusters`); a group's hosts are released together at its offset, so their
    snapshots are written in one pass of the stand-in's loop, as a bunch the console reads in one wake-up."""

    def __init__(self, n: int, clusters: list[tuple[int, float]], seed: int = 33, cork: bool = True) -> None:
        if not clusters:
            raise ValueError("the arrival model needs at least one measured cluster")
        self.n, self.cork = n, cork
        self.hosts: list[SimHost] = []  # filled by the stand-in once its hosts exist (index = host number)
        self.clusters = [(max(1, int(k)), min(max(float(off), 0.0), 0.5)) for k, off in clusters]
        self.rng = random.Random(seed)
        self.plans: dict[int, list[tuple[float, asyncio.Future]]] = {}

    def slot(self, i: int, second: int) -> tuple[float, asyncio.Future]:
        """Host ``i``'s instant in ``second`` (wall clock) and the future its group is released by."""
        plan = self.plans.get(second)
        if plan is None:
            plan = self.plans[second] = self._plan(second)
            for old in [s for s in self.plans if s < second - 2]:
                del self.plans[old]
        return plan[i]

    def _plan(self, second: int) -> list[tuple[float, asyncio.Future]]:
        loop = asyncio.get_running_loop()
        order = list(range(self.n))
        self.rng.shuffle(order)
        plan: list[tuple[float, asyncio.Future] | None] = [None] * self.n
        j = 0
        while j < self.n:
            size, off = self.rng.choice(self.clusters)
            at = second + off
            fut = loop.create_future()
            members = order[j : j + size]
            loop.call_at(loop.time() + (at - time.time()), self._release, fut, members)
            for h in members:
                plan[h] = (at, fut)
            j += size
        return plan  # type: ignore[return-value]

    def _release(self, fut: asyncio.Future, members: list[int]) -> None:
        """The group's instant: its hosts write in the next pass of the loop. With ``cork`` their sockets hold what
        is written (TCP_CORK) until every one has written, then all are pushed at once. Uncorked, the group goes out
        one host after another (each encoded, encrypted, sent) and the console, on another core, woke for many of
        them apart (bench/RESULTS.md 30-fid2, run 1); corked, it goes out in one uncork call a host."""
        if fut.done():
            return
        socks = [sk for i in members if i < len(self.hosts) for sk in self.hosts[i].sockets()] if self.cork else []
        for sk in socks:
            _set_cork(sk, True)
        fut.set_result(None)  # the members' tasks run next, in the order they awaited: before the uncork below
        if socks:
            asyncio.get_running_loop().call_soon(_uncork, socks)


def _set_cork(sock: Any, on: bool) -> None:
    import socket

    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1 if on else 0)
    except (OSError, ValueError):
        pass  # the connection is gone


def _uncork(socks: list[Any]) -> None:
    for sk in socks:
        _set_cork(sk, False)


# ---------------------------------------------------------------------------- the parent side


class StandinHosts:
    """N SIMULATED hosts served by one stand-in process (see the module doc); the FleetHosts interface for bench/fleet.py."""

    def __init__(
        self,
        n: int,
        gpus: str = "8:H200",
        base_dir: Path | None = None,
        *,
        profile: str = "mixed",
        failures: bool = True,
        backlog_hours: float = 0.0,
        spread_s: float = SPREAD_S,
        offsets: list[float] | None = None,
        clusters: list[tuple[int, float]] | None = None,
        cork: bool = True,
        python: str = sys.executable,
        progress: Callable[[str], None] | None = None,
        keep: bool = False,
        ciphers: str | None = None,
    ) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one host")
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}, not {profile!r}")
        self.n, self.gpus, self.profile, self.failures, self.backlog_hours = n, gpus, profile, failures, backlog_hours
        self.ciphers, self.python, self.keep, self.spread_s = ciphers, python, keep, spread_s
        # measured send offsets after the whole second (real agents' snapshot ``ts`` - its whole second, seconds):
        # when given, every host draws its phase from these for every snapshot instead of a fixed phase in [0, spread)
        self.offsets = [min(max(float(x), 0.0), 0.5) for x in offsets] if offsets else None
        # measured arrival clusters at a console following real agents, (size, offset after the whole second): when
        # given, the hosts send in groups drawn from these every second (GroupClock), overriding offsets and spread
        self.clusters = [(int(k), float(off)) for k, off in clusters] if clusters else None
        self.cork = cork  # a group's writes held (TCP_CORK) until all are written, then pushed together
        self._progress = progress or (lambda _msg: None)
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.mkdtemp(prefix="gds-", dir="/tmp"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.names = [f"s{i:04d}" for i in range(n)]
        self.homes = [self.base_dir / nm for nm in self.names]
        self.agents: list[subprocess.Popen] = []  # none: every host is in the stand-in process
        self.farm: subprocess.Popen | None = None
        self.spec: FleetSpec | None = None
        self.ready: dict[str, Any] = {}
        self.start_seconds = 0.0
        t0 = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0

    @property
    def agent_pids(self) -> list[int]:
        """No agent processes: the hosts live in the stand-in (``farm_pid``)."""
        return []

    @property
    def farm_pid(self) -> int:
        """The stand-in process's pid (SSH server and every SIMULATED host)."""
        assert self.farm is not None
        return self.farm.pid

    def journal_path(self, i: int) -> Path:
        """Host ``i``'s journal (a real one)."""
        from gpudeck.agents.wire import paths

        return paths.journal_path(self.homes[i] / "agent")

    def close(self) -> None:
        """Stop the stand-in (by pid); remove the folder unless ``keep``."""
        p = self.farm
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.farm = None
        if self._own_dir and not self.keep:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> StandinHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        keys = make_keys(self.base_dir, "gpudeck-bench-standin")
        spec = {
            "hosts": [{"name": nm, "home": str(h)} for nm, h in zip(self.names, self.homes)],
            "gpus": self.gpus,
            "profile": self.profile,
            "failures": self.failures,
            "backlog_hours": self.backlog_hours,
            "spread_s": self.spread_s,
            "offsets": self.offsets,
            "clusters": self.clusters,
            "cork": self.cork,
            "host_key": str(keys.dir / "host_ed25519"),
            "authorized_keys": str(keys.dir / "authorized_keys"),
            "ready": str(self.base_dir / "standin.ready.json"),
        }
        self.farm = start_server(self.python, Path(__file__).resolve(), "serve", spec, self.base_dir, "standin")
        ready = Path(spec["ready"])
        deadline = time.monotonic() + START_TIMEOUT_S
        last = ""
        while not ready.exists():
            if self.farm.poll() is not None:
                raise FleetStartError(f"the {LABEL} stand-in exited with {self.farm.returncode}: {self._tail()}")
            if time.monotonic() > deadline:
                raise FleetStartError(f"the {LABEL} stand-in did not listen within {START_TIMEOUT_S:.0f} s: {self._tail()}")
            tail = self._tail(200).splitlines()[-1:] or [""]
            if tail[0] != last and tail[0].startswith("standin progress"):
                last = tail[0]
                self._progress(last)
            time.sleep(0.2)
        self.ready = json.loads(ready.read_text())
        ports = self.ready["ports"]
        self.spec = client_spec(self.base_dir, keys, list(self.names), list(self.homes), ports, self.gpus, self.ciphers)
        self._progress(
            f"{LABEL} stand-in (pid {self.farm.pid}) serves {len(ports)} hosts ({self.profile}; failures {'on' if self.failures else 'off'}); "
            f"backlog {self.ready.get('backlog_events', 0)} events written in {self.ready.get('backlog_s', 0):.1f} s"
        )

    def _tail(self, n: int = 1500) -> str:
        try:
            return (self.base_dir / "standin.log").read_text(errors="replace")[-n:].strip() or "(empty)"
        except OSError:
            return "(no log)"


# ---------------------------------------------------------------------------- the stand-in process


class _NoProcs:
    """The sampler's process table for a SIMULATED host: no real process holds its GPUs (the run's are made up)."""

    def refresh(self) -> None:
        pass

    def sim_holders(self) -> list:
        return []


class _Gpus:
    """What the daemon's connection reads of an agent's GPU source, for a SIMULATED host."""

    simulated = True
    available = True
    error: str | None = None
    driver_version = "simulated"

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.count = sampler.count


class _Containment:
    label = f"{LABEL} stand-in: no processes, no containment"


class _Supervisor:
    """The few supervisor reads the daemon's connection makes; everything that would act on a host is refused."""

    containment = _Containment()

    def __init__(self, host: SimHost) -> None:
        self.h = host

    def live_runs(self) -> list:
        return [self.h.run] if self.h.run is not None else []

    def resolve(self, run_id: str):  # type: ignore[no-untyped-def]
        from gpudeck.agents.wire.errors import BadRequest

        run = self.h.run
        if run is not None and run_id and run.id.startswith(run_id):
            return run
        hit = self.h.journal.get_run(run_id)
        if hit is None:
            raise BadRequest(f"no run {run_id!r} on the {LABEL} host {self.h.name}")
        return hit

    def run_state(self, run_id: str) -> str | None:
        run = self.h.run
        return run.state if run is not None and run.id == run_id else None

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        from gpudeck.agents.wire.errors import BadRequest

        async def refused(*_a: object, **_k: object) -> None:
            raise BadRequest(f"{name}: the host is a {LABEL} stand-in (bench/standin.py): it serves snapshots, events and runs only")

        return refused


class SimHost:
    """One SIMULATED host: the attributes of :class:`gpudeck.agents.server.daemon.Agent` its connections read."""

    def __init__(
        self,
        i: int,
        name: str,
        home: Path,
        gpus_spec: str,
        profile: str,
        failures: bool,
        t_start: float,
        spread: float = SPREAD_S,
        offsets: list[float] | None = None,
        clock: GroupClock | None = None,
    ) -> None:
        from gpudeck.agents.observe import namespace as pid_namespace
        from gpudeck.agents.observe.gpus_sim import SimulatedGpuSampler
        from gpudeck.agents.storage.journal import Journal
        from gpudeck.agents.wire import paths

        self.i, self.name = i, name
        self.host = f"{LABEL}-{name}"
        self.state_dir = home / "agent"
        paths.ensure_private_dir(self.state_dir)
        self.journal = Journal(paths.journal_path(self.state_dir), self.host)
        self.gpus = _Gpus(SimulatedGpuSampler(gpus_spec, _NoProcs()))  # type: ignore[arg-type]
        self.supervisor = _Supervisor(self)
        self.uid = os.getuid()
        self.namespace = pid_namespace.current()
        self.event_waiters: set[asyncio.Event] = set()
        self.busy = host_kind(i, profile)
        self.failure = host_failure(i, failures)
        self.t_start = t_start
        self.conns: set[Any] = set()
        self.sessions: set[Any] = set()  # the SSH sessions serving `agent dial` (their sockets: the arrival model corks them)
        self.down = False  # a restarting host between stop and start: dial finds no agent
        self.silent = asyncio.Event()  # set: answers; clear: stops answering (replies and snapshots wait)
        self.silent.set()
        self.run = None
        self.step = 0
        self.rng = random.Random(i)
        self.next_step_ev = 0.0
        self.next_ckpt_ev = 0.0
        self.pids = [100000 + i * 16 + r for r in range(10)]
        self.phase = spread * ((i * 0.6180339887) % 1.0)  # spread evenly, the same for a host every second
        self.offsets = offsets  # measured: a fresh phase drawn from these for every snapshot (overrides the fixed one)
        self.clock = clock  # measured clusters: the host sends with its group (overrides both)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the journal: a SIMULATED run's life, written as the real agent writes it

    def start_run(self, at: float, record: bool = True) -> None:
        """A SIMULATED 8-rank fsdp run; ``record``: journal it (created, running, members, manifest) as a launch would."""
        from gpudeck.agents.wire.protocol import LaunchSpec, Member, RunInfo, RunTelemetry

        rid = "sim-run-a"  # the same on every host (a run id is per host): the backlog's template journal holds it
        argv = ["torchrun", "--nproc-per-node", "8", "-m", "gpudeck.trainers.fsdp_lm", "--config", "configs/llama-8b.toml"]
        spec = LaunchSpec(
            argv=argv, name=f"{LABEL}-pretrain-{self.name}", kind="fsdp", gpus=list(range(8)), start="fresh", operator="bench"
        )
        ct = at - 1.0
        members = [Member(pid=self.pids[0], create_time=ct, role="leader", first_seen=at, cmdline=tuple(argv[:8]), found_by="tag")]
        members += [
            Member(
                pid=self.pids[1 + r],
                create_time=ct + 1,
                role="worker",
                rank=r,
                local_rank=r,
                first_seen=at,
                cmdline=("python", "-m", "gpudeck.trainers.fsdp_lm"),
                found_by="tag",
            )
            for r in range(8)
        ]
        run = RunInfo(
            id=rid,
            host=self.host,
            state="running",
            spec=spec,
            name=spec.name,
            created=at,
            started=at,
            run_dir=str(self.state_dir / "runs" / rid),
            members=members,
            telemetry=RunTelemetry(world_size=8, params_total=8_030_261_248, config_hash="sim0000", start="fresh"),
        )
        self.run = run
        if not record:
            return
        self.journal.create_run(msgspec_replace(run, state="starting", members=[]))
        self.journal.update_run(rid, "run_state", {"state": "running", "pid": self.pids[0], "started": at}, state="running", started=at)
        self.journal.append("members", rid, {"members": [_member_dict(m) for m in members]})
        manifest = {"ts": at, "rank": 0, "type": "manifest", "params_total": 8_030_261_248, "world_size": 8, "config_hash": "sim0000"}
        self.journal.append("telemetry", rid, {"record": manifest, "offset": 0})

    def step_events(self, t: float, offset: int) -> list[tuple[str, str | None, dict[str, Any]]]:
        """The journal items a run's telemetry gives at time ``t``: a step record (and a checkpoint when due)."""
        assert self.run is not None
        self.step += 25  # a step every 0.4 s, journaled every 10 s
        loss = round(2.0 + 8.0 / (1.0 + self.step / 2000.0) + self.rng.uniform(-0.02, 0.02), 5)
        rec = {
            "ts": t,
            "rank": 0,
            "type": "step",
            "step": self.step,
            "loss": loss,
            "tokens_per_s": round(412_000 + self.rng.uniform(-4000, 4000), 2),
            "mfu": round(0.41 + self.rng.uniform(-0.005, 0.005), 5),
            "mem_allocated_gib": 61.2,
            "mem_peak_gib": 118.4,
            "lr": 3e-4,
            "grad_norm": round(0.8 + self.rng.uniform(-0.1, 0.1), 4),
            "step_time_s": 0.39812,
            "tokens": self.step * 163840,
        }
        items: list[tuple[str, str | None, dict[str, Any]]] = [("telemetry", self.run.id, {"record": rec, "offset": offset})]
        if t >= self.next_ckpt_ev:
            self.next_ckpt_ev = t + CHECKPOINT_EVERY_S
            ck = {"ts": t, "rank": 0, "type": "checkpoint", "step": self.step, "path": f"ckpt/step-{self.step}"}
            items.append(("telemetry", self.run.id, {"record": ck, "offset": offset + 1}))
        return items

    def adopt_backlog(self, t0: float, last_step: int) -> int:
        """The journal is a copy of the template (see :func:`make_template`): the run it records, in memory."""
        self.start_run(t0, record=False)
        self.step = last_step
        assert self.run is not None and self.run.telemetry is not None
        self.run.telemetry.step = last_step
        self.next_ckpt_ev = time.time() + CHECKPOINT_EVERY_S
        return self.journal.committed_seq

    def write_backlog(self, hours: float) -> int:
        """``hours`` of journal as the real agent would have written it (queued; the writer thread commits it)."""
        if hours <= 0:
            if self.busy:
                self.start_run(time.time())
            return 0
        t0 = time.time() - hours * 3600
        n = 1
        self.journal.append("agent_started", None, {"pid": os.getpid(), "version": "simulated", "simulated": True})
        if not self.busy:
            return n
        self.start_run(t0)
        n += 4
        items: list[tuple[str, str | None, dict[str, Any]]] = []
        t = t0 + (self.i % 10)
        self.next_ckpt_ev = t0 + CHECKPOINT_EVERY_S
        while t < time.time():
            items += self.step_events(t, offset=n)
            t += STEP_EVERY_S
            if len(items) >= 1000:
                self.journal.append_many(items)
                n += len(items)
                items = []
        if items:
            self.journal.append_many(items)
            n += len(items)
        self.run.telemetry.step = self.step  # type: ignore[union-attr]
        return n

    # -- the live host, once a second (one tick for all hosts)

    def tick(self, now: float, wall: float) -> None:
        if self.busy and self.run is not None and wall >= self.next_step_ev:
            if self.next_step_ev:
                self.journal.append_many(self.step_events(wall, offset=self.step))
                tel = self.run.telemetry
                if tel is not None:
                    tel.step, tel.last_ts = self.step, wall
            self.next_step_ev = wall + STEP_EVERY_S
        since = now - self.t_start
        if self.failure == "silent" and since >= SILENT_FIRST_S:
            quiet = (since - SILENT_FIRST_S) % SILENT_EVERY_S < SILENT_FOR_S
            if quiet and self.silent.is_set():
                self.silent.clear()
            elif not quiet and not self.silent.is_set():
                self.silent.set()
        if self.failure == "restart" and since >= RESTART_FIRST_S:
            phase = (since - RESTART_FIRST_S) % RESTART_EVERY_S
            if phase < RESTART_DOWN_S and not self.down:
                self.down = True
                for c in list(self.conns):
                    c.abort()
            elif phase >= RESTART_DOWN_S and self.down:
                self.down = False
                self.journal.append("agent_started", None, {"pid": os.getpid(), "version": "simulated", "simulated": True, "restart": True})

    def sockets(self) -> list[Any]:
        """The TCP sockets of this host's open `agent dial` sessions."""
        got = []
        for sess in self.sessions:
            sk = sess.chan.get_extra_info("socket") if sess.chan is not None and not sess.lost else None
            if sk is not None:
                got.append(sk)
        return got

    async def gate(self) -> None:
        """A silent host holds every reply here; a slow one answers late."""
        if not self.silent.is_set():
            await self.silent.wait()
        if self.failure == "slow":
            await asyncio.sleep(SLOW_S)

    # -- what the daemon's connection calls

    async def snapshot(self):  # type: ignore[no-untyped-def]
        await self.gate()
        if self.clock is not None:
            now = time.time()
            at, released = self.clock.slot(self.i, int(now + 0.1))  # the stream wakes just after its whole second
            if at - GROUP_PREP_S > now:
                await asyncio.sleep(at - GROUP_PREP_S - now)
            snap = self.build()
            await released  # with the rest of its group, in one pass of the loop
            return snap
        phase = self.rng.choice(self.offsets) if self.offsets else self.phase
        if phase > 0:
            await asyncio.sleep(phase)
        return self.build()

    def build(self):  # type: ignore[no-untyped-def]
        from gpudeck.agents.safety import unaccounted
        from gpudeck.agents.wire.protocol import GpuProcess, ProcInfo, Snapshot

        t0 = time.perf_counter()
        gpus = self.gpus.sampler.sample()
        procs: list[ProcInfo] = []
        run = self.run
        if run is not None:
            ct = run.created
            for g in gpus:
                u = 88 + self.rng.randint(0, 11)
                used = int(118.4 * 2**30) + self.rng.randint(0, 1 << 24)
                g.memory_used = used
                g.util_gpu, g.util_mem = u, round(0.4 * u)
                g.temperature_c = 30 + round(0.45 * u)
                g.power_w = round((g.power_limit_w or 700.0) * (0.1 + 0.8 * u / 100), 1)
                g.unaccounted_bytes = 0
                g.processes = (
                    GpuProcess(
                        pid=self.pids[1 + g.index],
                        gpu=g.index,
                        used_bytes=used,
                        attribution="RUN",
                        run_id=run.id,
                        rank=g.index,
                        user="bench",
                        status="running",
                        create_time=ct,
                        cmdline=("python", "-m", "gpudeck.trainers.fsdp_lm"),
                    ),
                )
                procs.append(
                    ProcInfo(
                        pid=self.pids[1 + g.index],
                        ppid=self.pids[0],
                        pgid=self.pids[0],
                        sid=self.pids[0],
                        user="bench",
                        create_time=ct,
                        status="running",
                        rss=9 << 30,
                        cpu_seconds=round(time.time() - ct, 2),
                        cmdline=("python", "-m", "gpudeck.trainers.fsdp_lm"),
                        run_id=run.id,
                        rank=g.index,
                        local_rank=g.index,
                    )
                )
        return Snapshot(
            host=self.host,
            ts=time.time(),
            epoch=self.journal.epoch,
            gpus=gpus,
            simulated=True,
            storage_error=self.journal.storage_error,
            runs=[run] if run is not None else [],
            processes=procs,
            last_seq=self.journal.committed_seq,
            sample_ms=round((time.perf_counter() - t0) * 1000, 3),
            namespace=self.namespace,
            unaccounted=unaccounted.unaccounted(gpus, self.namespace, True),
            journal_note=None,
        )

    def journal_note(self) -> str | None:
        return f"journal problem: {self.journal.problem}" if self.journal.problem else None

    def hook_journal(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake this host's event pulls on every commit, as the agent does."""
        self._loop = loop

        def on_commit(_seq: int) -> None:  # the journal's writer thread
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:
                pass

        self.journal.on_commit = on_commit

    def _wake(self) -> None:
        for w in self.event_waiters:
            w.set()


def make_template(where: Path, hours: float, gpus: str, t_start: float) -> tuple[Path, float, int] | None:
    """One busy host's ``hours`` of journal, written once through the real Journal; each busy host gets a copy with
    its own epoch (writing 2 million events one host at a time took this machine minutes). (path, run start, last step)."""
    if hours <= 0:
        return None
    host = SimHost(0, "template", where, gpus, "busy", False, t_start)
    host.write_backlog(hours)
    host.journal.close()  # committed, the WAL folded into the file
    assert host.run is not None
    return host.journal.path, host.run.created, host.step


def copy_journal(template: Path, state_dir: Path) -> None:
    """A copy of the template journal as this host's, with an epoch of its own (0600, in a private folder)."""
    import sqlite3
    import uuid

    from gpudeck.agents.wire import paths

    paths.ensure_private_dir(state_dir)
    dest = paths.journal_path(state_dir)
    paths.ensure_private_dir(dest.parent)
    shutil.copyfile(template, dest)
    os.chmod(dest, 0o600)
    conn = sqlite3.connect(dest)
    try:
        with conn:
            conn.execute("UPDATE meta SET value=? WHERE key='epoch'", (str(uuid.uuid4()),))
    finally:
        conn.close()


def msgspec_replace(obj: Any, **changes: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(obj, **changes)


def _member_dict(m: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(m)


def _conn_class():  # type: ignore[no-untyped-def]
    """The daemon's own connection class, with the host's failure gate before every request."""
    from gpudeck.agents.server import daemon

    class SimConn(daemon.Connection):
        async def handle(self, req):  # type: ignore[no-untyped-def]
            await self.agent.gate()
            await super().handle(req)

    return SimConn


class _Transport:
    """The writer's transport as the daemon's connection uses it, over an SSH channel."""

    def __init__(self, session: Any) -> None:  # the Session of _make_session_class
        self.s = session

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        assert self.s.chan is not None
        self.s.chan.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self.s.chan.get_write_buffer_size() if self.s.chan is not None else 0

    def close(self) -> None:  # the agent closed the socket: `agent dial` exits 0, the channel closes
        chan = self.s.chan
        if chan is not None:
            try:
                chan.exit(0)
            except (OSError, RuntimeError, Exception):
                pass

    def abort(self) -> None:
        if self.s.chan is not None:
            self.s.chan.abort()


class _Writer:
    def __init__(self, session: Any) -> None:  # the Session of _make_session_class
        self.s = session
        self.transport = _Transport(session)

    def write(self, data: bytes) -> None:
        if self.s.lost:
            raise ConnectionResetError("the SSH channel is closed")
        assert self.s.chan is not None
        self.s.chan.write(data)

    async def drain(self) -> None:
        if self.s.lost:
            raise ConnectionResetError("the SSH channel is closed")
        await self.s.can_write.wait()

    def close(self) -> None:
        self.transport.close()

    async def wait_closed(self) -> None:
        return None


def _make_session_class():  # type: ignore[no-untyped-def]
    import asyncssh

    class Session(asyncssh.SSHServerSession):
        """One exec channel: ``gpudeck agent dial`` is served by the daemon's connection class in this process;
        ``gpudeck status --json`` answers one snapshot (the exec-per-tick peer)."""

        def __init__(self, host: SimHost, conn_cls: type) -> None:
            self.host = host
            self.conn_cls = conn_cls
            self.chan: asyncssh.SSHServerChannel | None = None
            self.reader = asyncio.StreamReader(limit=1 << 20)
            self.can_write = asyncio.Event()
            self.can_write.set()
            self.lost = False
            self.cmd = ""
            self.task: asyncio.Task | None = None
            self.conn: Any = None

        def connection_made(self, chan: asyncssh.SSHServerChannel) -> None:
            self.chan = chan

        def shell_requested(self) -> bool:
            return False

        def exec_requested(self, command: str) -> bool:
            self.cmd = command.strip()
            return True

        def session_started(self) -> None:
            assert self.chan is not None
            if self.cmd.endswith(DIAL_COMMAND):
                if self.host.down:
                    self.chan.write_stderr(
                        f"gpudeck agent dial: no agent answers on {self.host.state_dir}/sock/agent.sock ({LABEL} restart)\n".encode()
                    )
                    self.chan.exit(1)
                    return
                self.conn = self.conn_cls(self.host, self.reader, _Writer(self))
                self.host.conns.add(self.conn)
                self.host.sessions.add(self)
                self.task = asyncio.ensure_future(self._serve())
            elif self.cmd.endswith(STATUS_COMMAND):
                self.task = asyncio.ensure_future(self._status())
            else:
                self.chan.write_stderr(f"{self.cmd or '(shell)'}: command not found ({LABEL} stand-in)\n".encode())
                self.chan.exit(127)

        async def _serve(self) -> None:
            try:
                await self.conn.run()
            finally:
                self.host.conns.discard(self.conn)

        async def _status(self) -> None:
            import msgspec

            snap = await self.host.snapshot()
            assert self.chan is not None
            self.chan.write(msgspec.json.encode(snap) + b"\n")
            self.chan.exit(0)

        def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
            self.reader.feed_data(data)

        def eof_received(self) -> bool:
            self.reader.feed_eof()
            return True  # half-closed: the connection answers what is in flight, then closes (as dial does)

        def connection_lost(self, exc: Exception | None) -> None:
            self.lost = True
            self.host.sessions.discard(self)
            self.can_write.set()
            if not self.reader.at_eof():
                self.reader.feed_eof()
            if self.conn is not None:
                self.conn.abort()

        def pause_writing(self) -> None:
            self.can_write.clear()

        def resume_writing(self) -> None:
            self.can_write.set()

    return Session


def _no_ignore_padding() -> None:
    import asyncssh

    from bench.fleet_hosts import _no_ignore_padding as patch

    patch(asyncssh)


async def _serve_main(spec_path: Path) -> None:
    import asyncssh

    import gpudeck.agents.server.daemon as daemon

    _no_ignore_padding()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # about 9 descriptors a host: journal, listener, connection
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    spec = json.loads(Path(spec_path).read_text())
    t_start = time.monotonic()
    loop = asyncio.get_running_loop()
    if os.environ.get("STANDIN_EXECUTOR_THREADS"):  # the threads that read the journals (asyncio's default: cpus + 4, at most 32)
        from concurrent.futures import ThreadPoolExecutor

        loop.set_default_executor(ThreadPoolExecutor(int(os.environ["STANDIN_EXECUTOR_THREADS"]), thread_name_prefix="standin-read"))
    hosts: list[SimHost] = []
    n = len(spec["hosts"])
    t0 = time.monotonic()
    backlog = 0
    template = make_template(Path(spec_path).parent / "template", float(spec["backlog_hours"]), spec["gpus"], t_start)
    clusters = [(int(k), float(off)) for k, off in spec.get("clusters") or []]
    clock = GroupClock(n, clusters, cork=bool(spec.get("cork", True))) if clusters else None
    unflushed: list[tuple[SimHost, int]] = []  # backlogs queued, not yet waited for: bounded, so memory stays flat
    for i, h in enumerate(spec["hosts"]):
        if template is not None and host_kind(i, spec["profile"]):
            copy_journal(template[0], Path(h["home"]) / "agent")
        host = SimHost(
            i,
            h["name"],
            Path(h["home"]),
            spec["gpus"],
            spec["profile"],
            spec["failures"],
            t_start,
            float(spec["spread_s"]),
            spec.get("offsets"),
            clock,
        )
        if template is not None and host.busy:
            queued = host.adopt_backlog(template[1], template[2])
        else:
            queued = host.write_backlog(float(spec["backlog_hours"]))
        backlog += queued
        unflushed.append((host, queued))
        while sum(q for _h, q in unflushed) > BACKLOG_QUEUED_MAX:
            await asyncio.to_thread(unflushed.pop(0)[0].journal.flush, 600)
        host.hook_journal(loop)
        hosts.append(host)
        if clock is not None:
            clock.hosts.append(host)
        if (i + 1) % 64 == 0 or i + 1 == n:
            print(f"standin progress: {i + 1}/{n} hosts, {backlog} journal events queued, {time.monotonic() - t0:.1f} s", flush=True)
    for host in hosts:  # every backlog on disk before anyone is served
        await asyncio.to_thread(host.journal.flush, 600)
    backlog_s = time.monotonic() - t0
    print(f"standin progress: backlog of {backlog} events on disk in {backlog_s:.1f} s", flush=True)
    conn_cls = _conn_class()
    session_cls = _make_session_class()
    host_key = asyncssh.read_private_key(spec["host_key"])
    authorized = asyncssh.read_authorized_keys(spec["authorized_keys"])

    def server_factory(host: SimHost):  # type: ignore[no-untyped-def]
        class Server(asyncssh.SSHServer):
            def session_requested(self):  # type: ignore[no-untyped-def]
                return session_cls(host, conn_cls)

        return Server

    acceptors = []
    for host in hosts:
        acc = await asyncssh.listen(
            host="127.0.0.1",
            port=0,
            server_host_keys=[host_key],
            authorized_client_keys=authorized,
            server_factory=server_factory(host),
            encoding=None,
            allow_scp=False,
            agent_forwarding=False,
            x11_forwarding=False,
            login_timeout=120,
            backlog=1024,
        )
        acceptors.append(acc)
    for host in hosts:
        host.t_start = time.monotonic()
    ready = Path(spec["ready"])
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"pid": os.getpid(), "ports": [a.get_port() for a in acceptors], "backlog_events": backlog, "backlog_s": backlog_s})
    )
    os.replace(tmp, ready)
    print(
        f"standin progress: {LABEL} stand-in listening for {n} hosts (daemon connection class {daemon.Connection.__module__})", flush=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def ticker() -> None:
        while True:
            await asyncio.sleep(1.0 - time.time() % 1.0 + 0.5)  # half-way between the snapshot instants
            now, wall = time.monotonic(), time.time()
            for host in hosts:
                host.tick(now, wall)

    tick_task = asyncio.ensure_future(ticker())
    await stop.wait()
    tick_task.cancel()
    for a in acceptors:
        a.close()
    for host in hosts:
        for c in list(host.conns):
            c.abort()
    for host in hosts:
        await asyncio.to_thread(host.journal.close)


# ---------------------------------------------------------------------------- smoke check


def main(argv: list[str] | None = None) -> int:
    """``serve SPEC`` runs the stand-in (StandinHosts starts it); ``smoke`` brings one up and follows it briefly."""
    ap = argparse.ArgumentParser(description=f"{LABEL} host stand-in: many simulated hosts in one process, over SSH and the agent protocol")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("serve")
    f.add_argument("spec", type=Path)
    s = sub.add_parser("smoke")
    s.add_argument("--hosts", type=int, default=4)
    s.add_argument("--gpus", default="8:H200")
    s.add_argument("--profile", default="mixed", choices=PROFILES)
    s.add_argument("--backlog-hours", type=float, default=0.0)
    s.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        asyncio.run(_serve_main(args.spec))
        return 0
    from bench.fleet_hosts import stop_on_signals

    stop_on_signals()
    t0 = time.monotonic()
    with StandinHosts(
        args.hosts,
        args.gpus,
        profile=args.profile,
        backlog_hours=args.backlog_hours,
        progress=lambda m: print(m, file=sys.stderr, flush=True),
    ) as sh:
        print(f"standin smoke: {args.hosts} {LABEL} hosts up in {time.monotonic() - t0:.1f} s (base {sh.base_dir})", flush=True)
        assert sh.spec is not None
        asyncio.run(smoke(sh.spec, args.seconds, "standin"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
