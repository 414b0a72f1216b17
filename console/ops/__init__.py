"""Provides gpudeck's operations layer: every operator action, once, under the CLI and the console.

A front-end fills an intent (:class:`LaunchIntent`), calls an operation through
its :class:`~gpudeck.console.ops.context.Ops` (which owns the fleet and the
history) and shows what comes back; nothing here prints or touches Textual. Launch planning
(:mod:`.launch`), relaunch and rollback (:mod:`.relaunch`), the run-reference
resolver (:mod:`.resolve`) and the shared figures (:mod:`.figures`) live here,
and nowhere else.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpudeck.console.ops.errors import AmbiguousRun, Candidate, IntentError, NoSuchRun, OpsError, Unanswered
    from gpudeck.console.ops.figures import RunFigures, run_figures
    from gpudeck.console.ops.intent import Caller, ClaimsIntent, LaunchIntent, start_of
    from gpudeck.console.ops.launch import LaunchPlan, LaunchResult, plan_launch, preflight
    from gpudeck.console.ops.relaunch import intent_from_spec, relaunch_intent, rollback_intent
    from gpudeck.console.ops.resolve import Resolved, nodes_of, resolve_record, resolve_run

# the names above, each from its module, imported when first asked for (PEP 562): importing one module of the package
# (ops.context for `status --host H`) does not load every operation (issue 30)
_HOMES = {
    "errors": ("AmbiguousRun", "Candidate", "IntentError", "NoSuchRun", "OpsError", "Unanswered"),
    "figures": ("RunFigures", "run_figures"),
    "intent": ("Caller", "ClaimsIntent", "LaunchIntent", "start_of"),
    "launch": ("LaunchPlan", "LaunchResult", "plan_launch", "preflight"),  # the launch function: ops.launch.launch
    "relaunch": ("intent_from_spec", "relaunch_intent", "rollback_intent"),
    "resolve": ("Resolved", "nodes_of", "resolve_record", "resolve_run"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> object:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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
