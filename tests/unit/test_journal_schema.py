"""The journal's schema version (``PRAGMA user_version``) and its migrations: a journal written before versions began
(tests/reference/journal/journal-unversioned.db, made by commit 68f3ea7) opens and reads every event; a newer file is
refused naming both versions; a migration that fails leaves the file as it was."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from gpudeck.agents.storage import journal as journal_mod
from gpudeck.agents.storage.journal import SCHEMA_VERSION, Journal, NewerSchema
from gpudeck.agents.wire import events

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "journal" / "journal-unversioned.db"


def _user_version(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "journal.db"
    shutil.copyfile(REFERENCE, dst)
    dst.chmod(0o600)
    return dst


def test_a_journal_written_before_versions_opens_and_reads_every_event(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    assert _user_version(path) == 0
    conn = sqlite3.connect(path)
    epoch = conn.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()[0]
    conn.close()
    j = Journal(path, "ref-host")
    try:
        assert j.epoch == epoch  # the same journal, not a new one
        assert not j.recreated
        got = j.events_after(0)
        assert [(e.seq, e.kind, e.run_id) for e in got] == [
            (1, "agent_started", None),
            (2, "run_created", "r-ended"),
            (3, "run_state", "r-ended"),
            (4, "run_state", "r-ended"),
            (5, "run_created", "r-live"),
            (6, "run_state", "r-live"),
            (7, "telemetry", "r-live"),
        ]
        for e in got:
            assert not isinstance(events.decode(e.kind, e.data), events.Unknown), e.kind  # every payload still typed
        ended = j.get_run("r-ended")
        assert ended is not None and ended.state == "succeeded" and ended.exit_code == 0 and ended.spec.env == {"K": "v"}
        live = j.get_run("r-live")
        assert live is not None and [m.rank for m in live.members] == [0, 1] and live.alerts == []
        j.append("agent_started", None, {"pid": 1, "version": "x", "gpu_error": None, "adopted": []})
        assert j.events_after(7)[0].seq == 8  # the seq goes on from the old file's
    finally:
        j.close()
    assert _user_version(path) == SCHEMA_VERSION


def test_a_new_journal_carries_the_current_version(tmp_path: Path) -> None:
    Journal(tmp_path / "j.db", "h").close()
    assert _user_version(tmp_path / "j.db") == SCHEMA_VERSION >= 1


def test_a_journal_of_a_newer_agent_is_refused_naming_both_versions(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(NewerSchema) as caught:
        Journal(path, "h")
    assert f"schema version {SCHEMA_VERSION + 1}" in caught.value.message and f"({SCHEMA_VERSION})" in caught.value.message
    assert caught.value.code == "storage"
    assert _user_version(path) == SCHEMA_VERSION + 1  # untouched


def test_migrations_apply_in_order_in_one_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _copy(tmp_path)
    order: list[str] = []

    def to_v2(conn: sqlite3.Connection) -> None:
        order.append("v2")
        conn.execute("ALTER TABLE runs ADD COLUMN note TEXT")

    def to_v3_fails(conn: sqlite3.Connection) -> None:
        order.append("v3")
        conn.execute("CREATE TABLE half_done (x)")
        raise sqlite3.OperationalError("disk I/O error")

    def v1(conn: sqlite3.Connection) -> None:
        order.append("v1")
        journal_mod._to_v1(conn)

    monkeypatch.setattr(journal_mod, "MIGRATIONS", (v1, to_v2, to_v3_fails))
    monkeypatch.setattr(journal_mod, "SCHEMA_VERSION", 3)
    with pytest.raises(Exception):
        Journal(path, "h")
    assert order == ["v1", "v2", "v3"]
    conn = sqlite3.connect(path)
    cols = {r[1] for r in conn.execute("PRAGMA table_info(runs)")}
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert "note" not in cols and "half_done" not in tables and _user_version(path) == 0  # none of it, not a part

    order.clear()
    monkeypatch.setattr(journal_mod, "MIGRATIONS", (v1, to_v2))
    monkeypatch.setattr(journal_mod, "SCHEMA_VERSION", 2)
    Journal(path, "h").close()
    assert order == ["v1", "v2"] and _user_version(path) == 2
    order.clear()
    Journal(path, "h").close()
    assert order == []  # at its version: nothing runs again
