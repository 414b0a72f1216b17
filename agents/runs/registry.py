"""Provides the run registry: the one owner of every run's life on this host and the only writer of run state.

It holds the live runs (:class:`~gpudeck.agents.runs.liverun.LiveRun`), the
stops under way, the ended runs and the groups of ended runs that still hold
processes. A state changes only through :meth:`RunRegistry.transition`, which
applies a change only when :mod:`gpudeck.agents.runs.states` declares it
(from which state, to which, on which evidence), journals it with that
evidence, and refuses any other (logged as a bug, not applied). Launching,
ticking, stopping, adoption and triage call its public methods.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from gpudeck.agents.runs import states
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety.containment import Containment, RunGroup
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.causes import cause_class
from gpudeck.agents.wire.errors import StorageError
from gpudeck.agents.wire.protocol import TERMINAL_STATES, Event, Member, RunInfo, StopResult

log = logging.getLogger("gpudeck.agent")


class RunRegistry:
    """Every live, stopping and ended run here; the one place a run's state changes, each change journaled with its evidence."""

    def __init__(
        self,
        journal: Journal,
        host: str,
        containment: Containment,
        on_event: Callable[[Event], None],
        on_members: Callable[[dict[str, list[Member]]], None],
    ) -> None:
        self.journal = journal
        self.host = host
        self.containment = containment
        self._on_event = on_event
        self._on_members = on_members  # the attribution index: run id -> members of every live run
        self._live: dict[str, LiveRun] = {}
        self._ended_ids: set[str] = set()  # ended runs whose members may linger (STALE)
        self._ended_groups: dict[str, RunGroup] = {}  # groups of ended runs that still hold processes (leftovers)
        self._stopping: dict[str, asyncio.Task[StopResult]] = {}  # live and ended runs alike (a stop of an ended run reclaims)
        self._grace_ends: dict[str, float] = {}  # run id -> the monotonic time its stop's grace ends (the earliest asked)
        self._grace_cut: set[str] = set()  # runs whose stop under way had its grace cut by a later request
        self.refused: list[str] = []  # undeclared transitions asked for (bugs), newest last; tests read it

    # ------------------------------------------------------------------ reading

    def get(self, run_id: str) -> LiveRun | None:
        """The live run of this id, or None."""
        return self._live.get(run_id)

    def live(self) -> list[LiveRun]:
        """Every live run (a copy: the caller may end runs while it walks it)."""
        return list(self._live.values())

    def any_live(self) -> bool:
        """Whether any run is live."""
        return bool(self._live)

    def run_state(self, run_id: str) -> str | None:
        """State of a run this agent knows ("ended" for an ended one it has seen); None for an unknown id."""
        lr = self._live.get(run_id)
        if lr is not None:
            return lr.info.state
        if run_id in self._ended_ids:
            return "ended"
        r = self.journal.get_run(run_id)
        if r is None:
            return None
        if r.state in TERMINAL_STATES:
            self._ended_ids.add(run_id)
        return r.state

    def ended_groups(self) -> list[tuple[str, RunGroup]]:
        """The groups of ended runs still kept (they held processes when last looked at)."""
        return list(self._ended_groups.items())

    def ended_group(self, run_id: str) -> RunGroup | None:
        """An ended run's kept group, or None."""
        return self._ended_groups.get(run_id)

    # ------------------------------------------------------------------ runs coming and going

    def add(self, lr: LiveRun) -> LiveRun:
        """Hold a live run (launched here, adopted, or found live in the journal by a stop)."""
        self._live[lr.id] = lr
        return lr

    def mark_ended(self, run_id: str) -> None:
        """Remember a run as ended (its processes, should any linger, are STALE)."""
        self._ended_ids.add(run_id)

    async def create(self, run: RunInfo, evidence: str) -> None:
        """Record a new run durably (on disk before the caller goes on); its first row of the table must be declared."""
        if not states.allowed(states.NEW, run.state, evidence):
            raise ValueError(f"run {run.id}: a new run cannot start in {run.state!r} on {evidence!r}")
        self.emit(await self.journal.durable_create_run(run))
        if run.state in TERMINAL_STATES:
            self._ended_ids.add(run.id)

    # ------------------------------------------------------------------ the one writer

    def transition(
        self, run: RunInfo, target: str, evidence: str, data: dict | None = None, *, event: str = "run_state", **fields: object
    ) -> bool:
        """Change the run's state to ``target`` on ``evidence`` (with ``fields``), journaled with the evidence.

        A change the table does not declare is refused: logged as a bug, nothing applied, False returned.
        """
        if not states.allowed(run.state, target, evidence):
            why = f"run {run.id}: undeclared transition {run.state} -> {target} on {evidence!r} refused (a bug: see agents/runs/states.py)"
            log.error(why)
            self.refused.append(why)
            return False
        event_data = dict(data or {})
        event_data["state"] = target
        event_data["evidence"] = evidence
        if event == "run_state":
            # the event carries what a replica (the console's history) needs to rebuild the run row
            for key in ("started", "ended"):
                if fields.get(key) is not None:
                    event_data.setdefault(key, fields[key])
            if target in TERMINAL_STATES:
                event_data.setdefault("cause_class", cause_class(target, str(fields.get("cause", run.cause) or "")))
        self._write(run, event, event_data, {**fields, "state": target})
        return True

    def update(self, run: RunInfo, event: str | None, data: dict | None = None, **fields: object) -> None:
        """Change a run's other fields (members, ...), with an event; never its state (that is :meth:`transition`)."""
        if "state" in fields:
            raise ValueError("a run's state changes only through RunRegistry.transition")
        self._write(run, event, data, fields)

    def _write(self, run: RunInfo, event: str | None, data: dict | None, fields: dict[str, object]) -> None:
        ev = self.journal.update_run(run.id, event, data, **fields)
        for k, v in fields.items():
            setattr(run, k, v)
        if run.state in TERMINAL_STATES:
            lr = self._live.pop(run.id, None)
            self._ended_ids.add(run.id)
            if lr is not None and lr.group is not None:
                self.settle_group(run.id, lr.group)
            self.reindex()
        elif "members" in fields:
            self.reindex()
        self.emit(ev)

    def reindex(self) -> None:
        """Tell the attribution index every live run's members."""
        self._on_members({rid: lr.info.members for rid, lr in self._live.items()})

    # ------------------------------------------------------------------ events

    def emit(self, ev: Event | None) -> None:
        """Hand a journaled event on (to the connections that follow events)."""
        if ev is not None:
            self._on_event(ev)

    def emit_many(self, items: list[tuple[str, str | None, dict]], what: str) -> None:
        """Journal several events at once and hand them on; a journal that cannot be written is logged, not raised."""
        try:
            for ev in self.journal.append_many(items):
                self.emit(ev)
        except StorageError:
            log.warning("could not journal %s", what)

    def append(self, kind: str, run_id: str | None, data: dict) -> None:
        """Journal one event and hand it on (StorageError is the caller's to handle)."""
        self.emit(self.journal.append(kind, run_id, data))

    # ------------------------------------------------------------------ groups

    def settle_group(self, run_id: str, group: RunGroup) -> str | None:
        """Remove an ended run's group when empty; keep it (its processes are leftovers) otherwise. None when removed."""
        if group.populated():
            self._ended_groups[run_id] = group
            return f"{group.path} kept: {len(group.pids())} process(es) still in it (leftovers: `gpudeck reclaim {self.host}`)"
        why = group.remove()
        if why is None:
            self._ended_groups.pop(run_id, None)
            self.containment.release()  # this agent's own group goes with its last run's (refused while any remains)
        else:
            self._ended_groups[run_id] = group
        return why

    def settle_emptied_groups(self) -> None:
        """Remove the kept groups of ended runs that have emptied since."""
        for rid, group in list(self._ended_groups.items()):
            if not group.populated():
                self.settle_group(rid, group)

    # ------------------------------------------------------------------ stops

    def stopping(self, run_id: str) -> bool:
        """Whether a stop of this run is under way."""
        return run_id in self._stopping

    def stop_once(
        self, run_id: str, start: Callable[[], Coroutine[Any, Any, StopResult]], grace_ends: float | None = None
    ) -> asyncio.Task[StopResult]:
        """The stop under way for this run, or a new one from ``start()``; it leaves the registry when done.

        ``grace_ends`` (monotonic): when this request wants the grace over. A stop under way takes the earlier of its
        own end and this one, so ``stop --grace 0`` during a long grace kills now (see :meth:`grace_end`)."""
        task = self._stopping.get(run_id)
        if grace_ends is not None:
            before = self._grace_ends.get(run_id)
            self.grace_end(run_id, grace_ends)
            if task is not None and before is not None and grace_ends < before:
                self._grace_cut.add(run_id)  # a later request cut the grace of the stop under way
        if task is None:
            task = asyncio.ensure_future(start())
            self._stopping[run_id] = task

            def done(_t: asyncio.Task[StopResult]) -> None:
                self._stopping.pop(run_id, None)
                self._grace_ends.pop(run_id, None)
                self._grace_cut.discard(run_id)

            task.add_done_callback(done)
        return task

    def grace_end(self, run_id: str, wanted: float | None = None) -> float | None:
        """When the grace of this run's stop ends (monotonic), after taking ``wanted`` into account: the earliest any
        request asked for; None when no request named one."""
        if wanted is not None:
            now = self._grace_ends.get(run_id)
            self._grace_ends[run_id] = wanted if now is None else min(now, wanted)
        return self._grace_ends.get(run_id)

    def grace_cut(self, run_id: str) -> bool:
        """Whether a later stop request cut the grace of this run's stop under way (see :meth:`stop_once`)."""
        return run_id in self._grace_cut
