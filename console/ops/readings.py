"""Provides what the CLI and the console read from a host about a run or its leftovers, each read once: a run's claims
checked (verify), its step metrics (the agent's, else the history's), its output (and a multi-node run's, merged by
whole lines), and a host's leftovers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import LeftoverList, OutputChunk, VerifyReply
from gpudeck.console.fleet.fleet import Fleet


async def verify_run(fleet: Fleet, host: str, run_id: str) -> VerifyReply:
    """A run's claims against what its agent observes (raises AgentError when the host does not answer)."""
    return await fleet.verify(host, run_id)


async def host_leftovers(fleet: Fleet, host: str, include_live: bool = False) -> LeftoverList:
    """A host's leftovers (stale and foreign GPU holders; members of live runs too with ``include_live``)."""
    return await fleet.leftovers(host, include_live=include_live)


def run_output(fleet: Fleet, host: str, run_id: str, offset: int = 0, follow: bool = True) -> AsyncIterator[OutputChunk]:
    """A run's output from a byte offset (negative: from the end), following it while the run lives when ``follow``."""
    return fleet.output(host, run_id, offset=offset, follow=follow)


@dataclass(frozen=True)
class StepSeries:
    """A run's step metrics, index-aligned (None where a step did not report the figure), and where they came from."""

    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)
    source: str = "agent"  # agent | history | none


async def run_metrics(fleet: Fleet, host: str, run_id: str, max_points: int = 200) -> StepSeries:
    """A run's step metrics from its agent; from the history when the agent cannot be asked (the host is down, or it
    no longer has the run)."""
    try:
        m = await fleet.metrics(host, run_id, max_points=max_points)
        return StepSeries(list(m.steps), list(m.loss), list(m.tokens_per_s))
    except AgentError:
        if fleet.history is None:
            return StepSeries(source="none")
    pts = await asyncio.to_thread(fleet.history.metrics, host, run_id)
    return StepSeries([p.step for p in pts], [p.loss for p in pts], [p.tokens_per_s for p in pts], source="history")


TAIL_WINDOW = 256 * 1024  # bytes read back from a run's output's end for its last lines


async def tail_nodes(fleet: Fleet, nodes: Sequence[tuple[str, str]], lines: int, follow: bool, emit: Callable[[str, str], None]) -> None:
    """The last ``lines`` lines (-1: all of the last :data:`TAIL_WINDOW` bytes) of each node's output, then, with
    ``follow``, what comes until the run ends: ``emit(host, text)`` gets whole lines only, so the nodes' lines never mix
    (the nodes one after another without ``follow``, all at once with it)."""

    async def one(host: str, run_id: str) -> None:
        window = await anext(run_output(fleet, host, run_id, offset=-TAIL_WINDOW, follow=False))
        last = window.data.splitlines(keepends=True)
        if lines >= 0:
            last = last[-lines:] if lines else []
        if last:
            emit(host, "".join(last))
        if not follow:
            return
        pending = ""
        async for chunk in run_output(fleet, host, run_id, offset=window.next_offset, follow=True):
            pending += chunk.data
            cut = pending.rfind("\n") + 1
            if cut:
                emit(host, pending[:cut])
                pending = pending[cut:]
        if pending:
            emit(host, pending + "\n")

    if follow:
        await asyncio.gather(*(one(h, rid) for h, rid in nodes))
    else:
        for h, rid in nodes:
            await one(h, rid)
