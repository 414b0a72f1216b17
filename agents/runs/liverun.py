"""Provides the LiveRun: everything the supervisor holds for one run that is not over, in one object."""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from gpudeck.agents.health.rules import Baseline, Observation, RunHealth
from gpudeck.agents.observe.telemetry import TelemetryTail
from gpudeck.agents.safety.containment import RunGroup
from gpudeck.agents.wire.protocol import Alert, ContainmentInfo, Member, RunInfo

_UNSET = object()


@dataclass
class LiveRun:
    """One live run: its record, its shim, its group, its telemetry cursor and its health state."""

    info: RunInfo
    group: RunGroup | None = None
    shim: subprocess.Popen | None = None  # only when this agent started it
    launching: bool = False  # recorded, not yet spawned: the tick must not judge it (no shim yet)
    resume_stop_started: float | None = None  # a stop an earlier agent began: when (wall clock), from the journal
    tail: TelemetryTail | None = None
    journaled_offset: int = 0
    last_step_event: float = -1e9
    held_step: tuple[dict, int] | None = None  # the newest step record the rate limit left out of the journal (and its offset)
    rejections_journaled: int = 0  # telemetry_rejected events written for this run (capped: the count goes on in bad_lines)
    health: RunHealth | None = None
    last_obs: Observation | None = None
    baseline: object = _UNSET  # Baseline | None once looked up
    first_death: Alert | None = None
    triage_task: asyncio.Task | None = None  # the triage being gathered (agents/health/triage.py: one at a time)
    reported_pids: set[int] = field(default_factory=set)  # outside/other-uid pids already logged
    last_seen_alive: float | None = None  # the last tick that saw the run alive (a lost run's end is no later)
    shim_lost: str | None = None  # how its shim went without an exit status, once journaled (the run lives on without it)

    @property
    def id(self) -> str:
        """The run id."""
        return self.info.id

    @property
    def containment(self) -> ContainmentInfo | None:
        """How the run is contained (on its RunInfo, so every reply carries it)."""
        return self.info.containment

    def member(self, role: str) -> Member | None:
        """The first member with this role (shim, leader)."""
        return next((m for m in self.info.members if m.role == role), None)

    def telemetry_tail(self) -> TelemetryTail:
        """The run's telemetry reader, opened on first use."""
        if self.tail is None:
            self.tail = TelemetryTail(Path(self.info.run_dir or "") / "telemetry.jsonl")
        return self.tail

    def health_state(self) -> RunHealth:
        """The run's health rules' state, made on first use."""
        if self.health is None:
            self.health = RunHealth(self.info.id)
        return self.health

    def baseline_known(self) -> bool:
        """Whether the throughput baseline was looked up already."""
        return self.baseline is not _UNSET

    def baseline_value(self) -> Baseline | None:
        """The looked-up baseline (None: none, or not yet)."""
        return None if self.baseline is _UNSET else self.baseline  # type: ignore[return-value]
