"""Provides the claims check of a run: what its name and spec claim against what was observed, live or as recorded."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.health.rules import claims_report, observe
from gpudeck.agents.observe.procs import alive
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.wire.errors import StorageError
from gpudeck.agents.wire.protocol import LIVE_STATES, ClaimRow, RunInfo

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor

log = logging.getLogger("gpudeck.agent")


def verify(sup: Supervisor, ref: str) -> tuple[RunInfo, list[ClaimRow]]:
    """Claims vs observed: live from the last observation, or as recorded when the run ended."""
    run = sup.resolve(ref)
    lr = sup.runs.get(run.id)
    if lr is not None and lr.last_obs is not None:
        return run, claims_report(lr.last_obs)
    ev = sup.journal.last_event(run.id, "claims")
    if ev is not None:
        return run, [msgspec.convert(r, ClaimRow) for r in ev.data.get("rows", [])]
    if run.state in LIVE_STATES:
        gpus = sup.attributed_gpus() if sup.gpus.available else []
        return run, claims_report(observe(run, time.time(), gpus, lambda m: alive(m.pid, m.create_time)))
    return run, []


def record(sup: Supervisor, lr: LiveRun | None) -> None:
    """Journal the run's claims report from its last observation (at its end); never blocks the end on a failure."""
    if lr is None or lr.last_obs is None:
        return
    try:
        rows = claims_report(lr.last_obs)
        sup.runs.append("claims", lr.id, {"rows": msgspec.to_builtins(rows)})
    except (StorageError, Exception):  # the claims are a report; never let them block the end of a run
        log.exception("run %s: claims report failed", lr.id)
