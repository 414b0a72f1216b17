"""Provides the multi-node rank-death policy: a run launched with ``--on-rank-death stop`` on several hosts is stopped
on every node when one node fails, loses a rank, or stays unreachable for :data:`NODE_LOST_S` (a node that cannot be
reached gets its stop recorded in the history and delivered when it is back).

The Fleet only reports what its links see (:meth:`~gpudeck.console.fleet.fleet.Fleet.add_watcher`); this module
decides. The console and ``gpudeck watch`` attach it to their long-lived fleet with :func:`attach`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Event
from gpudeck.console.core.records import HostStatus
from gpudeck.console.fleet.fleet import Fleet

NODE_LOST_S = 30.0  # a multi-node run's host unreachable this long counts as a lost node
STOP_GRACE_S = 30.0


class RankDeathPolicy:
    """Watches a fleet's events and link states; stops the other nodes of a ``--on-rank-death stop`` run, once."""

    def __init__(self, fleet: Fleet, node_lost_s: float = NODE_LOST_S) -> None:
        self.fleet = fleet
        self.node_lost_s = node_lost_s
        self.acted: set[str] = set()  # multi-node runs already stopped by this policy

    def on_events(self, host: str, events: Sequence[Event]) -> None:
        """New journal events from ``host``: a node that failed or lost a rank."""
        for ev in events:
            data = ev.data or {}
            ended = ev.kind == "run_state" and data.get("state") in ("failed", "lost")
            died = ev.kind == "alert" and (data.get("alert") or {}).get("kind") == "rank_exited"
            if (ended or died) and ev.run_id and ev.run_id not in self.acted:
                self.fleet.spawn(self.stop_other_nodes(ev.run_id, host, f"node {host} {'failed' if ended else 'lost a rank'}"))

    def on_link_state(self, st: HostStatus) -> None:
        """A host's link changed: one that went unreachable is a lost node if it stays so."""
        if st.state == "unreachable" and self.fleet.history is not None:
            self.fleet.spawn(self._node_lost(st.name, st.since))

    async def _node_lost(self, host: str, since: float) -> None:
        await asyncio.sleep(self.node_lost_s)
        link = self.fleet.links.get(host)
        history = self.fleet.history
        if link is None or link.status.state == "up" or link.status.since != since or history is None:
            return
        rows = await asyncio.to_thread(history.query, f"host:{host} state:live")
        for r in rows:
            if r.spec_nnodes > 1 and r.id not in self.acted:
                await self.stop_other_nodes(r.id, host, f"node {host} unreachable for {self.node_lost_s:.0f} s")

    async def stop_other_nodes(self, run_id: str, culprit: str, why: str) -> None:
        """Stop every live node of ``run_id`` (when launched with --on-rank-death stop); an unreachable one later."""
        history = self.fleet.history
        if history is None:
            return
        rows = [r for r in await asyncio.to_thread(history.query, f"id:{run_id} limit:64") if r.id == run_id]
        if not rows:
            return
        spec = rows[0].launch_spec_or_none()
        if rows[0].spec_nnodes < 2 or spec is None or spec.on_rank_death != "stop" or run_id in self.acted:
            return
        self.acted.add(run_id)
        for r in rows:
            if r.state not in ("starting", "running"):
                continue
            link = self.fleet.links.get(r.host)
            if link is None or link.status.state != "up":
                await asyncio.to_thread(history.add_pending_stop, r.host, run_id, STOP_GRACE_S)
                continue
            try:
                await self.fleet.stop(
                    r.host,
                    run_id,
                    STOP_GRACE_S,
                    reason=f"a rank died on another node ({why}) and the run was launched with --on-rank-death stop",
                )
            except AgentError:
                await asyncio.to_thread(history.add_pending_stop, r.host, run_id, STOP_GRACE_S)


def attach(fleet: Fleet) -> RankDeathPolicy:
    """Watch ``fleet`` with the rank-death policy (the console's and the watcher's long-lived fleets)."""
    policy = RankDeathPolicy(fleet)
    fleet.add_watcher(policy)
    return policy
