"""Provides the agent's journal: runs and an event log in SQLite that survives ``kill -9``.

WAL with ``synchronous=FULL``: a commit is on disk before ``append`` returns, and
an event is committed before it is sent to anyone. Events are numbered by
``seq``, strictly increasing with no gaps, within an ``epoch`` (a UUID made with
the database), so a replica can pull "everything after (epoch, seq)" and never
duplicate or miss anything.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from agents.errors import StorageError
from agents.protocol import Alert, EnvFingerprint, Event, LaunchSpec, Member, PreflightResult, RunInfo

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    request_id TEXT UNIQUE,
    host TEXT NOT NULL,
    name TEXT,
    state TEXT NOT NULL,
    cause TEXT,
    exit_code INTEGER,
    signal TEXT,
    created REAL NOT NULL,
    started REAL,
    ended REAL,
    spec TEXT NOT NULL,
    run_dir TEXT,
    members TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS runs_state ON runs(state);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    run_id TEXT,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_run ON events(run_id, kind, seq);
"""

_RUN_FIELDS = ("state", "cause", "exit_code", "signal", "started", "ended", "members", "name", "preflight", "env", "alerts")
# columns added after the first release: (name, SQL type); added in place to older journals
_ADDED_COLUMNS = (("preflight", "TEXT"), ("env", "TEXT"), ("alerts", "TEXT NOT NULL DEFAULT '[]'"))
_STRUCT_FIELDS = {"members": list[Member], "preflight": PreflightResult | None, "env": EnvFingerprint | None, "alerts": list[Alert]}


def _storage_error(exc: sqlite3.Error, path: Path) -> StorageError:
    text = str(exc)
    if "full" in text or "disk I/O" in text:
        return StorageError(f"the agent's journal {path} cannot be written ({text}): free space in {path.parent} and retry; nothing was recorded")
    return StorageError(f"the agent's journal {path} failed: {text}")


