"""The run-reference rules (console/ops/resolve.py) on their own: exact id wins, unique prefix or name, never a silent pick."""

from __future__ import annotations

import pytest

from gpudeck.agents.wire.errors import AgentError, AgentUnavailable
from gpudeck.agents.wire.protocol import LaunchSpec, RunInfo
from gpudeck.console.core.records import RunRecord
from gpudeck.console.ops.errors import AmbiguousRun, NoSuchRun, Unanswered
from gpudeck.console.ops.resolve import Match, pick, resolve_record


def m(host: str, rid: str, name: str | None = None, state: str = "running", started: float = 0.0, rank: int = 0) -> Match:
    return Match(host, rid, name, state, started, rank)


RUNS = [
    m("gpu1", "r-aa11", "dup", started=3),
    m("gpu1", "r-aa12", "dup", started=2),
    m("gpu2", "r-bb11", "dup", started=1),
    m("gpu2", "r-cc11", "r-aa11x"),
    m("gpu1", "r-dd11", "multi", rank=0),
    m("gpu2", "r-dd11", "multi", rank=1),
]


def test_an_exact_id_wins_over_a_prefix_and_a_name() -> None:
    assert [x.id for x in pick("r-aa11", RUNS)] == ["r-aa11"]


def test_a_name_of_several_runs_is_refused_with_every_candidate_newest_first() -> None:
    with pytest.raises(AmbiguousRun) as e:
        pick("dup", RUNS)
    assert [c.id for c in e.value.candidates] == ["r-aa11", "r-aa12", "r-bb11"]
    assert e.value.exit_code == 2
    text = str(e.value)
    assert "'dup' matches 3 runs" in text and all(h in text for h in ("gpu1", "gpu2")) and "STARTED" in text


def test_a_prefix_of_several_is_refused_and_a_unique_one_resolves() -> None:
    with pytest.raises(AmbiguousRun, match="matches 2 runs"):
        pick("r-aa", RUNS)
    assert [x.id for x in pick("r-bb", RUNS)] == ["r-bb11"]
    assert pick("r-zz", RUNS) == []


def test_the_nodes_of_one_multi_node_run_are_one_run() -> None:
    nodes = pick("multi", RUNS)
    assert [(x.host, x.node_rank) for x in nodes] == [("gpu1", 0), ("gpu2", 1)]


def _row(host: str, rid: str, name: str | None, state: str = "running") -> RunRecord:
    return RunRecord(host=host, id=rid, name=name, state=state, started=1.0)


def test_history_references_follow_the_same_rules() -> None:
    rows = [_row("gpu1", "r-1", "a"), _row("gpu2", "r-2", "a"), _row("gpu1", "r-3", "b", "failed")]
    with pytest.raises(AmbiguousRun):
        resolve_record(rows, "a")
    assert resolve_record(rows, "a", host="gpu2").id == "r-2"
    with pytest.raises(NoSuchRun, match="gpu3 did not answer"):
        resolve_record(rows, "zz", unanswered=["gpu3"])
    # a destructive command by name while a host is silent: refused for a live run, fine for an ended one and by id
    with pytest.raises(Unanswered, match="gpu3 did not answer"):
        resolve_record([rows[0]], "a", unanswered=["gpu3"], destructive=True)
    assert resolve_record(rows, "b", unanswered=["gpu3"], destructive=True).id == "r-3"
    assert resolve_record(rows, "r-1", unanswered=["gpu3"], destructive=True).id == "r-1"


def test_with_host_given_no_message_says_give_host() -> None:
    rows = [_row("gpu1", "r-1", "a"), _row("gpu1", "r-4", "a")]
    with pytest.raises(NoSuchRun) as none:
        resolve_record(rows, "zz", host="gpu3", unanswered=["gpu3"])
    assert "give --host" not in str(none.value) and "gpu3 did not answer: try again when it is back" in str(none.value)
    with pytest.raises(AmbiguousRun) as several:
        resolve_record(rows, "a", host="gpu1")
    assert "--host" not in str(several.value) and "give the full id (or more of it)" in str(several.value)
    with pytest.raises(NoSuchRun, match="give --host or the full id"):  # without --host it is still the way forward
        resolve_record(rows, "zz", unanswered=["gpu3"])


class _Fleet:
    """The three calls the resolver makes of a fleet; ``down`` hosts do not answer."""

    def __init__(self, runs: dict[str, list[RunInfo]], down: set[str]) -> None:
        self.by_host, self.down = runs, down
        self.links = {**{h: None for h in runs}, **{h: None for h in down}}

    async def run(self, host: str, ref: str) -> RunInfo:
        if host in self.down:
            raise AgentUnavailable(f"host {host} is unreachable: test")
        for r in self.by_host[host]:
            if r.id == ref:
                return r
        raise AgentError(f"no run {ref}")

    async def runs(self, host: str, limit: int = 0) -> list[RunInfo]:
        if host in self.down:
            raise AgentUnavailable(f"host {host} is unreachable: test")
        return self.by_host[host]


def _info(rid: str, name: str, nodes: list[str] | None = None, rank: int = 0) -> RunInfo:
    spec = LaunchSpec(argv=["sleep", "1"], name=name, nodes=nodes or [], node_rank=rank if nodes else None, run_id=rid if nodes else None)
    return RunInfo(id=rid, host="x", state="running", spec=spec, name=name, created=1.0)


def test_a_silent_host_is_missing_only_when_it_is_a_node_of_the_run() -> None:
    import asyncio

    from gpudeck.console.ops.resolve import resolve_run

    one = _info("r-0001", "solo")
    multi = _info("r-0002", "pair", nodes=["gpu1", "gpu2"])
    fleet = _Fleet({"gpu1": [one, multi]}, down={"gpu2", "gpu3"})
    for ref in ("solo", "r-0001"):  # a one-host run found whole, by name or by id: no silent host is a node of it
        found = asyncio.run(resolve_run(fleet, ref))  # type: ignore[arg-type]
        assert found.missing == [] and sorted(found.unanswered) == ["gpu2", "gpu3"], ref
    for ref in ("pair", "r-0002"):  # a multi-node run: its silent node is named, the other silent host is not
        found = asyncio.run(resolve_run(fleet, ref))  # type: ignore[arg-type]
        assert found.missing == ["gpu2"], ref
