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
    step_events: int = 0  # step records journaled for this run (the first STEP_EVENTS_ALL of them are never rate-limited)
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

    # The only writers of a LiveRun's fields (tests/unit/test_liverun_owner.py holds every other module to them).

    def set_group(self, group: RunGroup | None) -> None:
        """The run's cgroup, made at launch (None: the run is contained by tag + ancestry)."""
        self.group = group

    def attach_shim(self, shim: subprocess.Popen) -> None:
        """The shim this agent spawned for the run."""
        self.shim = shim

    def release_shim(self) -> None:
        """The run has ended: its shim is no longer held."""
        self.shim = None

    def end_launching(self) -> None:
        """The launch is over (spawned or failed): the tick may judge the run from now on."""
        self.launching = False

    def resume_stop(self, started: float) -> None:
        """A stop an earlier agent began (its wall-clock start, from the journal) is to be finished."""
        self.resume_stop_started = started

    def take_resumed_stop(self) -> float | None:
        """When a stop an earlier agent began started (None: none), forgotten once taken: one stop finishes it."""
        started, self.resume_stop_started = self.resume_stop_started, None
        return started

    def mark_seen_alive(self, now: float) -> None:
        """A tick (or the adoption) saw the run alive at ``now`` (wall clock)."""
        self.last_seen_alive = now

    def note_shim_lost(self, how: str) -> None:
        """How the run's shim went without an exit status (journaled once; the run lives on)."""
        self.shim_lost = how

    def start_journal_at(self, offset: int) -> None:
        """The telemetry offset the journal already holds (read from it when the tail is first opened)."""
        self.journaled_offset = offset

    def note_journaled(self, offset: int) -> None:
        """Telemetry up to ``offset`` is in the journal."""
        self.journaled_offset = offset

    def count_rejection_journaled(self) -> None:
        """One more telemetry_rejected event was written for the run."""
        self.rejections_journaled += 1

    def note_step_event(self, now: float) -> None:
        """A step record was journaled at ``now`` (monotonic): the rate limit counts from here."""
        self.last_step_event = now
        self.step_events += 1

    def hold_step(self, held: tuple[dict, int] | None) -> None:
        """The newest step record the rate limit left out of the journal, with its offset (None: none)."""
        self.held_step = held

    def note_observation(self, obs: Observation) -> None:
        """The health rules' newest observation of the run."""
        self.last_obs = obs

    def note_rank_death(self, alert: Alert) -> None:
        """A rank died: the first such alert is kept (the stop's reason names it)."""
        if self.first_death is None:
            self.first_death = alert

    def set_baseline(self, baseline: Baseline | None) -> None:
        """The looked-up throughput baseline (None: there is none); looked up once per run."""
        self.baseline = baseline

    def set_triage_task(self, task: asyncio.Task) -> None:
        """The triage being gathered for the run (agents/health/triage.py: one at a time)."""
        self.triage_task = task
