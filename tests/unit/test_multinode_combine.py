"""Which node of a multi-node run failed first: the earliest rank death, not the first node whose torchrun exited."""

from __future__ import annotations

from gpudeck.console.multinode import combine


def _row(host: str, node_rank: int, ended: float, alerts: list[dict] | None = None) -> dict:
    return {
        "id": "r-1",
        "host": host,
        "state": "failed",
        "cause": f"{host} exit code 1",
        "ended": ended,
        "spec": {"node_rank": node_rank, "nodes": ["nodea", "nodeb"]},
        "alerts": alerts or [],
    }


def test_the_node_whose_rank_died_first_is_named_even_if_it_ended_later() -> None:
    a = _row("nodea", 0, 104.0, [{"kind": "rank_exited", "ts": 103.0, "data": {"gone_s": 1.0}}])  # its rank died at 102 (lost its peer)
    b = _row("nodeb", 1, 105.0, [{"kind": "rank_exited", "ts": 105.0, "data": {"gone_since": 100.5, "member_ended": True}}])
    run = combine([a, b])
    assert run.state == "failed" and run.cause is not None and run.cause.startswith("node 1 (nodeb) failed first")


def test_without_alerts_the_first_to_end_is_named() -> None:
    run = combine([_row("nodea", 0, 110.0), _row("nodeb", 1, 107.0)])
    assert run.cause is not None and run.cause.startswith("node 1 (nodeb) failed first")
