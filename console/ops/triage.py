"""Provides the triage operation: every node of a run asked for its ranks' evidence now, and the triage as text.

One implementation for the CLI (``gpudeck triage RUN``) and the console; ``gpudeck show`` prints the
triages stored with a run (journal events ``triage``) through :func:`stored_triages`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Triage
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.resolve import Resolved

MAX_STACK_LINES = 40  # per rank in the text (the --json output and the journal keep the whole, bounded by the agent)


async def triage_run(fleet: Fleet, found: Resolved) -> tuple[list[tuple[str, Triage]], list[tuple[str, str]]]:
    """Ask every node of the run for a triage; (host, triage) of those that answered, (host, why) of those that did not."""

    async def one(host: str, run_id: str) -> tuple[str, Triage | str]:
        try:
            return host, (await fleet.triage(host, run_id)).triage
        except AgentError as exc:
            return host, exc.message

    got = await asyncio.gather(*(one(host, run.id) for host, run in found.nodes))
    ok = [(h, t) for h, t in got if isinstance(t, Triage)]
    failed = [(h, t) for h, t in got if isinstance(t, str)] + [(h, "did not answer") for h in found.missing]
    return ok, failed


def format_triage(t: Triage, host: str = "", stacks: bool = True) -> str:
    """A triage as text: the culprit first, then one block per rank (state, CPU, GPU, method, where, stacks)."""
    on = f" on {host}" if host else ""
    lines = [f"triage of {t.run_id}{on} ({t.reason}, gathered in {t.seconds:.1f} s)", f"  likely culprit: {t.culprit}"]
    if t.flight_recorder:
        lines.append(f"  {t.flight_recorder}")
    for why in t.missing:
        lines.append(f"  MISSING {why}")
    for e in t.ranks:
        who = f"rank {e.rank}" if e.rank is not None else "process"
        cpu = "-" if e.cpu_percent is None else f"{e.cpu_percent:.0f}%"
        gpu = (
            "no GPU"
            if e.gpu is None
            else f"GPU {e.gpu} util {e.gpu_util if e.gpu_util is not None else '?'}%"
            + (f" {e.gpu_memory / 2**30:.1f} GiB" if e.gpu_memory else "")
        )
        lines.append(f"  {who} pid {e.pid}{' on ' + e.host if e.host else ''}: {e.state or '?'}, CPU {cpu}, {gpu}")
        lines.append(f"    stacks by {e.method}: {e.method_why}")
        if e.where:
            lines.append(f"    main thread: {e.where}")
        if stacks and e.stacks:
            body = e.stacks.rstrip().splitlines()
            lines += [f"      {x}" for x in body[:MAX_STACK_LINES]]
            if len(body) > MAX_STACK_LINES:
                lines.append(f"      ... {len(body) - MAX_STACK_LINES} more lines (--json has them all)")
    return "\n".join(lines)


def stored_triages(events: list[Any]) -> list[Triage]:
    """The triages stored with a run (its ``triage`` events), oldest first; a malformed one is skipped."""
    out = []
    for e in events:
        if getattr(e, "kind", None) != "triage":
            continue
        try:
            out.append(msgspec.convert((e.data or {}).get("triage"), Triage))
        except msgspec.ValidationError:
            continue
    return out


def show_lines(events: list[Any]) -> list[str]:
    """``gpudeck show``'s lines for the run's newest triage (culprit and per-rank summary, stacks left to --json)."""
    found = stored_triages(events)
    if not found:
        return []
    text = format_triage(found[-1], stacks=False)
    more = f" ({len(found)} triages stored; `gpudeck show --json` has every one with its stacks)" if len(found) > 1 else ""
    return [f"  TRIAGE{more}:"] + ["  " + x for x in text.splitlines()]
