"""Provides the one record of a run across several hosts: one run id, one node per host, one combined state.

Placing and starting the nodes is the operations layer's (console/ops/launch.py);
this folds what they report into one run:

- the combined state is running while every node runs; the first node to fail
  is named in the cause; a node whose host is unreachable and never reported
  its end is ``lost``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import msgspec

from gpudeck.agents.wire.protocol import LIVE_STATES, TERMINAL_STATES
from gpudeck.console.core.records import NodeState, RunRecord

# ----------------------------------------------------------------------------- one record


class Combined(TypedDict):
    """What a multi-node run's one record says instead of its first node's."""

    host: str
    hosts: list[str]
    state: str
    cause: str | None
    ranks_seen: int
    started: float | None
    ended: float | None


@dataclass
class CombinedRun:
    """A run as one record across its nodes (or the single row of a one-host run)."""

    id: str
    hosts: list[str]
    state: str
    cause: str | None
    rows: list[RunRecord] = field(default_factory=list)
    ranks_seen: int = 0
    world_size: int | None = None
    started: float | None = None
    ended: float | None = None

    @property
    def nodes(self) -> list[NodeState]:
        """Each node's own host, state and cause, in node-rank order."""
        return [NodeState(r.host, r.state or "pending", r.cause) for r in self.rows]

    def combined(self) -> Combined:
        """The fields a combined record replaces in its first node's, in the order ``--json`` has them (then ``nodes``)."""
        return Combined(
            host="+".join(self.hosts),
            hosts=self.hosts,
            state=self.state,
            cause=self.cause,
            ranks_seen=self.ranks_seen,
            started=self.started,
            ended=self.ended,
        )

    def as_record(self) -> RunRecord:
        """The first node's record with the combined fields (what `history` prints)."""
        base = self.rows[0] if self.rows else RunRecord(host="+".join(self.hosts), id=self.id)
        ws = self.world_size if self.world_size is not None else base.world_size
        return msgspec.structs.replace(base, **self.combined(), nodes=self.nodes, world_size=ws)


def _node_rank(row: RunRecord) -> int:
    return row.node_rank


def _first_trouble(row: RunRecord) -> float:
    """When this node's trouble began: its earliest rank death (when the rank was first seen gone), else its end."""
    times = [float(row.ended or 0) or float("inf")]
    for a in row.alerts:  # as recorded, not decoded: an alert with fields missing (an older agent's) still dates the trouble
        if not isinstance(a, dict) or a.get("kind") != "rank_exited":
            continue
        data = a.get("data") or {}
        if isinstance(data.get("gone_since"), (int, float)):
            times.append(float(data["gone_since"]))
        elif isinstance(a.get("ts"), (int, float)):
            times.append(float(a["ts"]) - float(data.get("gone_s") or 0))
    return min(times)


def combine(rows: Sequence[RunRecord], unreachable: set[str] | None = None) -> CombinedRun:
    """One record from a run's records on several hosts (history rows, or runs as their agents report them)."""
    rows = sorted(rows, key=_node_rank)
    unreachable = unreachable or set()
    states = [r.state or "pending" for r in rows]
    hosts = [r.host for r in rows]
    spec_nodes = rows[0].spec_nodes
    expected = len(spec_nodes) or len(rows)
    starts = [r.started for r in rows if r.started]
    ends = [r.ended for r in rows if r.ended]
    cause: str | None = None
    lost = [r for r in rows if r.state in LIVE_STATES and r.host in unreachable]
    failed = sorted((r for r in rows if r.state in ("failed", "lost", "preflight_failed")), key=_first_trouble)
    missing = expected - len(rows)
    absent = [h for h in spec_nodes if h not in hosts]
    stopped = [r for r in rows if r.state == "stopped"]
    t_stop = min((r.ended or 0) for r in stopped) if stopped else 0.0
    if stopped and not missing and all(s in TERMINAL_STATES for s in states) and all((r.ended or 0) >= t_stop - 5 for r in rows):
        # an operator's stop of some nodes: the others end with it (a trainer's agreed stop, lost peers)
        state = "stopped"
        others = [r for r in rows if r.state != "stopped"]
        cause = stopped[0].cause or "stopped"
        if others:
            cause += "; " + ", ".join(f"node {_node_rank(r)} ({r.host}) ended with it: {r.cause or r.state}" for r in others)
    elif all(s in ("running",) for s in states) and not lost and not missing:
        state = "running"
    elif all(s in ("running",) for s in states) and absent and not lost:
        state = "running"
        cause = "; ".join(f"node {h} not reachable: not observed" for h in absent)
    elif failed:
        state = "failed" if failed[0].state != "lost" else "lost"
        first = failed[0]
        cause = f"node {_node_rank(first)} ({first.host}) failed first: {first.cause or first.state}"
    elif lost and all(s in TERMINAL_STATES for r, s in zip(rows, states) if r not in lost):
        state = "lost"
        cause = "; ".join(f"node {_node_rank(r)} ({r.host}) became unreachable and never reported back" for r in lost)
    elif any(s in ("stopping",) for s in states):
        state = "stopping"
    elif any(s in LIVE_STATES for s in states):
        state = "running"
        if lost:
            cause = "; ".join(f"node {_node_rank(r)} ({r.host}) unreachable: its end is not known yet" for r in lost)
    elif all(s == "succeeded" for s in states):
        state, cause = "succeeded", rows[0].cause
    elif all(s == "stopped" for s in states):
        state, cause = "stopped", rows[0].cause
    else:
        state = "failed"
        cause = "; ".join(f"{r.host}: {r.state}" for r in rows)
    if missing > 0 and state in TERMINAL_STATES and cause is None:
        cause = f"{missing} node(s) never reported"
    return CombinedRun(
        id=rows[0].id,
        hosts=hosts,
        state=state,
        cause=cause,
        rows=list(rows),
        ranks_seen=sum(int(r.ranks_seen or len({m.get("rank") for m in r.members if m.get("rank") is not None})) for r in rows),
        world_size=next((r.world_size for r in rows if r.world_size), None),
        started=min(starts) if starts else None,
        ended=max(ends) if ends and state in TERMINAL_STATES else None,
    )


def by_run(rows: Sequence[RunRecord]) -> list[list[RunRecord]]:
    """Records grouped by run id, in the order each id first appears (newest first)."""
    by_id: dict[str, list[RunRecord]] = {}
    for r in rows:
        by_id.setdefault(r.id, []).append(r)
    return list(by_id.values())


def is_multinode(rs: list[RunRecord]) -> bool:
    """Whether one run's records (:func:`by_run`) are a multi-node run (several nodes, or one node of several)."""
    return len(rs) > 1 or rs[0].spec_nnodes > 1


def group(rows: Sequence[RunRecord], unreachable: set[str] | None = None) -> list[RunRecord]:
    """Records with the nodes of each multi-node run folded into one (order kept: newest first)."""
    return [combine(rs, unreachable).as_record() if is_multinode(rs) else rs[0] for rs in by_run(rows)]
