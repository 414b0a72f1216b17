"""The journal file itself as hostile input: deleted, replaced or corrupted under a running agent, or corrupt when it
starts. Real agent processes, real journal files, real runs: the agent notices (the (st_dev, st_ino) it opened against
the path's), moves aside what is not its journal (``journal.db.corrupt-<UTC time>``, 0600), starts a new epoch,
re-records every live run (from its memory, or found again through containment at start), acknowledges a launch only
once its record is in the file the path names, and says what happened in ``agent status``, snapshots and the history.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import stat
import sys
import time
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import GetSnapshot, Launch, LaunchSpec
from tests.agent_harness import AgentProc, run_state, wait_for

pytestmark = pytest.mark.slow
PY = sys.executable
SLEEPER = [PY, "-c", "import time\nwhile True: time.sleep(0.2)"]


def _file_runs(db: Path) -> dict[str, str]:
    """Run id -> state, read straight from the file the path names now (a fresh connection)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return dict(conn.execute("SELECT id, state FROM runs").fetchall())
    finally:
        conn.close()


def _file_events(db: Path, kind: str) -> list[dict]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return [json.loads(r[0]) for r in conn.execute("SELECT data FROM events WHERE kind=? ORDER BY seq", (kind,))]
    finally:
        conn.close()


def _status(a: AgentProc) -> dict:
    return json.loads(a.cli("agent", "status", "--json").stdout)


def _runs(a: AgentProc) -> dict[str, dict]:
    return {r["id"]: r for r in a.cli_json("runs")}


def _no_traceback(a: AgentProc) -> None:
    log = (a.state_dir / "agent.log").read_text()
    assert "Traceback" not in log, log[-3000:]


async def _launch(a: AgentProc, name: str) -> tuple[str, float]:
    """Launch through the socket; (run id, seconds until the acknowledgement)."""
    c = await a.client()
    try:
        t0 = time.monotonic()
        reply = await c.request(Launch(spec=LaunchSpec(argv=SLEEPER, name=name)), timeout=60)
        return reply.run.id, time.monotonic() - t0  # type: ignore[union-attr]
    finally:
        await c.close()


def _stop_everything(a: AgentProc) -> None:
    try:
        for rid, r in _runs(a).items():
            if r["state"] in ("starting", "running", "stopping"):
                a.cli("stop", rid, "--grace", "1", check=False)
    finally:
        a.stop()
        a.stop_autostarted()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_journal_deleted_or_replaced_under_the_agent_is_recreated_and_no_live_run_or_launch_is_lost(gpudeck_home: Path, how: str) -> None:
    a = AgentProc(gpudeck_home).start()
    db = a.state_dir / "journal.db"
    try:
        first, _ = asyncio.run(_launch(a, "before"))
        wait_for(lambda: run_state(a, first) == "running", timeout=30, what="the first run to run")
        epoch0 = _status(a)["epoch"]
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(db) + suffix)
            if p.exists():
                p.unlink()
        if how == "replaced":
            db.write_bytes(b"not a journal at all\n" * 100)
        # a launch right after: acknowledged only once its record is in the file the path names
        second, ack_s = asyncio.run(_launch(a, "after"))
        in_file = _file_runs(db)
        print(f"\n{how}: launch acknowledged in {ack_s:.3f} s; the file at the path holds {sorted(in_file.items())}")
        assert in_file.get(second) in ("starting", "running"), in_file
        assert in_file.get(first) == "running", "the live run is re-recorded in the new journal"
        st = _status(a)
        print(f"agent status: {st['journal']}")
        assert st["epoch"] != epoch0 and how in st["journal"] and "re-recorded" in st["journal"]
        rec = _file_events(db, "journal_recreated")
        assert rec and rec[0]["reason"] == how and rec[0]["previous_epoch"] == epoch0 and first in rec[0]["runs"]
        if how == "replaced":
            aside = [
                p for p in a.state_dir.iterdir() if p.name.startswith("journal.db.replaced-") and not p.name.endswith(("-wal", "-shm"))
            ]
            assert len(aside) == 1 and aside[0].read_bytes().startswith(b"not a journal")
            assert stat.S_IMODE(aside[0].stat().st_mode) == 0o600
        runs = _runs(a)
        assert runs[first]["state"] == "running" and runs[second]["state"] == "running"
        # a snapshot carries the note too (the console's host view shows it)
        snap = asyncio.run(_snapshot(a))
        assert snap.journal_note and how in snap.journal_note and snap.epoch == st["epoch"]
        # a restarted agent finds both in the new journal and supervises them: stop works through it
        a.stop()
        a.start()
        runs = _runs(a)
        assert runs[first]["state"] == "running" and runs[second]["state"] == "running", runs
        for rid in (first, second):
            a.cli("stop", rid, "--grace", "1")
        runs = _runs(a)
        assert runs[first]["state"] == "stopped" and runs[second]["state"] == "stopped", runs
        # the history has both runs and the typed event of the new epoch
        hist = {r["id"]: r for r in a.cli_json("history")}
        assert first in hist and second in hist
        _no_traceback(a)
        assert "journal_recreated" in _history_kinds(gpudeck_home)
    finally:
        _stop_everything(a)


async def _snapshot(a: AgentProc):  # type: ignore[no-untyped-def]
    c = await a.client()
    try:
        return await c.request(GetSnapshot(), timeout=30)
    finally:
        await c.close()


