"""Provides the one run-reference resolver of every command and screen.

The rules, the same for the agents' runs and for the history's:

- an exact id wins (the nodes of a multi-node run share it: one run);
- else a unique id prefix or a unique name, across every host asked; a run that never started (``preflight_failed``)
  yields to the runs of that name that did (a relaunch keeps the name, and a refused attempt is no rival);
- more than one run matches: :class:`~gpudeck.console.ops.errors.AmbiguousRun` (exit
  code 2) with the candidates (host, id, name, state, started) — never a
  silent pick, never "no run" when there are several;
- a host that did not answer and might hold a match is named; a destructive
  command (stop, reclaim, rollback) refuses a name or prefix while a host did
  not answer and a live run matches it, since the host that did not answer may
  hold another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import LIVE_STATES, RunInfo
from gpudeck.console.core.records import RunRecord
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.errors import AmbiguousRun, Candidate, NoSuchRun, Unanswered

LIST_LIMIT = 100_000  # runs asked of each host when a reference is not an exact id
NEVER_RAN = frozenset({"preflight_failed"})  # states of a run that started nothing: a name or prefix prefers the runs that ran


@dataclass(frozen=True)
class Match:
    """One run's record on one host, as the resolver compares them."""

    host: str
    id: str
    name: str | None
    state: str
    started: float | None
    node_rank: int = 0


def pick(ref: str, matches: Sequence[Match]) -> list[Match]:
    """The matches that ``ref`` names by the rules (every node of the one run); AmbiguousRun when several runs."""
    exact = [m for m in matches if m.id == ref]
    named = exact or [m for m in matches if m.id.startswith(ref) or m.name == ref]
    if not exact and any(m.state not in NEVER_RAN for m in named):
        # a relaunch keeps the name: a refused attempt (nothing started) never makes the run that ran ambiguous
        named = [m for m in named if m.state not in NEVER_RAN]
    ids = list(dict.fromkeys(m.id for m in named))
    if len(ids) > 1:
        firsts: dict[str, Match] = {}
        for m in sorted(named, key=lambda m: (m.node_rank, m.host)):
            firsts.setdefault(m.id, m)
        cands = sorted(firsts.values(), key=lambda m: -(m.started or 0))
        raise AmbiguousRun(ref, [Candidate(m.host, m.id, m.name, m.state, m.started) for m in cands])
    return sorted(named, key=lambda m: m.node_rank)


@dataclass
class Resolved:
    """The run a reference names: its nodes (one for a one-host run) and the hosts of it that did not answer."""

    ref: str
    id: str
    nodes: list[tuple[str, RunInfo]]
    missing: list[str] = field(default_factory=list)  # hosts that did not answer and are (or may be) nodes of it
    unanswered: list[str] = field(default_factory=list)  # every host that did not answer

    @property
    def host(self) -> str:
        """The first node's host."""
        return self.nodes[0][0]

    @property
    def run(self) -> RunInfo:
        """The first node's run."""
        return self.nodes[0][1]


@dataclass
class FleetRuns:
    """Every run the asked hosts' agents recorded, newest first, each named by the fleet's name for its host, and who did not answer."""

    runs: list[tuple[str, RunInfo]] = field(default_factory=list)
    unanswered: dict[str, str] = field(default_factory=dict)  # host -> why


async def fleet_runs(fleet: Fleet, hosts: Sequence[str] | None = None, limit: int = LIST_LIMIT) -> FleetRuns:
    """Ask every host (or ``hosts``) for its runs at once."""
    names = list(hosts) if hosts else list(fleet.links)
    lists = await asyncio.gather(*(fleet.runs(h, limit=limit) for h in names), return_exceptions=True)
    out = FleetRuns()
    for h, listed in zip(names, lists):
        if isinstance(listed, AgentError):
            out.unanswered[h] = listed.message
        elif isinstance(listed, BaseException):
            raise listed
        else:
            out.runs.extend((h, r) for r in listed)
    out.runs.sort(key=lambda hr: hr[1].created, reverse=True)
    return out


def _match(host: str, r: RunInfo) -> Match:
    return Match(host, r.id, r.name or r.spec.name, r.state, r.started or r.created or None, r.spec.node_rank or 0)


