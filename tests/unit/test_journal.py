"""Journal tests with real SQLite files: gapless seq under concurrency, durability across kill -9."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire import events
from gpudeck.agents.wire.errors import StorageError
from gpudeck.agents.wire.events import BadEvent
from gpudeck.agents.wire.protocol import LaunchSpec, RunInfo

ROOT = Path(__file__).resolve().parents[2]


def test_concurrent_appends_have_no_gaps(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db", "h")
    n_threads, per = 8, 60

    def writer(k: int) -> None:
        for i in range(per):
            if i % 10 == 0:
                j.append_many([("telemetry", f"r-{k}", {"record": {"w": k, "i": i, "n": n}, "offset": i}) for n in range(3)])
            else:
                j.append("telemetry", f"r-{k}", {"record": {"w": k, "i": i}, "offset": i})

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = j.events_after(0, limit=100000)
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(seqs) == n_threads * (per + 2 * (per // 10))
    assert j.last_seq == seqs[-1]
    # a reader asking after any seq gets exactly the rest
    assert [e.seq for e in j.events_after(100, limit=5)] == [101, 102, 103, 104, 105]


def test_epoch_is_stable_and_new_for_a_new_file(tmp_path: Path) -> None:
    a = Journal(tmp_path / "a.db", "h")
    epoch = a.epoch
    a.close()
    assert Journal(tmp_path / "a.db", "h").epoch == epoch
    assert Journal(tmp_path / "b.db", "h").epoch != epoch


WRITER = r"""
import sys
from pathlib import Path
from gpudeck.agents.storage.journal import Journal
j = Journal(Path(sys.argv[1]), "h")
i = 0
while True:
    ev = j.append_durable("telemetry", "r-1", {"record": {"i": i}, "offset": i})
    # acknowledged only after the commit returned
    sys.stdout.write(f"{ev.seq}\n"); sys.stdout.flush()
    i += 1
"""


def test_kill9_of_the_writer_loses_no_acknowledged_event(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    acked: list[int] = []
    assert p.stdout is not None
    for line in p.stdout:
        acked.append(int(line))
        if len(acked) >= 300:
            break
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    j = Journal(db, "h")
    assert j.integrity_check() == "ok"
    seqs = [e.seq for e in j.events_after(0, limit=1_000_000)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert set(acked) <= set(seqs)
    # and the journal goes on from where it was
    assert j.append("agent_started", None, {"pid": 1}).seq == seqs[-1] + 1


# ---------------------------------------------------------------------- the writer thread


class _Locker:
    """Another connection that holds the journal's SQLite write lock (a slow disk, as the agent sees it)."""

    def __init__(self, db: Path) -> None:
        self.conn = sqlite3.connect(str(db), isolation_level=None, timeout=10)
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        self.conn.execute("COMMIT")
        self.conn.close()


def _spec() -> LaunchSpec:
    return LaunchSpec(argv=["sleep", "1"])


