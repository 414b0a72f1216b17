"""Provides gpudeck's operations layer: every operator action, once, under the CLI and the console.

A front-end fills an intent (:class:`LaunchIntent`), calls an operation through
its :class:`~gpudeck.console.ops.context.Ops` (which owns the fleet and the
history) and shows what comes back; nothing here prints or touches Textual. Launch planning
(:mod:`.launch`), relaunch and rollback (:mod:`.relaunch`), the run-reference
resolver (:mod:`.resolve`) and the shared figures (:mod:`.figures`) live here,
and nowhere else.
"""

from gpudeck.console.ops.errors import AmbiguousRun, Candidate, IntentError, NoSuchRun, OpsError, Unanswered
from gpudeck.console.ops.figures import RunFigures, run_figures
from gpudeck.console.ops.intent import Caller, ClaimsIntent, LaunchIntent, start_of
from gpudeck.console.ops.launch import LaunchPlan, LaunchResult, launch, plan_launch, preflight
from gpudeck.console.ops.relaunch import intent_from_spec, relaunch_intent, rollback_intent
from gpudeck.console.ops.resolve import Resolved, nodes_of, resolve_record, resolve_run

__all__ = [
    "AmbiguousRun",
    "Caller",
    "Candidate",
    "ClaimsIntent",
    "IntentError",
    "LaunchIntent",
    "LaunchPlan",
    "LaunchResult",
    "NoSuchRun",
    "OpsError",
    "Resolved",
    "RunFigures",
    "Unanswered",
    "intent_from_spec",
    "launch",
    "plan_launch",
    "preflight",
    "relaunch_intent",
    "resolve_record",
    "nodes_of",
    "resolve_run",
    "rollback_intent",
    "run_figures",
    "start_of",
]
