"""Provides the claims check of a run: what its name and spec claim against what was observed, live or as recorded.

Plain data in, rows out: the caller (the run's supervisor) hands over the run, its last observation and the
claims event recorded at its end, so health/ never reaches up into runs/.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from gpudeck.agents.health.rules import Observation, claims_report, observe
from gpudeck.agents.observe.procs import alive
from gpudeck.agents.wire.protocol import LIVE_STATES, ClaimRow, Event, Gpu, RunInfo

log = logging.getLogger("gpudeck.agent")


def report(run: RunInfo, last_obs: Observation | None, recorded: Event | None, gpus_now: Callable[[], list[Gpu]]) -> list[ClaimRow]:
    """Claims vs observed: from the live run's last observation, else as recorded at its end, else (a live run not
    looked at yet) observed now with ``gpus_now()``."""
    if last_obs is not None:
        return claims_report(last_obs)
    if recorded is not None:
        return [msgspec.convert(r, ClaimRow) for r in recorded.data.get("rows", [])]
    if run.state in LIVE_STATES:
        return claims_report(observe(run, time.time(), gpus_now(), lambda m: alive(m.pid, m.create_time)))
    return []


def record(append: Callable[[str, str | None, dict], None], run_id: str, last_obs: Observation | None) -> None:
    """Journal the run's claims report from its last observation (at its end) through ``append``; never blocks the end."""
    if last_obs is None:
        return
    try:
        rows = claims_report(last_obs)
        append("claims", run_id, {"rows": msgspec.to_builtins(rows)})
    except Exception:  # the claims are a report (StorageError included): never let them block the end of a run
        log.exception("run %s: claims report failed", run_id)
