"""Provides re-adoption after an agent (re)start: live runs taken over with their groups, ended ones settled, groups tidied.

A run the journal lists as live is taken over while it lives as the kernel
sees it (its shim, else its group's members, else its members found by tag +
ancestry: :func:`gpudeck.agents.runs.ending.liveness`), and ended (cause decided
from the evidence it left) when nothing of it does; a stop an earlier agent began is finished
with the time already spent counted. Groups of ended runs are removed once
empty; a group the journal does not know is reported, never deleted.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpudeck.agents.observe.procs import alive
from gpudeck.agents.runs import ending, states, tick
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety.containment import RunGroup
from gpudeck.agents.safety.membership import proc_tree
from gpudeck.agents.wire.protocol import LIVE_STATES, TERMINAL_STATES, RunInfo

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor

log = logging.getLogger("gpudeck.agent")


def group_of(sup: Supervisor, run: RunInfo) -> RunGroup | None:
    """The run's group, as its containment record names it (or by its name under this agent's group)."""
    info = run.containment
    if info is not None and info.group:
        p = Path(info.group)
        return RunGroup(p, run.id) if p.is_dir() else None
    return sup.containment.group(run.id) if sup.containment.has_groups else None


def adopt(sup: Supervisor) -> list[str]:
    """After an agent (re)start: take over live runs, settle runs that ended meanwhile, tidy this agent's groups."""
    sup.procs.refresh(full=True)
    notes: list[str] = []
    tree = proc_tree()
    for run in sup.journal.list_runs(limit=100000, states=LIVE_STATES):
        run = sup.with_containment(run)
        lr = sup.runs.add(LiveRun(info=run, group=group_of(sup, run)))
        if run.containment is None:  # a run an older agent started: it has what the tag gives
            run.containment = sup.containment_info(lr.group)
        if run.state == "starting" and not run.members and not sup.procs.tagged(run.id) and not (lr.group and lr.group.populated()):
            # the agent died between the record and the start, and no process carries the tag
            why = "launch interrupted: the agent stopped while starting it; nothing was started"
            sup.runs.transition(run, "failed", states.LAUNCH_INTERRUPTED, {"cause": why}, cause=why, ended=time.time())
            notes.append(f"{run.id}: launch interrupted")
            continue
        tick.discover_members(sup, lr, tree)
        # a stop under way is finished while anything of the run lives (its leader may be gone, a deaf worker not)
        stop_left = run.state == "stopping" and (
            any(alive(m.pid, m.create_time) for m in run.members if m.role != "shim") or (lr.group is not None and lr.group.populated())
        )
        # the kernel judges: the run's group (or its members by tag + ancestry), never its shim alone
        life = ending.liveness(lr)
        if stop_left or life.alive:
            lr.mark_seen_alive(time.time())
            if run.state == "stopping":
                ev = sup.journal.last_event(run.id, "run_state")
                data = ev.data if ev is not None and ev.data.get("state") == "stopping" else {}
                stop_started = float(data.get("stop_started") or (ev.ts if ev is not None and data else time.time()))
                lr.resume_stop(stop_started)
                notes.append(f"{run.id}: stop was in progress ({time.time() - stop_started:.1f} s ago); finishing it")
                sup.runs.update(
                    run,
                    "run_adopted",
                    {"state": run.state, "resume_stop": True, "stop_started": stop_started, "evidence": states.ADOPTED},
                )
            else:
                adopted = {"containment": run.containment.label if run.containment else None}
                if run.state == "running":  # no change of state: the takeover is journaled, with what it was decided on
                    sup.runs.update(run, "run_adopted", {"state": "running", "evidence": states.ADOPTED, **adopted})
                else:
                    sup.runs.transition(run, "running", states.ADOPTED, adopted, event="run_adopted")
                notes.append(f"{run.id}: re-adopted ({run.containment.label if run.containment else 'tag'})")
                if life.shim_gone is not None:
                    ending.note_shim_gone(sup, lr, life)
                    notes.append(f"{run.id}: {lr.shim_lost}; its {life.members} process(es) are supervised without it")
        else:
            was_stopping = run.state == "stopping"
            ending.finish(
                sup,
                lr,
                agent_was_down=True,
                stopped_cause="stopped by operator (the stop finished while the agent was down)" if was_stopping else None,
            )
            notes.append(f"{run.id}: ended while the agent was down ({run.state})")
    for run in sup.journal.list_runs(limit=2000, states=TERMINAL_STATES):
        sup.runs.mark_ended(run.id)
    notes += tidy_groups(sup)
    sup.runs.reindex()
    sup.adopt_notes = notes
    return notes


def tidy_groups(sup: Supervisor) -> list[str]:
    """Remove the empty groups of ended runs; keep those still holding processes; report, never delete, unknown ones."""
    notes = []
    for rid, group in sup.containment.groups().items():
        if sup.runs.get(rid) is not None:
            continue
        known = sup.journal.get_run(rid)
        if known is None:
            n = len(group.pids())
            msg = f"unknown cgroup {group.path} ({n} process(es)): no run {rid} in this agent's journal; left as it is"
            log.warning(msg)
            notes.append(msg)
            continue
        why = sup.runs.settle_group(rid, group)
        if why is not None:
            notes.append(f"{rid}: {why}")
    return notes
