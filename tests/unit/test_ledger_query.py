"""The ledger's question words (console/ops/ledger.py): TIME forms, HOST[:GPU], their typed errors, and a run's
footprint per GPU (overlapping holds counted once)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpudeck.console.ops.ledger import GpuFootprint, HoldRecord, LedgerQueryError, ledger_query, parse_target, parse_time, run_footprint

NOW = dt.datetime(2026, 12, 4, 15, 30, 0).timestamp()  # local time, as the CLI reads a time without a zone


def test_time_forms() -> None:
    assert parse_time("now", NOW) == NOW
    assert parse_time("-2h", NOW) == NOW - 7200 and parse_time("-30m", NOW) == NOW - 1800 and parse_time("-1d", NOW) == NOW - 86400
    assert parse_time("-1.5h", NOW) == NOW - 5400 and parse_time("-1w", NOW) == NOW - 7 * 86400
    assert parse_time("02:14", NOW) == dt.datetime(2026, 12, 4, 2, 14).timestamp()
    assert parse_time("23:59:59", NOW) == dt.datetime(2026, 12, 4, 23, 59, 59).timestamp()
    assert parse_time("2026-12-04T02:14", NOW) == dt.datetime(2026, 12, 4, 2, 14).timestamp()
    assert parse_time("2026-12-04 02:14:30.250", NOW) == dt.datetime(2026, 12, 4, 2, 14, 30, 250000).timestamp()
    assert parse_time("2026-12-04T02:14:00Z", NOW) == dt.datetime(2026, 12, 4, 2, 14, tzinfo=dt.UTC).timestamp()
    assert parse_time("2026-12-04T02:14:00+02:00", NOW) == dt.datetime(2026, 12, 4, 0, 14, tzinfo=dt.UTC).timestamp()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("24:00", "not a time of day"),
        ("12:60", "not a time of day"),
        ("yesterday", "is not a time"),
        ("-2y", "is not a time"),
        ("", "is not a time"),
        ("2026-13-01", "is not a time"),
        ("\x1b[31m", "is not a time"),
        ("9" * 200, "is not a time"),
    ],
)
def test_bad_times_are_typed_errors_that_name_the_forms(text: str, says: str) -> None:
    with pytest.raises(LedgerQueryError, match=says) as caught:
        parse_time(text, NOW)
    assert caught.value.exit_code == 2 and "\x1b" not in caught.value.message  # a control shown escaped, never raw


def test_targets_and_combinations() -> None:
    assert parse_target("gpu1") == ("gpu1", None) and parse_target("gpu1:5") == ("gpu1", 5)
    for bad in ("gpu1:x", ":5", "gpu1:", "a b", "gpu1:99999"):
        with pytest.raises(LedgerQueryError):
            parse_target(bad)
    q = ledger_query("gpu1:5", now=NOW)
    assert (q.mode, q.at, q.gpu) == ("at", NOW, 5)
    q = ledger_query("gpu1", since="-1h", now=NOW)
    assert (q.mode, q.since, q.until) == ("between", NOW - 3600, NOW)
    assert ledger_query("gpu1", run="r-1", now=NOW).mode == "run"
    assert ledger_query("gpu1", at="-1h", run="r-1", now=NOW).mode == "at"
    with pytest.raises(LedgerQueryError, match="not both"):
        ledger_query("gpu1", at="now", until="-1h", now=NOW)
    with pytest.raises(LedgerQueryError, match="swap them"):
        ledger_query("gpu1", since="-1h", until="-2h", now=NOW)


def test_a_runs_footprint_counts_overlapping_holds_once_per_gpu() -> None:
    holds = [
        HoldRecord(host="h", hold="a", gpu=0, started=100.0, ended=200.0, pid=1, rank=0, peak=10),
        HoldRecord(host="h", hold="b", gpu=0, started=150.0, ended=300.0, pid=2, rank=0, peak=30),  # overlaps a
        HoldRecord(host="h", hold="c", gpu=0, started=400.0, ended=450.0, pid=3, rank=0, peak=5),
        HoldRecord(host="h", hold="d", gpu=1, started=100.0, pid=4, rank=1, peak=7),  # still held
    ]
    fp = run_footprint(holds, now=1000.0)
    assert fp == [
        GpuFootprint(host="h", gpu=0, uuid=None, first=100.0, last=450.0, held_s=250.0, peak=30, pids=[1, 2, 3], ranks=[0]),
        GpuFootprint(host="h", gpu=1, uuid=None, first=100.0, last=None, held_s=900.0, peak=7, pids=[4], ranks=[1]),
    ]