def _history_kinds(home: Path) -> set[str]:
    conn = sqlite3.connect(home / "history.db", timeout=10)
    try:
        return {r[0] for r in conn.execute("SELECT DISTINCT kind FROM events")}
    finally:
        conn.close()


def _corrupt(db: Path, how: str) -> None:
    if how == "garbage":
        with open(db, "r+b") as fh:  # the header and the first pages overwritten in place
            fh.write(os.urandom(8192))
    elif how == "truncated":
        size = db.stat().st_size
        os.truncate(db, max(512, size // 3))
    elif how == "text":
        db.write_text("this is not SQLite: somebody's notes\n" * 50)
    else:  # pragma: no cover
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["garbage", "truncated", "text"])
def test_a_corrupt_journal_at_start_is_moved_aside_and_live_runs_are_found_again_by_their_containment(gpudeck_home: Path, how: str) -> None:
    a = AgentProc(gpudeck_home).start()
    db = a.state_dir / "journal.db"
    try:
        # enough history that a truncation cuts into real pages
        ended = a.cli_json("launch", "--name", "short", "--", PY, "-c", "print('x' * 100000)")["id"]
        wait_for(lambda: run_state(a, ended) == "succeeded", timeout=60, what="the short run to end")
        live = a.cli_json("launch", "--name", "survivor", "--", *SLEEPER)["id"]
        wait_for(lambda: run_state(a, live) == "running", timeout=30, what="the run to run")
        a.cli_json("history")  # the console holds the old epoch
        a.stop()  # runs outlive the agent; the journal is checkpointed into journal.db
        assert not Path(str(db) + "-wal").exists() or Path(str(db) + "-wal").stat().st_size == 0
        _corrupt(db, how)
        a.start()  # it starts: no traceback, no manual repair
        aside = sorted(
            p for p in a.state_dir.iterdir() if p.name.startswith("journal.db.corrupt-") and not p.name.endswith(("-wal", "-shm"))
        )
        assert len(aside) == 1, sorted(p.name for p in a.state_dir.iterdir())
        assert stat.S_IMODE(aside[0].stat().st_mode) == 0o600
        st = _status(a)
        print(f"\n{how}: agent status: {st['journal']}")
        assert "corrupt" in st["journal"] and aside[0].name in st["journal"]
        runs = _runs(a)
        assert runs[live]["state"] == "running", runs
        rec = _file_events(db, "journal_recreated")
        assert rec and rec[0]["reason"] == "corrupt" and rec[0]["runs"] == [live] and rec[0]["moved_to"] == str(aside[0])
        adopted = _file_events(db, "agent_started")[-1]["adopted"]
        assert any(live in n and "re-adopted" in n for n in adopted), adopted
        # re-adopted for real: its processes are known, and a stop ends them
        stop = json.loads(a.cli("stop", live, "--grace", "1", "--json").stdout)
        print(f"stop after re-adoption: {stop.get('result', stop).get('outcome', stop)}")
        assert _runs(a)[live]["state"] == "stopped"
        synced = a.cli("history", "--json")  # the first sync of the new epoch says what happened on stderr
        print(synced.stderr.strip())
        assert "journal was recreated (corrupt" in synced.stderr and aside[0].name in synced.stderr
        hist = {r["id"]: r for r in json.loads(synced.stdout)}
        assert live in hist and hist[live]["state"] == "stopped", hist.get(live)
        assert ended in hist, "the old epoch's runs stay in the history"
        assert "journal_recreated" in _history_kinds(gpudeck_home)
        human = a.cli("history").stdout + a.cli("history").stderr
        print(human.splitlines()[:3])
        _no_traceback(a)
    finally:
        _stop_everything(a)


def test_a_journal_overwritten_in_place_while_the_agent_runs_is_moved_aside_and_the_live_run_re_recorded(gpudeck_home: Path) -> None:
    a = AgentProc(gpudeck_home).start()
    db = a.state_dir / "journal.db"
    try:
        live = a.cli_json("launch", "--name", "survivor", "--", *SLEEPER)["id"]
        wait_for(lambda: run_state(a, live) == "running", timeout=30, what="the run to run")
        epoch0 = _status(a)["epoch"]
        # the same inode, its bytes garbage (and the WAL gone, so no reader can fall back on it)
        with open(db, "r+b") as fh:
            fh.write(b"\xde\xad\xbe\xef" * 4096)
        for suffix in ("-wal", "-shm"):
            p = Path(str(db) + suffix)
            if p.exists():
                p.unlink()
        st = wait_for(lambda: (s := _status(a)) and s["epoch"] != epoch0 and s, timeout=30, what="a new epoch")
        print(f"\nagent status: {st['journal']}")
        assert st["journal"] and ("corrupt" in st["journal"] or "deleted" in st["journal"] or "replaced" in st["journal"])
        assert _file_runs(db).get(live) == "running"
        second, _ = asyncio.run(_launch(a, "after"))
        assert _file_runs(db).get(second) in ("starting", "running")
        a.cli("stop", live, "--grace", "1")
        a.cli("stop", second, "--grace", "1")
        assert _runs(a)[live]["state"] == "stopped"
        _no_traceback(a)
    finally:
        _stop_everything(a)
