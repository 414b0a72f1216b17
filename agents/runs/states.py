"""Provides the run state table: every state change a run may make, and the evidence each one needs.

Stdlib only (as Supervisor's ``states.py``): the registry
(:mod:`gpudeck.agents.runs.registry`) applies a transition only when its
``(from, to, evidence)`` row is declared here, and refuses any other as a bug.
``NEW`` is the state before a run is recorded.
"""

from __future__ import annotations

from typing import NamedTuple

NEW = "new"  # not recorded yet: the first row of every run's life

# the evidence a transition is decided on (journaled with it, in the run_state event's ``evidence``)
PREFLIGHT_REFUSED = "preflight_refused"  # pre-flight found a problem: nothing was started
LAUNCHED = "launched"  # the run is recorded; its shim is about to start
SPAWNED = "spawned"  # the shim reported the pid of the run's command
LAUNCH_ERROR = "launch_error"  # no cgroup, no executable, or the shim could not start the command
LAUNCH_INTERRUPTED = "launch_interrupted"  # an earlier agent died before the start; no process carries the tag
ADOPTED = "adopted"  # a restarted agent found the run's group populated (or its tagged members alive)
STOP_REQUESTED = "stop_requested"  # an operator's stop, or a health policy's (--on-rank-death / --on-hang stop)
STOP_VERIFIED = "stop_verified"  # TERM, grace, KILL done and checked: the group emptied / no member alive
EXIT_RECORD = "exit_record"  # the shim's exit.json: the command's own exit status
SHIM_EXIT = "shim_exit"  # exit.json is missing but this agent reaped the shim, which exited by itself with the command's code
MEMBERS_GONE = "members_gone"  # no exit status anywhere, and the group (or every tagged member) is empty: the end is inferred

ENDS = (EXIT_RECORD, SHIM_EXIT, MEMBERS_GONE)


class Transition(NamedTuple):
    """One declared change: from which state, to which, on which evidence."""

    source: str
    target: str
    evidence: str


def _rows() -> tuple[Transition, ...]:
    rows = [
        Transition(NEW, "starting", LAUNCHED),
        Transition(NEW, "preflight_failed", PREFLIGHT_REFUSED),
        Transition("starting", "running", SPAWNED),
        Transition("starting", "running", ADOPTED),
        Transition("starting", "failed", LAUNCH_ERROR),
        Transition("starting", "failed", LAUNCH_INTERRUPTED),
        Transition("starting", "stopping", STOP_REQUESTED),
        Transition("running", "stopping", STOP_REQUESTED),
        Transition("stopping", "stopped", STOP_VERIFIED),
        # a stop an earlier agent began and that finished while no agent watched: the end is stopped, with what was left
        Transition("stopping", "stopped", EXIT_RECORD),
        Transition("stopping", "stopped", MEMBERS_GONE),
    ]
    for source in ("starting", "running"):
        rows += [
            Transition(source, "succeeded", EXIT_RECORD),
            Transition(source, "failed", EXIT_RECORD),
            Transition(source, "failed", SHIM_EXIT),
            Transition(source, "succeeded", SHIM_EXIT),
            Transition(source, "lost", MEMBERS_GONE),
        ]
    return tuple(rows)


TRANSITIONS: tuple[Transition, ...] = _rows()
ALLOWED: frozenset[Transition] = frozenset(TRANSITIONS)


def allowed(source: str, target: str, evidence: str) -> bool:
    """Whether the table declares this change."""
    return Transition(source, target, evidence) in ALLOWED


def table_text() -> str:
    """The table, one row a line (docs/agent.md quotes it; the registry logs it with a refused change)."""
    return "\n".join(f"{t.source:>9} -> {t.target:<16} on {t.evidence}" for t in TRANSITIONS)
