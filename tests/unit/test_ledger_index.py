"""The history's ledger index (console/history/ledger_index.py) on a real history.db: records folded into one row per
hold (start, peak, end; out of order too), the bytes at a time, and hostile gpu_hold records quarantined by themselves
while the rest of the batch goes in."""

from __future__ import annotations

from pathlib import Path

from gpudeck.agents.wire.protocol import Event
from gpudeck.console.history.replica import History

GIB = 2**30


def rec(seq: int, ts: float, change: str, gib: float, **extra: object) -> Event:
    data = {"change": change, "hold": "h1", "gpu": 3, "uuid": "GPU-X", "pid": 42, "attribution": "RUN", "started": 100.0}
    data.update({"bytes": int(gib * GIB), "peak": int(gib * GIB), "run": "r-1", "rank": 2, **extra})
    return Event(seq=seq, ts=ts, kind="gpu_hold", run_id="r-1", data=data)


def test_records_fold_into_one_hold_with_the_bytes_at_each_time(tmp_path: Path) -> None:
    h = History(tmp_path / "history.db")
    try:
        h.cursor("gpu1", "e1")
        # the end and the level arrive before the start (another batch): the row is the same
        h.submit("gpu1", "e1", [rec(3, 300.0, "end", 40, evidence="gone"), rec(2, 200.0, "level", 40)]).result()
        h.submit("gpu1", "e1", [rec(1, 100.0, "start", 2, container={"runtime": "lxc", "id": "200", "name": "trainer"})]).result()
        (row,) = h.ledger_between("gpu1", 3, 0.0, 1000.0)
        assert (row.started, row.ended, row.peak, row.run_id, row.rank, row.pid, row.end_evidence) == (
            100.0,
            300.0,
            40 * GIB,
            "r-1",
            2,
            42,
            "gone",
        )
        assert [x.at_bytes for x in h.ledger_at("gpu1", 3, 150.0)] == [2 * GIB] and row.container == "lxc:200(trainer)"
        assert [x.at_bytes for x in h.ledger_at("gpu1", 3, 250.0)] == [40 * GIB]
        assert h.ledger_at("gpu1", 3, 99.0) == [] and h.ledger_at("gpu1", 3, 301.0) == [] and h.ledger_at("gpu1", 2, 150.0) == []
        assert [x.hold for x in h.ledger_of_run("gpu1", "r-1")] == ["h1"] and h.ledger_of_run("gpu2", "r-1") == []
    finally:
        h.close()


def test_hostile_gpu_hold_records_are_quarantined_alone(tmp_path: Path) -> None:
    h = History(tmp_path / "history.db")
    try:
        h.cursor("gpu1", "e1")
        bad = [
            Event(seq=1, ts=1.0, kind="gpu_hold", run_id=None, data={"hold": 5, "gpu": 0, "started": 1.0, "change": "start"}),
            Event(seq=2, ts=1.0, kind="gpu_hold", run_id=None, data={"hold": "x", "gpu": "0", "started": 1.0, "change": "start"}),
            Event(seq=3, ts=1.0, kind="gpu_hold", run_id=None, data={"hold": "x", "gpu": 0, "started": 1.0, "change": "vanish"}),
            Event(seq=4, ts=1.0, kind="gpu_hold", run_id=None, data={"hold": "x", "gpu": 2**70, "started": 1.0, "change": "start"}),
            Event(
                seq=5, ts=1.0, kind="gpu_hold", run_id=None, data={"hold": "y", "gpu": 0, "started": 1.0, "change": "start", "bytes": 1.5}
            ),
            Event(
                seq=7,
                ts=1.0,
                kind="gpu_hold",
                run_id=None,
                data={"hold": "z", "gpu": 0, "started": 1.0, "change": "start", "container": "x"},
            ),
        ]
        h.submit("gpu1", "e1", [*bad, rec(6, 100.0, "start", 2)]).result()
        assert sorted(p.seq for p in h.problems("gpu1") if p.seq is not None) == [1, 2, 3, 4, 5, 7]
        assert [x.hold for x in h.ledger_at("gpu1", 3, 150.0)] == ["h1"]
        assert h.seqs("gpu1", "e1") == [6]
    finally:
        h.close()
