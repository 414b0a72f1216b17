"""Provides rollback, once: the known-good run's environment proved (or rebuilt), then the relaunch intent in it.

The flow asks its front-end through :class:`RollbackFrontEnd` where it needs a choice (rebuild a changed environment?)
and tells it each step; ``gpudeck rollback`` answers from its options and prints on stderr, the Run screen's Roll back
answers with a dialog and its status line. Neither checks or rebuilds an environment itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from gpudeck.agents.wire import envdiff
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import TERMINAL_STATES, LaunchSpec, RunInfo
from gpudeck.console.core.records import RunRecord
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.errors import OpsError
from gpudeck.console.ops.intent import LaunchIntent
from gpudeck.console.ops.relaunch import (
    EnvironmentCheck,
    changed_environment,
    check_environment,
    rebuild_environment,
    recorded_environment,
    rollback_intent,
)

CANDIDATES_MAX = 200  # ended runs offered to roll back to


class RollbackFrontEnd(Protocol):
    """What the rollback flow asks of the CLI or the console."""

    def say(self, text: str, tone: str = "info") -> None:
        """A step's outcome (tone: info, ok, warn, error)."""

    def waiting(self, text: str, detail: str = "") -> AbstractContextManager[object]:
        """Shown while a long step (fingerprinting, rebuilding) runs."""

    async def rebuild(self, good_id: str, host: str, check: EnvironmentCheck) -> bool:
        """The known-good environment changed: rebuild it from its recorded freeze (True), or stop here (False)."""


@contextmanager
def no_wait(text: str, detail: str = "") -> Iterator[None]:
    """A front-end's ``waiting`` that shows nothing."""
    yield


async def prepare_rollback(
    fleet: Fleet,
    run_spec: LaunchSpec,
    run_id: str,
    good: RunRecord,
    host: str,
    start: str | None,
    config_from: bool,
    ui: RollbackFrontEnd,
) -> LaunchIntent:
    """The intent that relaunches ``run_id`` on ``host`` in ``good``'s environment (and its config with ``config_from``).

    Refuses (OpsError, nothing started) when ``good`` recorded no spec or fingerprint, when its environment changed
    and the front-end does not want it rebuilt, or when the rebuild fails or still differs."""
    good_spec = good.launch_spec_or_none()
    if good_spec is None:
        raise OpsError(f"run {good.id} has no recorded spec: it cannot be rolled back to (pick a run that recorded one)")
    recorded = recorded_environment(good.id, good.env_fingerprint())
    python = recorded.python
    try:
        with ui.waiting(f"fingerprinting {python} on {host}", "is it still the environment the good run had?"):
            check = await check_environment(fleet, host, recorded)
    except AgentError as exc:
        raise OpsError(f"could not fingerprint {python} on {host}: {exc.message}; nothing was started") from exc
    if check.driver:
        ui.say(
            f"the NVIDIA driver on {host} differs from {good.id}'s: {envdiff.describe(check.driver)[0]} (rollback cannot change the driver)",
            "warn",
        )
    if check.holds:
        ui.say(f"{python} still matches {good.id}'s fingerprint", "ok")
    else:
        if not await ui.rebuild(good.id, host, check):
            raise changed_environment(good.id, host, check)
        ui.say(f"{good.id}'s environment changed ({len(check.changes)} difference(s)); rebuilding it from its recorded freeze on {host}")
        try:
            with ui.waiting(f"rebuilding {good.id}'s environment on {host}", "installing, then checking against the record"):
                python, path = await rebuild_environment(fleet, host, recorded)
        except AgentError as exc:
            raise OpsError(f"the rebuild on {host} failed: {exc.message}; nothing was started") from exc
        ui.say(f"rebuilt at {path}: matches the recorded fingerprint (freeze {recorded.freeze_hash[:12]})", "ok")
    return rollback_intent(run_spec, run_id, good_spec, host, start, python, config_from, good_host=good.host)


async def rollback_candidates(fleet: Fleet, host: str, run: RunInfo) -> list[RunRecord]:
    """Ended runs of ``run``'s kind to roll back to, succeeded first, newest next (the history's, else ``host``'s agent's)."""
    kind = run.spec.kind
    history = fleet.history
    rows: list[RunRecord]
    if history is not None:
        rows = await asyncio.to_thread(history.query, f"kind:{kind} state:ended limit:{CANDIDATES_MAX}")
    else:
        try:
            listed = await fleet.runs(host, limit=500)
        except AgentError as exc:
            raise OpsError(f"no runs to roll back to: {exc.message}") from exc
        rows = [RunRecord.from_info(r) for r in listed if r.spec.kind == kind and r.state in TERMINAL_STATES]
    rows = [r for r in rows if r.id != run.id]
    rows.sort(key=lambda r: (r.state != "succeeded", -(r.started or r.created or 0)))
    return rows