async def resolve_run(fleet: Fleet, ref: str, host: str | None = None, destructive: bool = False) -> Resolved:
    """The run ``ref`` names on the fleet's hosts (or on ``host``), by the rules above."""
    names = [host] if host else list(fleet.links)
    found: dict[str, list[RunInfo]] = {}
    down: list[str] = []
    # an exact id first: one request each, and it wins over any prefix or name
    exact = await asyncio.gather(*(fleet.run(h, ref) for h in names), return_exceptions=True)
    for h, r in zip(names, exact):
        if isinstance(r, RunInfo) and r.id == ref:
            found.setdefault(h, []).append(r)
    if not found:
        listed = await fleet_runs(fleet, names)
        down = list(listed.unanswered)
        for h, x in listed.runs:
            if x.id.startswith(ref) or (x.name or x.spec.name) == ref:
                found.setdefault(h, []).append(x)
    else:
        down = [h for h, r in zip(names, exact) if isinstance(r, AgentError) and not _is_no_such(r)]
    by_key = {(h, r.id): r for h, rs in found.items() for r in rs}
    try:
        chosen = pick(ref, [_match(h, r) for (h, _), r in by_key.items()])
    except AmbiguousRun as exc:
        raise AmbiguousRun(ref, exc.candidates, down, host_given=host is not None) from None
    where = f"on {host}" if host else "on any host that answered"
    if not chosen:
        raise NoSuchRun(ref, where, down, host_given=host is not None)
    nodes = [(m.host, by_key[(m.host, m.id)]) for m in chosen]
    run = nodes[0][1]
    exact_id = run.id == ref
    if destructive and down and not exact_id and any(r.state in LIVE_STATES for _h, r in nodes):
        raise Unanswered(
            f"{', '.join(down)} did not answer and may hold another run named {ref!r}: "
            f"give --host or the full id ({run.id} on {nodes[0][0]}) to act on this one"
        )
    # a silent host is missing only when it is a node of this run: a one-host run (no node list) was found whole
    missing = [h for h in down if h in set(run.spec.nodes or [])]
    return Resolved(ref=ref, id=run.id, nodes=nodes, missing=missing, unanswered=down)


async def nodes_of(fleet: Fleet, host: str, run: RunInfo) -> Resolved:
    """Every node of a run already found on ``host``: that run alone, or each node of a multi-node run (asked anew)."""
    if run.spec.nnodes and run.spec.nnodes > 1:
        return await resolve_run(fleet, run.id)
    return Resolved(run.id, run.id, [(host, run)])


def _is_no_such(exc: AgentError) -> bool:
    """The agent answered (no such run, or several there): the host is reachable."""
    from gpudeck.agents.wire.errors import AgentUnavailable

    return not isinstance(exc, AgentUnavailable)


# ----------------------------------------------------------------------------- the history


def _record_match(row: RunRecord) -> Match:
    return Match(row.host, row.id, row.name, row.state or "?", row.started or row.created, row.node_rank)


def resolve_record(
    rows: Sequence[RunRecord], ref: str, host: str | None = None, unanswered: Sequence[str] = (), destructive: bool = False
) -> RunRecord:
    """The history row ``ref`` names among ``rows`` (the history's candidates), by the same rules; the first node's row.

    ``unanswered``: hosts whose newest runs the history may lack (their sync did not answer).
    """
    rows = [r for r in rows if host is None or r.host == host]
    by_key = {(r.host, r.id): r for r in rows}
    try:
        chosen = pick(ref, [_record_match(r) for r in by_key.values()])
    except AmbiguousRun as exc:
        raise AmbiguousRun(ref, exc.candidates, list(unanswered), host_given=host is not None) from None
    if not chosen:
        raise NoSuchRun(
            ref, f"in the history{' of ' + host if host else ''}", list(unanswered), listing="gpudeck history", host_given=host is not None
        )
    row = by_key[(chosen[0].host, chosen[0].id)]
    if destructive and unanswered and row.id != ref and row.state in LIVE_STATES:
        raise Unanswered(
            f"{', '.join(unanswered)} did not answer and may hold another run named {ref!r}: "
            f"give --host or the full id ({row.id} on {row.host}) to act on this one"
        )
    return row