class Journal:
    """The agent's durable record of runs and events; thread-safe."""

    def __init__(self, path: Path, host: str) -> None:
        self.path = Path(path)
        self.host = host
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=5.0)
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        try:
            self._conn.executescript(_SCHEMA)
            have = {r[1] for r in self._conn.execute("PRAGMA table_info(runs)")}
            for col, decl in _ADDED_COLUMNS:
                if col not in have:
                    self._conn.execute(f"ALTER TABLE runs ADD COLUMN {col} {decl}")
        except sqlite3.Error as exc:
            raise _storage_error(exc, self.path) from exc
        with self._tx() as c:
            row = c.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()
            if row is None:
                self.epoch = str(uuid.uuid4())
                c.execute("INSERT INTO meta(key, value) VALUES ('epoch', ?)", (self.epoch,))
                c.execute("INSERT INTO meta(key, value) VALUES ('created', ?)", (repr(time.time()),))
            else:
                self.epoch = row[0]
        self._last_seq = self._read_last_seq()

    # ------------------------------------------------------------------ plumbing

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                except BaseException:
                    self._conn.execute("ROLLBACK")
                    raise
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                try:
                    self._conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise _storage_error(exc, self.path) from exc

    def _read_last_seq(self) -> int:
        row = self._conn.execute("SELECT MAX(seq) FROM events").fetchone()
        return int(row[0] or 0)

    def _insert_event(self, c: sqlite3.Connection, kind: str, run_id: str | None, data: dict[str, Any], ts: float) -> Event:
        cur = c.execute(
            "INSERT INTO events(ts, kind, run_id, data) VALUES (?, ?, ?, ?)",
            (ts, kind, run_id, json.dumps(data, default=str)),
        )
        seq = int(cur.lastrowid)
        return Event(seq=seq, ts=ts, kind=kind, run_id=run_id, data=data)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._conn.close()

    @property
    def last_seq(self) -> int:
        """The newest committed seq."""
        return self._last_seq

    # ------------------------------------------------------------------ events

    def append(self, kind: str, run_id: str | None = None, data: dict[str, Any] | None = None) -> Event:
        """Commit one event and return it (with its seq)."""
        return self.append_many([(kind, run_id, data or {})])[0]

    def append_many(self, items: list[tuple[str, str | None, dict[str, Any]]]) -> list[Event]:
        """Commit several events in one transaction (one fsync)."""
        ts = time.time()
        with self._tx() as c:
            events = [self._insert_event(c, k, r, d, ts) for k, r, d in items]
        if events:
            self._last_seq = events[-1].seq
        return events

    def events_after(self, after_seq: int, limit: int = 10000) -> list[Event]:
        """Committed events with seq > after_seq, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT seq, ts, kind, run_id, data FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                (after_seq, limit),
            ).fetchall()
        return [Event(seq=r[0], ts=r[1], kind=r[2], run_id=r[3], data=json.loads(r[4])) for r in rows]

    def last_event(self, run_id: str, kind: str) -> Event | None:
        """The newest event of one kind for one run."""
        with self._lock:
            r = self._conn.execute(
                "SELECT seq, ts, kind, run_id, data FROM events WHERE run_id=? AND kind=? ORDER BY seq DESC LIMIT 1",
                (run_id, kind),
            ).fetchone()
        return Event(seq=r[0], ts=r[1], kind=r[2], run_id=r[3], data=json.loads(r[4])) if r else None

    # ------------------------------------------------------------------ runs

    def create_run(self, run: RunInfo) -> Event:
        """Record a new run and its ``run_created`` event in one transaction."""
        with self._tx() as c:
            c.execute(
                "INSERT INTO runs(id, request_id, host, name, state, cause, exit_code, signal, created, started, ended, spec, run_dir, members,"
                " preflight, env, alerts) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    run.id,
                    run.request_id or None,
                    run.host,
                    run.name,
                    run.state,
                    run.cause,
                    run.exit_code,
                    run.signal,
                    run.created,
                    run.started,
                    run.ended,
                    msgspec.json.encode(run.spec).decode(),
                    run.run_dir,
                    msgspec.json.encode(run.members).decode(),
                    None if run.preflight is None else msgspec.json.encode(run.preflight).decode(),
                    None if run.env is None else msgspec.json.encode(run.env).decode(),
                    msgspec.json.encode(run.alerts).decode(),
                ),
            )
            ev = self._insert_event(c, "run_created", run.id, {"state": run.state, "spec": msgspec.to_builtins(run.spec), "name": run.name}, run.created)
        self._last_seq = ev.seq
        return ev

    def update_run(self, run_id: str, event_kind: str | None = None, event_data: dict[str, Any] | None = None, **fields: Any) -> Event | None:
        """Change a run's fields and (optionally) record an event, atomically."""
        bad = set(fields) - set(_RUN_FIELDS)
        if bad:
            raise ValueError(f"unknown run fields {bad}")
        values = []
        for key in fields:
            value = fields[key]
            if key in _STRUCT_FIELDS:
                value = None if value is None else msgspec.json.encode(value).decode()
            values.append(value)
        ev = None
        with self._tx() as c:
            if fields:
                sets = ", ".join(f"{k}=?" for k in fields)
                c.execute(f"UPDATE runs SET {sets} WHERE id=?", (*values, run_id))
            if event_kind:
                ev = self._insert_event(c, event_kind, run_id, event_data or {}, time.time())
        if ev is not None:
            self._last_seq = ev.seq
        return ev

    def _row_to_run(self, r: tuple) -> RunInfo:
        return RunInfo(
            id=r[0],
            request_id=r[1],
            host=r[2],
            name=r[3],
            state=r[4],
            cause=r[5],
            exit_code=r[6],
            signal=r[7],
            created=r[8],
            started=r[9],
            ended=r[10],
            spec=msgspec.json.decode(r[11], type=LaunchSpec),
            run_dir=r[12],
            members=msgspec.json.decode(r[13], type=list[Member]),
            preflight=msgspec.json.decode(r[14], type=PreflightResult) if r[14] else None,
            env=msgspec.json.decode(r[15], type=EnvFingerprint) if r[15] else None,
            alerts=msgspec.json.decode(r[16], type=list[Alert]) if r[16] else [],
        )

    _COLS = "id, request_id, host, name, state, cause, exit_code, signal, created, started, ended, spec, run_dir, members, preflight, env, alerts"

    def get_run(self, run_id: str) -> RunInfo | None:
        """A run by exact id."""
        with self._lock:
            r = self._conn.execute(f"SELECT {self._COLS} FROM runs WHERE id=?", (run_id,)).fetchone()
        return self._row_to_run(r) if r else None

    def find_runs(self, prefix: str) -> list[RunInfo]:
        """Runs whose id starts with ``prefix`` or whose name equals it."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {self._COLS} FROM runs WHERE id LIKE ? ESCAPE '\\' OR name=? ORDER BY created DESC",
                (prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%", prefix),
            ).fetchall()
        return [self._row_to_run(r) for r in rows]

    def run_by_request(self, request_id: str) -> RunInfo | None:
        """The run a Launch with this request_id created, if any."""
        with self._lock:
            r = self._conn.execute(f"SELECT {self._COLS} FROM runs WHERE request_id=?", (request_id,)).fetchone()
        return self._row_to_run(r) if r else None

    def list_runs(self, limit: int = 1000, states: frozenset[str] | None = None) -> list[RunInfo]:
        """Runs, newest first, optionally only those in ``states``."""
        with self._lock:
            if states:
                marks = ",".join("?" * len(states))
                rows = self._conn.execute(
                    f"SELECT {self._COLS} FROM runs WHERE state IN ({marks}) ORDER BY created DESC LIMIT ?",
                    (*sorted(states), limit),
                ).fetchall()
            else:
                rows = self._conn.execute(f"SELECT {self._COLS} FROM runs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [self._row_to_run(r) for r in rows]

    def throughput_baseline(self, config_hash: str, world_size: int | None, exclude: str, min_points: int = 5) -> tuple[str, float] | None:
        """(run id, median tokens/s) of the newest other run with this config hash (and world size) that has enough steps."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT run_id, data FROM events WHERE kind='telemetry' AND run_id != ? AND json_extract(data, '$.record.type')='manifest'"
                " AND json_extract(data, '$.record.config_hash')=? ORDER BY seq DESC LIMIT 200",
                (exclude, config_hash),
            ).fetchall()
            seen: list[str] = []
            for rid, data in rows:
                if rid in seen:
                    continue
                rec = json.loads(data).get("record", {})
                if world_size is not None and rec.get("world_size") not in (None, world_size):
                    continue
                seen.append(rid)
                tps = [
                    r[0]
                    for r in self._conn.execute(
                        "SELECT json_extract(data, '$.record.tokens_per_s') FROM events WHERE run_id=? AND kind='telemetry'"
                        " AND json_extract(data, '$.record.type')='step'",
                        (rid,),
                    )
                    if isinstance(r[0], (int, float))
                ]
                if len(tps) >= min_points:
                    tps.sort()
                    mid = len(tps) // 2
                    return rid, float(tps[mid] if len(tps) % 2 else (tps[mid - 1] + tps[mid]) / 2)
                if len(seen) >= 10:
                    break
        return None

    def integrity_check(self) -> str:
        """SQLite's own verdict on the file ("ok" when sound)."""
        with self._lock:
            return self._conn.execute("PRAGMA integrity_check").fetchone()[0]
