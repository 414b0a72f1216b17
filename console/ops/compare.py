"""Provides the two runs a diff compares, read one way for every front-end: the history's records under the fleet's host
names, with their recorded step metrics (so tokens/s is the median of the steps everywhere, never the last step's value).

``gpudeck diff``, the History screen's Diff and the Roll back dialog all read their pair here and render it with
:func:`gpudeck.console.present.views.run_diff`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import RunInfo
from gpudeck.console.core.records import MetricPoint, RunRecord
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.replica import History, HistoryError
from gpudeck.console.ops.errors import OpsError


@dataclass(frozen=True)
class Compared:
    """Two runs' records and their step metrics, ready for ``run_diff``."""

    a: RunRecord
    b: RunRecord
    a_metrics: list[MetricPoint]
    b_metrics: list[MetricPoint]


async def compare_refs(history: History, a_ref: str, b_ref: str, unanswered: list[str] | None = None) -> Compared:
    """Two runs by reference (id, unique prefix or name) from the history: ``gpudeck diff RUN_A RUN_B``."""
    a = await asyncio.to_thread(history.find, a_ref, None, unanswered or [])
    b = await asyncio.to_thread(history.find, b_ref, None, unanswered or [])
    return await _with_metrics(history, a, b)


async def compare_runs(fleet: Fleet, a: tuple[str, str], b: tuple[str, str], live_a: RunInfo | None = None) -> Compared:
    """Two runs by (fleet host name, run id): the History screen's Diff and the Roll back dialog.

    Each record is the history's when it holds the run; else the agent's (``live_a`` when given), under the fleet's
    name for its host (an agent reports its own hostname, which is not the name the operator uses)."""
    history = fleet.history
    recs = [await _record(fleet, history, host, rid, live) for (host, rid), live in ((a, live_a), (b, None))]
    if history is None:
        ma, mb = await asyncio.gather(*(_agent_metrics(fleet, r) for r in recs))
        return Compared(recs[0], recs[1], ma, mb)
    return await _with_metrics(history, recs[0], recs[1])


async def _record(fleet: Fleet, history: History | None, host: str, run_id: str, live: RunInfo | None) -> RunRecord:
    if history is not None:
        try:
            return await asyncio.to_thread(history.find, run_id, host)
        except (OpsError, HistoryError):
            pass  # not synced yet: the agent's record below
    try:
        info = live if live is not None else await fleet.run(host, run_id)
    except AgentError as exc:
        raise OpsError(f"cannot read run {run_id} on {host}: {exc.message}") from exc
    return msgspec.structs.replace(RunRecord.from_info(info), host=host)


async def _with_metrics(history: History, a: RunRecord, b: RunRecord) -> Compared:
    ma, mb = await asyncio.gather(
        asyncio.to_thread(history.metrics, a.host, a.id),
        asyncio.to_thread(history.metrics, b.host, b.id),
    )
    return Compared(a, b, ma, mb)


async def _agent_metrics(fleet: Fleet, rec: RunRecord) -> list[MetricPoint]:
    """A run's step metrics from its agent (no history: a console started without one)."""
    try:
        m = await fleet.metrics(rec.host, rec.id, max_points=100_000)
    except AgentError:
        return []
    return [MetricPoint(step=s, ts=None, loss=lo, tokens_per_s=t) for s, lo, t in zip(m.steps, m.loss, m.tokens_per_s)]
