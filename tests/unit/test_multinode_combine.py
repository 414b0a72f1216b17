"""Which node of a multi-node run failed first: the earliest rank death, not the first node whose torchrun exited."""

from __future__ import annotations

from gpudeck.agents.wire.protocol import LaunchSpec, RunInfo
from gpudeck.console.core.records import RunRecord
from gpudeck.console.fleet.multinode import combine
from gpudeck.console.present.formats import RECORD_KEYS, group_runs, record_shape, run_json


def _row(host: str, node_rank: int, ended: float, alerts: list[dict] | None = None) -> RunRecord:
    return RunRecord(
        id="r-1",
        host=host,
        state="failed",
        cause=f"{host} exit code 1",
        ended=ended,
        spec={"node_rank": node_rank, "nodes": ["nodea", "nodeb"]},
        alerts=alerts or [],
    )


def test_the_node_whose_rank_died_first_is_named_even_if_it_ended_later() -> None:
    a = _row("nodea", 0, 104.0, [{"kind": "rank_exited", "ts": 103.0, "data": {"gone_s": 1.0}}])  # its rank died at 102 (lost its peer)
    b = _row("nodeb", 1, 105.0, [{"kind": "rank_exited", "ts": 105.0, "data": {"gone_since": 100.5, "member_ended": True}}])
    run = combine([a, b])
    assert run.state == "failed" and run.cause is not None and run.cause.startswith("node 1 (nodeb) failed first")


def test_without_alerts_the_first_to_end_is_named() -> None:
    run = combine([_row("nodea", 0, 110.0), _row("nodeb", 1, 107.0)])
    assert run.cause is not None and run.cause.startswith("node 1 (nodeb) failed first")


def _info(host: str, rid: str, rank: int | None, state: str) -> RunInfo:
    nodes = ["nodea", "nodeb"] if rank is not None else []
    spec = LaunchSpec(argv=["x"], nodes=nodes, node_rank=rank, nnodes=2 if rank is not None else None)
    return RunInfo(id=rid, host=host, state=state, spec=spec, created=1.0, started=2.0, ended=9.0 if state != "running" else None)  # type: ignore[arg-type]


def test_gpudeck_runs_prints_a_multi_node_run_as_one_object_and_a_lone_run_as_the_agent_said() -> None:
    runs = [_info("nodeb", "r-2", 1, "failed"), _info("nodea", "r-2", 0, "succeeded"), _info("gpu1", "r-1", None, "running")]
    multi, lone = group_runs(runs)
    # one record shape (README): the history's keys in their order, each from the agent's run where it has one
    assert lone == record_shape(run_json(runs[2]), RunRecord.from_info(runs[2]).as_json())
    assert list(multi)[: len(RECORD_KEYS)] == list(RECORD_KEYS) and {"hosts", "nodes"} <= set(multi)
    assert (multi["host"], multi["hosts"], multi["state"]) == ("nodea+nodeb", ["nodea", "nodeb"], "failed")
    assert multi["nodes"] == [{"host": "nodea", "state": "succeeded", "cause": None}, {"host": "nodeb", "state": "failed", "cause": None}]
