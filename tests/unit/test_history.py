"""History replica: idempotent ingest, runs rebuilt from events, epochs, and the filter language (real SQLite files)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import Event
from gpudeck.console.history.query import QueryError, compile_query, parse_time
from gpudeck.console.history.replica import History
from gpudeck.console.ops.errors import AmbiguousRun, NoSuchRun

T0 = 1_790_000_000.0


def _events(
    run_id: str = "r-aaaa1111", name: str = "llama", start_seq: int = 1, cause: str = "exit code 1 (CUDA out of memory)"
) -> list[Event]:
    spec = {
        "argv": ["python", "-m", "gpudeck.trainers.fsdp_lm", "--fresh"],
        "kind": "fsdp",
        "name": name,
        "gpus": [0, 1],
        "operator": "ada",
    }
    evs = [
        Event(seq=0, ts=T0, kind="run_created", run_id=run_id, data={"state": "starting", "spec": spec, "name": name}),
        Event(seq=0, ts=T0 + 1, kind="run_state", run_id=run_id, data={"state": "running", "pid": 42, "started": T0 + 1}),
        Event(seq=0, ts=T0 + 2, kind="members", run_id=run_id, data={"added": [{"pid": 43, "rank": 0}, {"pid": 44, "rank": 1}]}),
        Event(
            seq=0,
            ts=T0 + 3,
            kind="telemetry",
            run_id=run_id,
            data={
                "record": {
                    "type": "manifest",
                    "rank": 0,
                    "params_total": 1_100_048_384,
                    "world_size": 2,
                    "config_hash": "abc",
                    "dataset_samples": 5,
                },
                "offset": 10,
            },
        ),
        Event(
            seq=0,
            ts=T0 + 4,
            kind="telemetry",
            run_id=run_id,
            data={
                "record": {
                    "type": "step",
                    "rank": 0,
                    "step": 10,
                    "loss": 3.5,
                    "tokens_per_s": 70000.0,
                    "mfu": 0.5,
                    "mem_peak_gib": 36.8,
                    "ts": T0 + 4,
                },
                "offset": 20,
            },
        ),
        Event(seq=0, ts=T0 + 9, kind="run_state", run_id=run_id, data={"state": "failed", "cause": cause, "exit_code": 1, "ended": T0 + 9}),
    ]
    for i, e in enumerate(evs):
        e.seq = start_seq + i
    return evs


@pytest.fixture
def hist(tmp_path: Path):
    h = History(tmp_path / "history.db")
    yield h
    h.close()


def test_ingest_rebuilds_the_run_and_a_replay_changes_nothing(hist: History) -> None:
    cur = hist.cursor("gpu1", "epoch-1", "0.1.0", "gpu1")
    assert cur.last_seq == 0 and cur.new_epoch
    evs = _events()
    assert hist.submit("gpu1", "epoch-1", evs).result(10) == len(evs)
    assert hist.submit("gpu1", "epoch-1", evs).result(10) == 0  # the same events again: nothing new
    assert hist.submit("gpu1", "epoch-1", evs[2:]).result(10) == 0
    assert hist.event_count() == len(evs)
    run = hist.find("r-aaaa1111")
    assert run.state == "failed" and run.cause_class == "oom" and run.exit_code == 1
    assert run.started == T0 + 1 and run.ended == T0 + 9 and run.created == T0
    assert run.params_total == 1_100_048_384 and run.world_size == 2 and run.ranks_seen == 2
    assert run.last_step == 10 and run.tokens_per_s == 70000.0 and run.mem_peak_gib == 36.8
    assert run.gpus == [0, 1] and run.argv[-1] == "--fresh" and run.operator == "ada"
    assert hist.metrics("gpu1", "r-aaaa1111")[0].loss == 3.5
    cur2 = hist.cursor("gpu1", "epoch-1")
    assert cur2.last_seq == len(evs) and not cur2.new_epoch


def test_a_new_epoch_is_recorded_and_starts_its_own_sequence(hist: History) -> None:
    hist.cursor("gpu1", "epoch-1")
    hist.submit("gpu1", "epoch-1", _events()).result(10)
    cur = hist.cursor("gpu1", "epoch-2")
    assert cur.new_epoch and cur.last_seq == 0
    hist.submit("gpu1", "epoch-2", _events(run_id="r-bbbb2222")).result(10)  # seq 1.. again, in the new epoch
    assert hist.event_count("gpu1") == 12
    assert [e.replaces for e in hist.epochs("gpu1")] == [None, "epoch-1"]
    assert {r.id for r in hist.query("host:gpu1")} == {"r-aaaa1111", "r-bbbb2222"}


def test_concurrent_hosts_batch_into_few_commits(hist: History) -> None:
    futs = []
    for h in range(20):
        hist.cursor(f"h{h}", "e")
        futs.append(hist.submit(f"h{h}", "e", _events(run_id=f"r-{h:08x}")))
    assert sum(f.result(10) for f in futs) == 20 * 6
    assert hist.batches_committed <= 20
    assert len(hist.query("limit:500")) == 20


def test_the_file_is_plain_sqlite(hist: History, tmp_path: Path) -> None:
    hist.cursor("gpu1", "e")
    hist.submit("gpu1", "e", _events()).result(10)
    with sqlite3.connect(tmp_path / "history.db") as c:
        tables = {r[0] for r in c.execute("select name from sqlite_master where type='table'")}
        assert {"hosts", "epochs", "events", "runs", "metrics"} <= tables
        assert c.execute("select count(*) from runs where cause_class='oom'").fetchone()[0] == 1


def test_filters(hist: History) -> None:
    hist.cursor("gpu1", "e")
    hist.cursor("gpu2", "e")
    hist.submit("gpu1", "e", _events("r-aaaa1111", "drafter-v2")).result(10)
    hist.submit("gpu2", "e", _events("r-bbbb2222", "llama-1b", cause="killed by SIGKILL")).result(10)
    ids = lambda q: [r.id for r in hist.query(q, now=T0 + 3600)]
    assert ids("cause:oom") == ["r-aaaa1111"]
    assert ids("cause:signal") == ["r-bbbb2222"]
    assert ids("host:gpu1") == ["r-aaaa1111"]
    assert ids("name:~drafter") == ["r-aaaa1111"]
    assert ids("-host:gpu1") == ["r-bbbb2222"]
    assert sorted(ids("host:gpu1,gpu2")) == ["r-aaaa1111", "r-bbbb2222"]
    assert sorted(ids("state:failed kind:fsdp since:2h")) == ["r-aaaa1111", "r-bbbb2222"]
    assert ids("since:10m") == []
    assert ids("state:live") == []
    assert ids("r-bbbb") == ["r-bbbb2222"]
    assert ids("limit:1") and len(ids("limit:1")) == 1


def test_a_quote_in_a_value_cannot_change_the_sql(hist: History) -> None:
    hist.cursor("gpu1", "e")
    hist.submit("gpu1", "e", _events("r-cccc3333", "x'; DROP TABLE runs; --")).result(10)
    assert [r.id for r in hist.query('name:"x\'; DROP TABLE runs; --"')] == ["r-cccc3333"]
    assert hist.query('name:"\' OR 1=1 --"') == []
    assert hist.query("name:~%") == []  # LIKE wildcards in a value are literal
    assert len(hist.query("")) == 1  # the table is still there


def test_bad_queries_say_how_to_write_them() -> None:
    with pytest.raises(QueryError, match="unknown filter 'colour'.*state"):
        compile_query("colour:red")
    with pytest.raises(QueryError, match="not a time"):
        compile_query("since:yesterday")
    with pytest.raises(QueryError, match="close the quote"):
        compile_query('name:"open')
    with pytest.raises(QueryError, match="positive number"):
        compile_query("limit:x")
    assert parse_time("7d", now=1000.0 + 7 * 86400) == 1000.0
    assert abs(parse_time("2026-11-30") - time.mktime((2026, 11, 30, 0, 0, 0, 0, 0, -1))) < 1


def test_find_names_ambiguity(hist: History) -> None:
    hist.cursor("gpu1", "e")
    hist.submit("gpu1", "e", _events("r-dddd0001", "same")).result(10)
    hist.submit("gpu1", "e", _events("r-dddd0002", "same", start_seq=7)).result(10)
    with pytest.raises(AmbiguousRun, match="matches 2 runs"):
        hist.find("r-dddd")
    with pytest.raises(AmbiguousRun, match="'same' matches 2 runs"):  # a name of two runs: never a silent pick of the newest
        hist.find("same")
    with pytest.raises(NoSuchRun, match="no run 'r-zzzz'"):
        hist.find("r-zzzz")


def test_a_member_first_read_before_its_exec_is_replaced_when_its_rank_is_known(hist: History) -> None:
    evs = _events()[:2] + [
        Event(seq=0, ts=T0 + 2, kind="members", run_id="r-aaaa1111", data={"added": [{"pid": 43, "rank": None}]}),
        Event(
            seq=0,
            ts=T0 + 3,
            kind="members",
            run_id="r-aaaa1111",
            data={"added": [{"pid": 44, "rank": 1}], "updated": [{"pid": 43, "rank": 0}]},
        ),
    ]
    for i, e in enumerate(evs):
        e.seq = 1 + i
    hist.cursor("gpu1", "epoch-1")
    assert hist.submit("gpu1", "epoch-1", evs).result(10) == len(evs)
    run = hist.find("r-aaaa1111")
    assert [(m["pid"], m["rank"]) for m in run.members] == [(42, None), (43, 0), (44, 1)]
    assert run.ranks_seen == 2


def test_the_process_the_agent_started_heads_the_members_and_outlives_the_cap(hist: History) -> None:
    from gpudeck.console.history.replica import MAX_MEMBERS
    from gpudeck.console.present.formats import format_show

    evs = _events()[:2] + [
        Event(
            seq=0,
            ts=T0 + 2 + i,
            kind="members",
            run_id="r-aaaa1111",
            data={"added": [{"pid": 100 + i, "rank": None, "cmdline": ["sleep", "0.2"]}]},
        )
        for i in range(MAX_MEMBERS + 10)  # a shell loop's helpers, one a tick
    ]
    for i, e in enumerate(evs):
        e.seq = 1 + i
    hist.cursor("gpu1", "epoch-1")
    assert hist.submit("gpu1", "epoch-1", evs).result(10) == len(evs)
    run = hist.find("r-aaaa1111")
    members = run.members
    assert len(members) == MAX_MEMBERS
    assert members[0] == {
        "pid": 42,
        "role": "leader",
        "rank": None,
        "local_rank": None,
        "cmdline": ["python", "-m", "gpudeck.trainers.fsdp_lm", "--fresh"],
    }
    assert members[-1]["pid"] == 100 + MAX_MEMBERS + 9 and members[1]["pid"] == 100 + 11  # the newest of the rest
    text = format_show(run, [])
    assert "pid 42 (leader): python -m gpudeck.trainers.fsdp_lm --fresh" in text
    assert f"... and {MAX_MEMBERS - 32} more (gpudeck show --json lists them)" in text


def test_an_event_sqlite_cannot_store_is_quarantined_by_itself_and_the_batch_goes_in(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from gpudeck.agents.wire.protocol import Event
    from gpudeck.console.history.replica import History

    h = History(tmp_path / "history.db")
    try:
        c = h.cursor("gpu1", "ep1")
        evs = [
            Event(seq=1, ts=1.0, kind="run_created", run_id="r-1", data={"state": "starting", "spec": {"argv": ["x"]}, "name": "one"}),
            Event(
                seq=2, ts=2.0, kind="telemetry", run_id="r-1", data={"record": {"type": "step", "step": 2**64, "loss": 1.0}, "offset": 10}
            ),
            Event(seq=3, ts=3.0, kind="telemetry", run_id="r-1", data={"record": {"type": "manifest", "params_total": 10**30}}),
            Event(seq=4, ts=4.0, kind="run_state", run_id="r-1", data={"state": "running", "bad": "\ud800"}),
            Event(seq=5, ts=5.0, kind="run_state", run_id="r-1", data={"state": "succeeded", "exit_code": 0}),
        ]
        assert asyncio.run(h.ingest(c.host, c.epoch, evs)) == 2
        assert h.find("r-1").state == "succeeded"
        problems = h.problems()
        assert [p.seq for p in problems] == [2, 3, 4] and h.events_quarantined == 3
        assert "does not fit SQLite's 64-bit INTEGER" in problems[0].error and "18446744073709551616" in problems[0].raw
        assert "surrogate" in problems[2].error
        assert h.cursor("gpu1", "ep1").last_seq == 5  # nothing is pulled again
        # again: idempotent, nothing new, nothing quarantined twice
        assert asyncio.run(h.ingest(c.host, c.epoch, evs)) == 0 and len(h.problems()) == 3
        assert h.query("") and h.find("r-1").name == "one"
    finally:
        h.close()


def test_a_write_whose_waiter_gave_up_is_committed_and_the_writer_goes_on(tmp_path: Path) -> None:
    """A sync that timed out cancels its future (asyncio.wrap_future); the writer thread used to die on set_result and
    every later write of the history waited forever (found by make test-under-load in test_faults' history sync)."""
    import threading

    from gpudeck.agents.wire.protocol import Event
    from gpudeck.console.history.replica import History

    h = History(tmp_path / "history.db")
    try:
        c = h.cursor("gpu1", "ep1")
        gate = threading.Event()
        real_commit = h._commit

        def held_commit(*args):  # type: ignore[no-untyped-def]
            gate.wait(30)  # the writer holds this batch until the waiter has given up
            return real_commit(*args)

        h._commit = held_commit  # type: ignore[method-assign]
        first = h.submit(c.host, c.epoch, [Event(seq=1, ts=1.0, kind="run_created", run_id="r-1", data={"state": "starting", "name": "a"})])
        assert first.cancel(), "the waiter gives up while the batch is still queued or held"
        gate.set()
        later = h.submit(c.host, c.epoch, [Event(seq=2, ts=2.0, kind="run_state", run_id="r-1", data={"state": "running"})])
        assert later.result(timeout=30) == 1, "the writer is still alive"
        assert h.find("r-1").state == "running"  # the given-up batch went in too
        assert h._writer is not None and h._writer.is_alive()
    finally:
        h.close()


def test_a_pending_stop_goes_when_the_history_records_the_run_ended_with_nothing_left(hist: History) -> None:
    """A stop asked for while a host was cut off waits in the history; once the host's journal says the run ended
    (by that stop, delivered by a `gpudeck` call that exited before marking it done, or by itself) it is moot, unless
    the run left processes behind, which the stop would still reclaim."""
    hist.cursor("nodeb", "e1", "0.1.0", "nodeb")
    hist.add_pending_stop("nodeb", "r-aaaa1111", 30.0)
    hist.add_pending_stop("nodeb", "r-bbbb2222", 30.0)
    evs = [*_events("r-aaaa1111"), *_events("r-bbbb2222", start_seq=7)]
    evs[-1].data["lingering"] = [4242]  # r-bbbb2222 ended with a process left behind
    hist.submit("nodeb", "e1", evs).result(10)
    assert hist.pending_stops("nodeb") == [("r-bbbb2222", 30.0)]


def test_a_batch_folded_whole_leaves_the_same_history_as_event_by_event(tmp_path: Path) -> None:
    """issue 33: a host's batch goes in under one savepoint with its runs' telemetry folded in memory and each runs row
    written once; a batch with a refused event goes in event by event. Both leave the same runs rows, metrics and
    events (the second batch differs only by the refused event, kept in the quarantine)."""
    import asyncio
    import json

    from gpudeck.agents.wire.protocol import Event

    def journal() -> list[Event]:
        evs = _events("r-1", "one")[:-1]  # created, running, members, manifest, step 10
        for i in range(40):
            step = {
                "type": "step",
                "step": 20 + i,
                "loss": 3.0 - i / 100,
                "tokens_per_s": 7e4 + i,
                "mfu": 0.5,
                "mem_peak_gib": 30.0 + (i % 7),
            }
            evs.append(Event(seq=0, ts=T0 + 10 + i, kind="telemetry", run_id="r-1", data={"record": step, "offset": 30 + i}))
            if i == 15:
                evs.append(Event(seq=0, ts=T0 + 10 + i, kind="alert", run_id="r-1", data={"alert": {"kind": "idle_gpu", "ts": T0 + 25}}))
                evs.append(
                    Event(seq=0, ts=T0 + 10 + i, kind="telemetry", run_id="r-1", data={"record": {"type": "checkpoint", "step": 35}})
                )
            if i == 30:
                evs.append(
                    Event(seq=0, ts=T0 + 40, kind="telemetry", run_id="r-2", data={"record": {"type": "step", "step": 1}})
                )  # no such run
        evs.append(Event(seq=0, ts=T0 + 60, kind="telemetry", run_id="r-1", data={"record": {"type": "done", "final_step": 59}}))
        evs.append(Event(seq=0, ts=T0 + 61, kind="run_state", run_id="r-1", data={"state": "succeeded", "exit_code": 0}))
        evs.append(Event(seq=0, ts=T0 + 62, kind="note", run_id=None, data={"text": "caf\u00e9 \x1b[31m", "n": 2**62, "f": 1e16}))
        for i, e in enumerate(evs):
            e.seq = i + 1
        return evs

    def state(h: History) -> tuple:
        run = h.find("r-1")
        rows = [(e.seq, e.kind, e.data) for e in h.events("h", "r-1")]
        return run, h.metrics("h", "r-1"), rows

    whole, each = History(tmp_path / "whole.db"), History(tmp_path / "each.db")
    try:
        evs = journal()
        assert asyncio.run(whole.ingest("h", "ep", evs)) == len(evs)
        assert whole.problems() == []
        bad = Event(seq=len(evs) + 1, ts=T0 + 70, kind="telemetry", run_id="r-1", data={"record": {"type": "step", "step": 2**64}})
        assert asyncio.run(each.ingest("h", "ep", [*evs, bad])) == len(evs)
        assert [p.seq for p in each.problems()] == [bad.seq]  # the batch went in event by event
        assert state(whole) == state(each)
        run = whole.find("r-1")
        assert run.last_step == 59 and run.final_step == 59 and run.last_checkpoint == 35 and run.mem_peak_gib == 36.8
        assert run.state == "succeeded" and run.alert_count == 1 and len(whole.metrics("h", "r-1")) == 41
        assert whole.seqs("h", "ep") == list(range(1, len(evs) + 1))
        # every stored row is ASCII, and reads back as it was sent
        db = sqlite3.connect(tmp_path / "whole.db")
        try:
            texts = [t for (t,) in db.execute("SELECT data FROM events ORDER BY seq")]
        finally:
            db.close()
        assert all(t.isascii() for t in texts)
        assert [json.loads(t) for t in texts] == [e.data for e in evs]
        # again: nothing new, nothing changed
        assert asyncio.run(whole.ingest("h", "ep", evs)) == 0 and state(whole) == state(each)
    finally:
        whole.close()
        each.close()


def test_cursors_asked_from_many_threads_at_once_go_through_one_writer(tmp_path: Path) -> None:
    """A fleet's hosts ask for their cursors from several threads at once (asyncio.to_thread); they are written by the
    history's one writer thread (issue 33: none waits on another's SQLite lock), and after close() a caller is told
    at once instead of waiting forever behind the writer's end."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from gpudeck.console.history.replica import HistoryError

    def writers() -> int:
        return sum(t.name == "history-writer" for t in threading.enumerate())

    before = writers()
    h = History(tmp_path / "history.db")
    try:
        with ThreadPoolExecutor(16) as pool:
            cursors = list(pool.map(lambda i: h.cursor(f"h{i:02d}", "ep", "0.1.0", f"node{i}"), range(64)))
        assert [c.host for c in cursors] == [f"h{i:02d}" for i in range(64)]
        assert all(c.new_epoch and c.last_seq == 0 for c in cursors)
        assert writers() == before + 1
        assert len(h.hosts()) == 64 and h.cursor("h07", "ep").new_epoch is False
        h.note_host("h07", "unreachable", "no answer")
        assert next(x for x in h.hosts() if x.name == "h07").state == "unreachable"
    finally:
        h.close()
    with pytest.raises(HistoryError):
        h.cursor("h07", "ep")
    with pytest.raises(HistoryError):
        h.note_host("h07", "up")


def test_a_write_the_writer_cannot_get_to_is_a_typed_error_and_not_written_later(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Another process holds history.db's write lock (a real SQLite lock, past the limit): a host's link-state note
    waits for it on the writer thread, and a pending stop queued behind it gives up at the limit with a HistoryError
    that says it was not written, and is not written once the lock goes (what the caller was told stays true)."""
    from gpudeck.console.history import replica
    from gpudeck.console.history.replica import HistoryError

    monkeypatch.setattr(replica, "JOB_TIMEOUT_S", 1.0)
    h = History(tmp_path / "history.db")
    try:
        h.note_host("hosta", "up")  # the writer runs, the file is made
        other = sqlite3.connect(str(tmp_path / "history.db"), isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")  # the write lock, held longer than the limit
        try:
            with pytest.raises(HistoryError) as first:
                h.note_host("hosta", "unreachable", "lost")  # the writer takes it and waits on the lock (busy timeout)
            assert "did not get to this within 1 s" in str(first.value)
            with pytest.raises(HistoryError) as second:
                h.add_pending_stop("hostb", "r-0000beef", 5.0)  # queued behind it: never started
            assert "did not get to this within 1 s (it was not written)" in str(second.value)
            assert str(tmp_path / "history.db") in str(second.value)
        finally:
            other.execute("ROLLBACK")
            other.close()
        h.note_host("hosta", "up")  # the writer goes on once the lock is gone
        assert h.pending_stops("hostb") == []
    finally:
        h.close()
