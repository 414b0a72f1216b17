"""The multi-node rank-death policy (console/ops/rank_death.py), over a real history file and a fleet of fixture links:
one node of a ``--on-rank-death stop`` run fails, so the live nodes are stopped (once) and an unreachable one gets its
stop recorded for later; a run launched with ``alert`` is left alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import Event, LaunchSpec, RunInfo, StopResult
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.replica import History
from gpudeck.console.ops.rank_death import RankDeathPolicy
from tests.functional.fixture_fleet import T0, fixture_link, history_events

RID = "r-0dead0de"


def _node(host: str, rank: int, policy: str) -> RunInfo:
    spec = LaunchSpec(argv=["sleep", "600"], nodes=["nodea", "nodeb", "nodec"], node_rank=rank, nnodes=3, run_id=RID, on_rank_death=policy)  # type: ignore[arg-type]
    return RunInfo(id=RID, host=host, state="running", spec=spec, created=T0, started=T0)


class Nodes(Fleet):
    """nodea and nodeb up, nodec unreachable; a stop is recorded, not sent."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.links = {
            "nodea": fixture_link("nodea", "up"),
            "nodeb": fixture_link("nodeb", "up"),
            "nodec": fixture_link("nodec", "unreachable", error="connect timed out (fixture)"),
        }
        self.stops: list[tuple[str, str, str]] = []
        self.tasks: list[asyncio.Future] = []

    def spawn(self, coro):  # type: ignore[no-untyped-def]
        self.tasks.append(asyncio.ensure_future(coro))

    async def stop(self, host: str, run_id: str, grace_s: float = 30.0, reason: str = "") -> StopResult:  # type: ignore[override]
        self.stops.append((host, run_id, reason))
        return StopResult(run_id=run_id, state="stopped")


@pytest.mark.parametrize("policy", ["stop", "alert"])
async def test_a_failed_node_stops_the_others_once(tmp_path: Path, policy: str) -> None:
    history = History(tmp_path / "history.db")
    try:
        for rank, host in enumerate(("nodea", "nodeb", "nodec")):
            history.submit(host, "e", history_events(_node(host, rank, policy), 1)).result(30)
        failed = Event(seq=9, ts=T0 + 60, kind="run_state", run_id=RID, data={"state": "failed", "ended": T0 + 60})
        history.submit("nodea", "e", [failed]).result(30)  # synced, then handed to the fleet's watchers
        fleet = Nodes(history)
        watch = RankDeathPolicy(fleet)
        watch.on_events("nodea", [failed])
        await asyncio.gather(*fleet.tasks)
        watch.on_events("nodea", [failed])  # again: acted on once
        await asyncio.gather(*fleet.tasks)
        if policy == "alert":
            assert fleet.stops == [] and history.pending_stops("nodec") == []
            return
        stopped = sorted(h for h, _r, _why in fleet.stops)
        assert stopped == ["nodeb"] and all("--on-rank-death stop" in why and "node nodea failed" in why for *_x, why in fleet.stops)
        assert history.pending_stops("nodec") == [(RID, 30.0)]  # delivered when nodec is back
    finally:
        history.close()
