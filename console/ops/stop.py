"""Provides stop and reclaim: a whole run on every node of it, or exactly the pids asked for, each verified by its agent.

A node whose host does not answer is not forgotten: its stop is recorded in
the history and delivered the next time any command reaches that host.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gpudeck.agents.wire.errors import AgentError, AgentUnavailable
from gpudeck.agents.wire.protocol import StopResult
from gpudeck.console.core import config as cfg
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.replica import History
from gpudeck.console.ops.errors import IntentError
from gpudeck.console.ops.resolve import Resolved


@dataclass
class StopOutcome:
    """What a stop did: each node's verified result, and the nodes whose stop waits for their host (recorded)."""

    run_id: str
    results: list[tuple[str, StopResult]] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)

    @property
    def survivors(self) -> bool:
        """Whether any process of the run survived the stop."""
        return any(r.survivors for _h, r in self.results)


async def stop_run(fleet: Fleet, found: Resolved, grace_s: float, history: History | None) -> StopOutcome:
    """Stop every node of a resolved run (TERM, grace, KILL, verify); an unreachable node's stop is recorded for later."""
    replies = await asyncio.gather(*(fleet.stop(h, r.id, grace_s) for h, r in found.nodes), return_exceptions=True)
    out = StopOutcome(found.id, pending=list(found.missing))
    for (h, _r), res in zip(found.nodes, replies):
        if isinstance(res, AgentUnavailable):
            out.pending.append(h)
        elif isinstance(res, BaseException):
            raise res
        else:
            out.results.append((h, res))
    if history is not None:
        for h in out.pending:
            await asyncio.to_thread(history.add_pending_stop, h, found.id, grace_s)
    return out


def reclaim_targets(targets: list[str]) -> tuple[str | None, dict[str, list[int]]]:
    """['gpu1'] -> ('gpu1', {}) (list its leftovers); ['gpu1:4412', 'gpu2:77'] -> (None, {'gpu1': [4412], 'gpu2': [77]})."""
    if len(targets) == 1 and ":" not in targets[0]:
        return targets[0], {}
    pids: dict[str, list[int]] = {}
    for t in targets:
        host, sep, pid = t.rpartition(":")
        if not sep or not pid.isdigit():
            raise IntentError(
                "targets",
                f"{t!r} is neither HOST nor HOST:PID",
                "write HOST to list the leftovers, or HOST:PID ... to stop those processes",
            )
        pids.setdefault(host or cfg.LOCAL, []).append(int(pid))
    return None, pids


async def reclaim(
    fleet: Fleet, pids: dict[str, list[int]], grace_s: float, include_live: bool = False
) -> list[tuple[str, StopResult | str]]:
    """Stop exactly these pids on each host (verified through NVML); a host's error message in place of its result."""
    hosts = list(pids)
    replies = await asyncio.gather(*(fleet.reclaim(h, pids[h], grace_s, include_live) for h in hosts), return_exceptions=True)
    out: list[tuple[str, StopResult | str]] = []
    for h, res in zip(hosts, replies):
        if isinstance(res, AgentError):
            out.append((h, res.message))
        elif isinstance(res, BaseException):
            raise res
        else:
            out.append((h, res))
    return out
