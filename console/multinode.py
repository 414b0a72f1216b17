"""Provides the one record of a run across several hosts: one run id, one node per host, one combined state.

Placing and starting the nodes is the operations layer's (console/ops/launch.py);
this folds what they report into one run:

- the combined state is running while every node runs; the first node to fail
  is named in the cause; a node whose host is unreachable and never reported
  its end is ``lost``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpudeck.agents.protocol import LIVE_STATES, TERMINAL_STATES

# ----------------------------------------------------------------------------- one record


@dataclass
class CombinedRun:
    """A run as one record across its nodes (or the single row of a one-host run)."""

    id: str
    hosts: list[str]
    state: str
    cause: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    ranks_seen: int = 0
    world_size: int | None = None
    started: float | None = None
    ended: float | None = None

    def as_row(self) -> dict[str, Any]:
        """The first node's row with the combined fields (what `history` and `runs` print)."""
        base: dict[str, Any] = dict(self.rows[0]) if self.rows else {"id": self.id}
        base.update(
            host="+".join(self.hosts),
            hosts=self.hosts,
            state=self.state,
            cause=self.cause,
            ranks_seen=self.ranks_seen,
            started=self.started,
            ended=self.ended,
            nodes=[{"host": r["host"], "state": r["state"], "cause": r.get("cause")} for r in self.rows],
        )
        if self.world_size is not None:
            base["world_size"] = self.world_size
        return base


def _node_rank(row: dict[str, Any]) -> int:
    spec = row.get("spec") or {}
    nr = spec.get("node_rank")
    return int(nr) if isinstance(nr, int) else 0


def _first_trouble(row: dict[str, Any]) -> float:
    """When this node's trouble began: its earliest rank death (when the rank was first seen gone), else its end."""
    times = [float(row.get("ended") or 0) or float("inf")]
    for a in row.get("alerts") or []:
        if not isinstance(a, dict) or a.get("kind") != "rank_exited":
            continue
        data = a.get("data") or {}
        if isinstance(data.get("gone_since"), (int, float)):
            times.append(float(data["gone_since"]))
        elif isinstance(a.get("ts"), (int, float)):
            times.append(float(a["ts"]) - float(data.get("gone_s") or 0))
    return min(times)


def combine(rows: list[dict[str, Any]], unreachable: set[str] | None = None) -> CombinedRun:
    """One record from a run's rows on several hosts (history rows or RunInfo dicts)."""
    rows = sorted(rows, key=_node_rank)
    unreachable = unreachable or set()
    states = [r["state"] for r in rows]
    hosts = [r["host"] for r in rows]
    spec = rows[0].get("spec") or {}
    expected = len(spec.get("nodes") or []) or len(rows)
    starts = [r["started"] for r in rows if r.get("started")]
    ends = [r["ended"] for r in rows if r.get("ended")]
    cause: str | None = None
    lost = [r for r in rows if r["state"] in LIVE_STATES and r["host"] in unreachable]
    failed = sorted((r for r in rows if r["state"] in ("failed", "lost", "preflight_failed")), key=_first_trouble)
    missing = expected - len(rows)
    absent = [h for h in (spec.get("nodes") or []) if h not in hosts]
    stopped = [r for r in rows if r["state"] == "stopped"]
    t_stop = min((r.get("ended") or 0) for r in stopped) if stopped else 0.0
    if stopped and not missing and all(s in TERMINAL_STATES for s in states) and all((r.get("ended") or 0) >= t_stop - 5 for r in rows):
        # an operator's stop of some nodes: the others end with it (a trainer's agreed stop, lost peers)
        state = "stopped"
        others = [r for r in rows if r["state"] != "stopped"]
        cause = stopped[0].get("cause") or "stopped"
        if others:
            cause += "; " + ", ".join(f"node {_node_rank(r)} ({r['host']}) ended with it: {r.get('cause') or r['state']}" for r in others)
    elif all(s in ("running",) for s in states) and not lost and not missing:
        state = "running"
    elif all(s in ("running",) for s in states) and absent and not lost:
        state = "running"
        cause = "; ".join(f"node {h} not reachable: not observed" for h in absent)
    elif failed:
        state = "failed" if failed[0]["state"] != "lost" else "lost"
        first = failed[0]
        cause = f"node {_node_rank(first)} ({first['host']}) failed first: {first.get('cause') or first['state']}"
    elif lost and all(s in TERMINAL_STATES for r, s in zip(rows, states) if r not in lost):
        state = "lost"
        cause = "; ".join(f"node {_node_rank(r)} ({r['host']}) became unreachable and never reported back" for r in lost)
    elif any(s in ("stopping",) for s in states):
        state = "stopping"
    elif any(s in LIVE_STATES for s in states):
        state = "running"
        if lost:
            cause = "; ".join(f"node {_node_rank(r)} ({r['host']}) unreachable: its end is not known yet" for r in lost)
    elif all(s == "succeeded" for s in states):
        state, cause = "succeeded", rows[0].get("cause")
    elif all(s == "stopped" for s in states):
        state, cause = "stopped", rows[0].get("cause")
    else:
        state = "failed"
        cause = "; ".join(f"{r['host']}: {r['state']}" for r in rows)
    if missing > 0 and state in TERMINAL_STATES and cause is None:
        cause = f"{missing} node(s) never reported"
    return CombinedRun(
        id=rows[0]["id"],
        hosts=hosts,
        state=state,
        cause=cause,
        rows=rows,
        ranks_seen=sum(
            int(r.get("ranks_seen") or len({m.get("rank") for m in r.get("members") or [] if m.get("rank") is not None})) for r in rows
        ),
        world_size=next((r.get("world_size") for r in rows if r.get("world_size")), None),
        started=min(starts) if starts else None,
        ended=max(ends) if ends and state in TERMINAL_STATES else None,
    )


def group(rows: list[dict[str, Any]], unreachable: set[str] | None = None) -> list[dict[str, Any]]:
    """Rows with the nodes of each multi-node run folded into one (order kept: newest first)."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    for r in rows:
        if r["id"] not in by_id:
            order.append(r["id"])
        by_id.setdefault(r["id"], []).append(r)
    out = []
    for rid in order:
        rs = by_id[rid]
        multi = len(rs) > 1 or ((rs[0].get("spec") or {}).get("nnodes") or 1) > 1
        out.append(combine(rs, unreachable).as_row() if multi else rs[0])
    return out