def test_writes_return_at_once_while_the_disk_is_held_and_commit_in_order_after(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db", "h")
    j.create_run(RunInfo(id="r-1", host="h", state="starting", spec=_spec(), created=time.time()))
    committed = j.committed_seq
    locker = _Locker(tmp_path / "j.db")
    try:
        evs = [j.append("telemetry", "r-1", {"record": {"i": i}, "offset": i}) for i in range(5)]
        ev = j.update_run("r-1", "run_state", {"state": "running", "pid": 7}, state="running", started=1.0)
        assert ev is not None and [e.seq for e in evs] + [ev.seq] == list(range(committed + 1, committed + 7))
        assert j.committed_seq == committed and j.last_seq == committed + 6, "nothing can be on disk while another holds the lock"
        assert j.events_after(committed, wait=False) == [], "a queued event must not be readable (nor sent) before its commit"
        # reads see what is queued
        run = j.get_run("r-1")
        assert run is not None and run.state == "running" and run.started == 1.0
        assert [r.id for r in j.list_runs(states=frozenset({"running"}))] == ["r-1"]
        assert j.list_runs(states=frozenset({"starting"})) == []
        last = j.last_event("r-1", "telemetry")
        assert last is not None and last.data["offset"] == 4
    finally:
        locker.release()
    j.flush()
    assert j.committed_seq == committed + 6 and j.storage_error is None
    got = j.events_after(committed)
    assert [e.seq for e in got] == list(range(committed + 1, committed + 7)) and got[-1].kind == "run_state"
    j.close()
    # and on disk, read by a fresh journal
    j2 = Journal(tmp_path / "j.db", "h")
    run = j2.get_run("r-1")
    assert run is not None and run.state == "running"
    j2.close()


async def test_durable_create_waits_for_the_disk_without_blocking_the_loop(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db", "h")
    locker = _Locker(tmp_path / "j.db")
    ticks = 0

    async def beat() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    hb = asyncio.ensure_future(beat())
    try:
        task = asyncio.ensure_future(j.durable_create_run(RunInfo(id="r-2", host="h", state="starting", spec=_spec(), created=time.time())))
        await asyncio.sleep(0.3)
        assert not task.done(), "acknowledged before it was on disk"
        assert ticks >= 5, "the event loop stalled while the write waited"
        locker.release()
        ev = await asyncio.wait_for(task, 30)
        assert ev.kind == "run_created" and j.committed_seq >= ev.seq
    finally:
        hb.cancel()
        j.close()


def test_commits_wake_the_listener_and_batches_fold_queued_writes(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db", "h")
    seen: list[int] = []
    j.on_commit = seen.append
    locker = _Locker(tmp_path / "j.db")
    for i in range(200):
        j.append("telemetry", "r", {"record": {"i": i}, "offset": i})
    before = j.batches_committed
    locker.release()
    j.flush()
    assert j.batches_committed - before <= 3, f"200 queued events took {j.batches_committed - before} commits"
    assert seen and seen[-1] == j.last_seq
    j.close()


def test_a_payload_that_does_not_fit_its_kind_is_refused_naming_the_field(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db", "h")
    with pytest.raises(BadEvent, match=r"added\[0\]\.pid"):
        j.append("members", "r", {"added": [{"pid": "seven"}]})
    with pytest.raises(BadEvent, match="unknown journal event kind 'nonsense'.*agents/wire/events.py"):
        j.append("nonsense", None, {})
    with pytest.raises(BadEvent, match="state"):
        j.update_run("r", "run_state", {"cause": "no state"})
    assert j.last_seq == 0, "a refused payload used a seq"
    j.close()


def test_another_process_writing_the_same_file_leaves_no_gap(tmp_path: Path) -> None:
    a = Journal(tmp_path / "j.db", "h")
    b = Journal(tmp_path / "j.db", "h")
    for i in range(20):
        a.append("telemetry", "a", {"record": {"i": i}, "offset": i})
        b.append("telemetry", "b", {"record": {"i": i}, "offset": i})
    a.flush()
    b.flush()
    seqs = [e.seq for e in a.events_after(0)]
    assert seqs == list(range(1, 41))
    a.close()
    b.close()


# ---------------------------------------------------------------------- a journal written before typed payloads

OLD_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (id TEXT PRIMARY KEY, request_id TEXT UNIQUE, host TEXT NOT NULL, name TEXT, state TEXT NOT NULL, cause TEXT,
    exit_code INTEGER, signal TEXT, created REAL NOT NULL, started REAL, ended REAL, spec TEXT NOT NULL, run_dir TEXT,
    members TEXT NOT NULL DEFAULT '[]');
CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, kind TEXT NOT NULL, run_id TEXT, data TEXT NOT NULL);
"""
# every kind the agent wrote before agents/wire/events.py, in the shape it wrote them (json.dumps of the supervisor's dicts)
OLD_EVENTS = [
    ("agent_started", None, {"pid": 11, "version": "0.1.0", "gpu_error": "no NVML", "adopted": ["r-old: re-adopted"]}),
    ("run_created", "r-old", {"state": "starting", "spec": {"argv": ["python", "train.py"], "kind": "fsdp", "name": "old"}, "name": "old"}),
    ("preflight", "r-old", {"result": {"ok": True, "host": "h", "checks": [{"name": "gpus_exist", "ok": True, "message": ""}]}}),
    ("env_fingerprint", "r-old", {"env": {"python": "/usr/bin/python3", "taken": 1.0}}),
    ("run_state", "r-old", {"state": "running", "pid": 12, "started": 2.0}),
    ("members", "r-old", {"added": [{"pid": 13, "rank": 0, "local_rank": 0, "cmdline": ["python", "train.py"]}]}),
    ("members", "r-old", {"added": [], "updated": [{"pid": 13, "rank": 0, "local_rank": 0, "cmdline": ["python"]}]}),
    ("telemetry", "r-old", {"record": {"type": "step", "step": 1, "loss": 2.5, "tokens_per_s": 1000.0}, "offset": 80}),
    ("alert", "r-old", {"alert": {"kind": "gpu_idle", "message": "GPU 0 idle", "ts": 3.0}}),
    ("alert_cleared", "r-old", {"alert": {"kind": "gpu_idle", "message": "GPU 0 idle", "ts": 3.0, "cleared": 4.0}}),
    ("claims", "r-old", {"rows": [{"what": "GPUs", "claimed": 1, "observed": 1, "ok": True}]}),
    ("run_adopted", "r-old", {"state": "stopping", "resume_stop": True}),
    ("run_state", "r-old", {"state": "stopping", "grace_s": 10.0}),
    (
        "run_state",
        "r-old",
        {
            "state": "stopped",
            "cause": "stopped by operator",
            "ended": 5.0,
            "cause_class": "operator",
            "stop": {"run_id": "r-old", "state": "stopped", "stopped": [{"pid": 13, "how": "SIGTERM"}], "seconds": 0.5},
        },
    ),
    ("reclaimed", "r-old", {"pids": [14], "run_id": None, "state": "reclaimed", "survivors": [], "freed_bytes": 0}),
    ("env_rebuilt", None, {"path": "/envs/x", "from": "/usr/bin/python3", "freeze_hash": "ab", "python": "/envs/x/bin/python"}),
]


def test_a_journal_written_before_typed_payloads_keeps_reading_and_decodes(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    c = sqlite3.connect(db)
    c.executescript(OLD_SCHEMA)
    c.execute("INSERT INTO meta VALUES ('epoch', 'old-epoch')")
    c.execute(
        "INSERT INTO runs(id, host, name, state, created, spec, members) VALUES ('r-old', 'h', 'old', 'stopped', 1.0, ?, '[]')",
        (json.dumps({"argv": ["python", "train.py"], "kind": "fsdp"}),),
    )
    for i, (kind, rid, data) in enumerate(OLD_EVENTS):
        c.execute("INSERT INTO events(ts, kind, run_id, data) VALUES (?, ?, ?, ?)", (float(i), kind, rid, json.dumps(data, default=str)))
    c.commit()
    c.close()
    j = Journal(db, "h")
    assert j.epoch == "old-epoch"
    run = j.get_run("r-old")
    assert run is not None and run.state == "stopped" and run.alerts == [] and run.preflight is None
    evs = j.events_after(0)
    assert [(e.kind, e.run_id, e.data) for e in evs] == OLD_EVENTS, "old events must read back exactly as written"
    typed = [events.decode(e.kind, e.data) for e in evs]
    assert all(p.v == 1 for p in typed)
    assert isinstance(typed[13], events.RunState) and typed[13].stop is not None and typed[13].stop.stopped[0].how == "SIGTERM"
    assert isinstance(typed[15], events.EnvRebuilt) and typed[15].from_ == "/usr/bin/python3"
    # JSON text straight from the table decodes the same, within the size limit
    raw = sqlite3.connect(db).execute("SELECT kind, data FROM events ORDER BY seq").fetchall()
    assert [events.decode(k, d) for k, d in raw] == typed
    # and the journal goes on: new events validate and follow with no gap
    assert j.append("run_state", "r-old", {"state": "stopped"}).seq == len(OLD_EVENTS) + 1
    j.close()


def test_decode_bounds_and_unknown_kinds() -> None:
    assert events.decode("from_a_newer_agent", {"x": 1}) == events.Unknown(kind="from_a_newer_agent", data={"x": 1})
    with pytest.raises(BadEvent, match="limit"):
        events.decode("telemetry", b"{" + b" " * events.MAX_PAYLOAD_BYTES + b"}")
    with pytest.raises(BadEvent, match="not a JSON object"):
        events.decode("telemetry", b"[1,2")
    with pytest.raises(BadEvent, match="version 2"):
        events.decode("telemetry", {"record": {}, "v": 2})
    assert events.to_data(events.validate("telemetry", {"record": {"a": 1}, "offset": 3})) == {"record": {"a": 1}, "offset": 3}


def test_a_full_disk_fails_a_durable_create_at_once_and_queued_events_wait_for_space(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    fs = tmp_path / "fs"
    fs.mkdir()
    cp = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(fs)], capture_output=True, text=True)
    if cp.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {cp.stderr.strip()}")
    try:
        j = Journal(fs / "j.db", "h")
        j.append_durable("agent_started", None, {"pid": 1})
        filler = fs / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        queued = [j.append("telemetry", "r-f", {"record": {"i": i, "pad": "x" * 2000}, "offset": i}) for i in range(50)]
        with pytest.raises(StorageError, match="free space"):
            j.create_run(RunInfo(id="r-full", host="h", state="starting", spec=_spec(), created=time.time()))
        assert j.get_run("r-full") is None, "a run whose record failed is still shown"
        assert j.storage_error is not None and "free space" in j.storage_error
        filler.unlink()
        j.flush()
        assert j.storage_error is None
        got = j.events_after(0)
        assert [e.seq for e in got] == list(range(1, len(got) + 1)), "a gap where the failed write was"
        kinds = [e.kind for e in got]
        assert kinds.count("telemetry") == 50 and kinds.count("void") == 1 and "run_created" not in kinds
        assert [e.data["offset"] for e in got if e.kind == "telemetry"] == [e.data["offset"] for e in queued]
        assert j.get_run("r-full") is None
        j.close()
    finally:
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


async def test_a_waiter_that_gives_up_does_not_break_the_writer(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db", "h")
    locker = _Locker(tmp_path / "j.db")
    j.append("agent_started", None, {"pid": 1})
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await j.wait_durable()  # cancelled while the write waits for the disk
    task = asyncio.ensure_future(j.durable_append_many([("agent_started", None, {"pid": 2})]))
    await asyncio.sleep(0.1)
    task.cancel()
    locker.release()
    j.flush()
    assert [e.data["pid"] for e in j.events_after(0)] == [1, 2]
    j.append("agent_started", None, {"pid": 3})
    j.flush()
    assert j.committed_seq == 3, "the writer stopped after a waiter gave up"
    j.close()


def test_the_journal_is_private_whatever_the_umask_and_readers_elsewhere_see_its_commits(tmp_path: Path) -> None:
    """0600 with umask 0; and making it so must not drop SQLite's locks (another process reads every commit)."""
    import os
    import sqlite3
    import stat

    old = os.umask(0)
    try:
        j = Journal(tmp_path / "journal.db", "h")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "journal.db").st_mode) == 0o600
        j.append_durable("agent_started", None, {"pid": 1})
        db = sqlite3.connect(tmp_path / "journal.db")
        try:
            assert db.execute("SELECT COUNT(*) FROM events WHERE kind='agent_started'").fetchone()[0] == 1
        finally:
            db.close()
    finally:
        j.close()


def test_an_idle_journal_is_read_again_only_when_someone_writes_it(tmp_path: Path) -> None:
    # the agent's tick calls check() every 0.5 s: two lstat calls while nothing changes; a full probe (a read through a
    # fresh connection) only once the file was written by someone, and that write is then found and mended
    db = tmp_path / "j.db"
    j = Journal(db, "h")
    try:
        j.append_durable("telemetry", "r", {"record": {"i": 0}, "offset": 0})
        assert j.check() is None
        deadline = time.monotonic() + 30
        while (j._probed_sig is None or j._changed()) and time.monotonic() < deadline:  # the writer's probe after our commit
            j.check()
            time.sleep(0.01)
        probes = j.full_probes
        for _ in range(20):
            assert j.check() is None
        time.sleep(0.2)
        assert j.full_probes == probes, "an unchanged journal was read again"
        # our own commit is no reason to read the file again either
        j.append_durable("telemetry", "r", {"record": {"i": 1}, "offset": 1})
        assert j.check() is None and j.full_probes == probes
        epoch = j.epoch
        with open(db, "r+b") as fh:  # the same inode, its bytes garbage (the WAL gone): only a read tells
            fh.write(b"\xde\xad\xbe\xef" * 4096)
        for suffix in ("-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        assert j._changed()
        j.check()  # wakes the writer: the file changed
        while j.epoch == epoch and time.monotonic() < deadline:
            time.sleep(0.01)
        assert j.epoch != epoch and j.full_probes > probes, "a journal overwritten in place was not noticed"
    finally:
        j.close()
