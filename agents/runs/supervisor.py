"""Provides the run supervisor: the coordinator that owns every run on this host and hands each step to its module.

Every run's life is owned by the registry (:class:`~gpudeck.agents.runs.registry.RunRegistry`,
``Supervisor.runs``): the only writer of run state, each change declared in
:mod:`gpudeck.agents.runs.states` and journaled with its evidence. The supervisor
says which run a process belongs to (:mod:`gpudeck.agents.safety.attribution`) and
hands each step to a module that does what its name says, through public methods only:

- :mod:`gpudeck.agents.runs.launch`: pre-flight, the record, the group, the spawn (the argv read once);
- :mod:`gpudeck.agents.runs.tick`: the supervision tick, its reads in a thread, its decisions on the loop;
- :mod:`gpudeck.agents.runs.run_telemetry`: a run's telemetry folded and journaled;
- :mod:`gpudeck.agents.health.claims`: claims against what was observed;
- :mod:`gpudeck.agents.runs.ending`: whether a run lives (the kernel judges), how it ended, journaled;
- :mod:`gpudeck.agents.runs.stop`: stop one run (the sequence is shared with reclaim);
- :mod:`gpudeck.agents.runs.reclaim`: the leftovers of ended runs, listed and stopped;
- :mod:`gpudeck.agents.runs.adoption`: runs and groups taken over after an agent restart.

Members are recorded as ``(pid, create_time)``; nothing is signalled whose create_time no longer matches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec

from gpudeck.agents.health import claims
from gpudeck.agents.observe.gpus import GpuSource
from gpudeck.agents.observe.ledger import Ledger
from gpudeck.agents.observe.procs import ProcTable
from gpudeck.agents.runs import adoption, launch, reclaim, run_telemetry, stop
from gpudeck.agents.runs import tick as ticks
from gpudeck.agents.runs.launch import LaunchPlan, spawn
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.runs.registry import RunRegistry
from gpudeck.agents.safety.attribution import Attribution
from gpudeck.agents.safety.containment import LABELS, Containment, RunGroup, detect
from gpudeck.agents.safety.membership import TreeWatch
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire import paths
from gpudeck.agents.wire.errors import BadRequest, NotFound
from gpudeck.agents.wire.protocol import (
    ClaimRow,
    ContainmentInfo,
    EnvFingerprint,
    Event,
    Gpu,
    GpuProcess,
    LaunchSpec,
    Leftover,
    PreflightResult,
    RunInfo,
    StopResult,
)

log = logging.getLogger("gpudeck.agent")


class Supervisor:
    """Owns every run on this host: launch, membership, exit, stop, re-adoption."""

    def __init__(
        self,
        journal: Journal,
        runs_dir: Path,
        host: str,
        gpus: GpuSource,
        procs: ProcTable | None = None,
        on_event: Callable[[Event], None] | None = None,
        containment: Containment | None = None,
    ) -> None:
        self.journal = journal
        self.runs_dir = paths.ensure_private_dir(Path(runs_dir))  # 0700, also when an older version made it 0755
        self.host = host
        self.gpus = gpus
        self.procs = procs if procs is not None else ProcTable()
        self.containment = containment if containment is not None else detect(self.runs_dir)
        self.uid = os.getuid()
        self.attribution = Attribution(self.containment, self.run_state)
        # the one owner of every run's life: live, stopping and ended runs, and the only writer of their state
        self.runs = RunRegistry(journal, host, self.containment, on_event or (lambda ev: None), self.attribution.index)
        self.launch_lock = asyncio.Lock()  # one launch at a time: request ids and run ids are checked, then recorded
        self._bg: set[asyncio.Task] = set()
        self.adopt_notes: list[str] = []
        self.ledger = Ledger.from_env(journal)  # who held each GPU, journaled as it changes (fed by the tick)
        self.tree = TreeWatch()  # the tick's parentage for tag-level runs: what changed, not the whole host
        # fills in a GPU process's attribution (RUN/STALE/FOREIGN/NO_SUCH_PROCESS); set by the agent
        self.attribute: Callable[[GpuProcess], None] = lambda p: None
        log.info("containment: %s", self.containment.label)
        # the table re-checks at every refresh only the tags of this agent's runs (a run is recorded before any of its
        # processes starts), not every tagged process on a shared host
        self.procs.watch_own(lambda rid: self.run_state(rid) is not None)

    def live_runs(self) -> list[RunInfo]:
        """Runs that are not over, as the supervisor tracks them."""
        return [lr.info for lr in self.runs.live()]

    def run_state(self, run_id: str) -> str | None:
        """State of a run this agent knows; None for an unknown id."""
        return self.runs.run_state(run_id)

    def with_containment(self, run: RunInfo) -> RunInfo:
        """The live run's own record, or ``run`` with its containment read from the journal."""
        lr = self.runs.get(run.id)
        if lr is not None:
            return lr.info
        if run.containment is None:
            ev = self.journal.last_event(run.id, "containment")
            if ev is not None:
                try:
                    run.containment = msgspec.convert(ev.data.get("containment", {}), ContainmentInfo)
                except msgspec.ValidationError:
                    pass
        return run

    def resolve(self, ref: str) -> RunInfo:
        """A run by id, unique id prefix, or name; NotFound/BadRequest say what to do."""
        run = self.journal.get_run(ref)
        if run is not None:
            return self.with_containment(run)
        matches = self.journal.find_runs(ref)
        if not matches:
            raise NotFound(f"no run {ref!r} on {self.host}: `gpudeck runs` lists the runs")
        if len(matches) > 1:
            ids = ", ".join(m.id for m in matches[:5])
            raise BadRequest(f"{ref!r} matches {len(matches)} runs ({ids}): give more of the id")
        return self.with_containment(matches[0])

    # ------------------------------------------------------------------ GPU attribution

    def _attribute(self, p: GpuProcess) -> None:
        self.attribute(p)
        self.attribution.correct(p, self.procs.get(p.pid))

    def attributed_gpus(self, gpus: list[Gpu] | None = None) -> list[Gpu]:
        """One GPU sample (or ``gpus``) with every process attributed (reads only: the tick calls it in its thread)."""
        if gpus is None:
            gpus = self.gpus.sample()
        for g in gpus:
            for p in g.processes:
                self._attribute(p)
        return gpus

    def containment_info(self, group: RunGroup | None) -> ContainmentInfo:
        """How a run with this group (or none) is contained."""
        if group is not None:
            return ContainmentInfo(level="cgroupfs", label=LABELS["cgroupfs"], group=str(group.path))
        if self.containment.has_groups:  # adopted from an agent that gave it no group
            return ContainmentInfo(level="tag", label=Containment("the run was started without a cgroup").label)
        return ContainmentInfo(level="tag", label=self.containment.label)

    # ------------------------------------------------------------------ the steps, each in its module

    async def preflight(self, spec: LaunchSpec, host_name: str | None = None, plan: LaunchPlan | None = None) -> PreflightResult:
        """Every pre-flight check of ``spec`` here; nothing is started (see :mod:`gpudeck.agents.runs.launch`)."""
        return await launch.preflight(self, spec, host_name, plan)

    def fingerprint_for(self, spec: LaunchSpec, plan: LaunchPlan | None = None) -> EnvFingerprint | None:
        """The run's python environment, fingerprinted (None when the run is not a python program)."""
        return launch.fingerprint_for(self, spec, plan)

    async def launch(self, spec: LaunchSpec, request_id: str = "", host_name: str | None = None) -> tuple[RunInfo, bool]:
        """Pre-flight, then start a run; returns (run, duplicate). A known request_id returns its first run."""
        return await launch.launch(self, spec, request_id, host_name)

    def spawn_shim(self, run: RunInfo, env: dict[str, str]) -> tuple[int, subprocess.Popen]:
        """Start the run's shim (in the run's group, if any); returns (the command's pid, the shim)."""
        lr = self.runs.get(run.id)
        return spawn(run, env, lr.group if lr is not None else None)

    def refresh(self) -> None:
        """One supervision tick, all on the calling thread (tests, benchmarks; the agent uses :meth:`tick`)."""
        ticks.refresh(self)

    async def tick(self) -> None:
        """One supervision tick: its reads in a thread, its decisions on the loop (see :mod:`gpudeck.agents.runs.tick`)."""
        await ticks.tick(self)

    def poll_telemetry(self, run: RunInfo) -> None:
        """Fold new telemetry into a live run's summary; journal what history needs, exactly once."""
        lr = self.runs.get(run.id)
        if lr is not None:
            run_telemetry.poll(self, lr)

    def verify(self, ref: str) -> tuple[RunInfo, list[ClaimRow]]:
        """Claims vs observed: live from the last observation, or as recorded when the run ended."""
        run = self.resolve(ref)
        lr = self.runs.get(run.id)
        recorded = self.journal.last_event(run.id, "claims") if lr is None or lr.last_obs is None else None
        rows = claims.report(
            run, lr.last_obs if lr is not None else None, recorded, lambda: self.attributed_gpus() if self.gpus.available else []
        )
        return run, rows

    # ------------------------------------------------------------------ what a triage needs (agents/health/triage.py)

    def live_run(self, run_id: str) -> LiveRun | None:
        """The live run of this id, or None."""
        return self.runs.get(run_id)

    def journal_many(self, items: list[tuple[str, str | None, dict]], what: str) -> None:
        """Journal several events of runs here and hand them on (a journal that cannot be written is logged)."""
        self.runs.emit_many(items, what)

    def stop_under_way(self, run_id: str) -> bool:
        """Whether a stop of this run is under way."""
        return self.runs.stopping(run_id)

    def adopt(self) -> list[str]:
        """After an agent (re)start: take over live runs, settle runs that ended meanwhile, tidy this agent's groups."""
        return adoption.adopt(self)

    def pending_stops(self) -> list[RunInfo]:
        """Runs left in ``stopping`` by an earlier agent; the server finishes those stops."""
        return [lr.info for lr in self.runs.live() if lr.info.state == "stopping"]

    async def stop(self, ref: str, grace_s: float = 30.0, reason: str = "stopped by operator") -> StopResult:
        """Stop one run entirely and verify; concurrent stops of the same run share one result."""
        return await stop.stop(self, ref, grace_s, reason)

    async def leftovers(self, include_live: bool = False, host_name: str | None = None) -> list[Leftover]:
        """Every leftover process here (see agents/safety/leftovers.py), with CPU % over a short sample."""
        return await reclaim.leftovers(self, include_live, host_name)

    async def reclaim(self, pids: list[int], grace_s: float = 10.0, include_live: bool = False, host_name: str | None = None) -> StopResult:
        """Stop exactly these leftovers: TERM, grace, KILL, verify through NVML; never a live run's process unless asked."""
        return await reclaim.reclaim(self, pids, grace_s, include_live, host_name)

    def spawn_bg(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, holding a reference until it is done."""
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)


def hostname() -> str:
    """This host's short name."""
    return socket.gethostname().split(".")[0]
