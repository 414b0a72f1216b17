"""Provides the history's index of the GPU ledger: each hold one row, each of its records one point, for ``ledger --at``.

The agents journal a ``gpu_hold`` event for every change in who holds a GPU
(agents/observe/ledger.py); the replica stores them in ``events`` like any other
and folds each newly inserted one here: ``ledger_holds`` (one row per hold: who,
which GPU, run and rank, attribution, start, end, peak) and ``ledger_points``
(the bytes at each record). ``--at T`` reads the holds whose start is at or
before T and whose end is not before it (index ``host, gpu, started``), then
each one's bytes at T (the points' primary key); ``--run`` reads one run's holds
(index ``host, run_id``). A record that does not read as a hold is refused by
:func:`fold` with ValueError (the replica quarantines it, the rest goes in).
"""

from __future__ import annotations

import sqlite3
from typing import Any

import msgspec

from gpudeck.agents.wire.protocol import Container

HOLDS = "ledger_holds"
POINTS = "ledger_points"
TABLES = (HOLDS, POINTS)
INDEXES = ("idx_ledger_holds_host_gpu_started", "idx_ledger_holds_host_run_id")

_CREATE = (
    f"""CREATE TABLE IF NOT EXISTS {HOLDS} (
    host TEXT NOT NULL, hold TEXT NOT NULL, epoch TEXT, gpu INTEGER NOT NULL, uuid TEXT, pid INTEGER, create_time REAL,
    user TEXT, container TEXT, run_id TEXT, rank INTEGER, attribution TEXT, started REAL NOT NULL, ended REAL,
    end_evidence TEXT, last_seen REAL, bytes INTEGER, peak INTEGER, updated REAL,
    PRIMARY KEY (host, hold))""",
    f"CREATE TABLE IF NOT EXISTS {POINTS} (host TEXT NOT NULL, hold TEXT NOT NULL, ts REAL NOT NULL, bytes INTEGER, "
    "PRIMARY KEY (host, hold, ts)) WITHOUT ROWID",
    f"CREATE INDEX IF NOT EXISTS idx_ledger_holds_host_gpu_started ON {HOLDS}(host, gpu, started)",
    f"CREATE INDEX IF NOT EXISTS idx_ledger_holds_host_run_id ON {HOLDS}(host, run_id)",
)


class HoldRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One hold as the history folded it, with the bytes it held at the time asked about (``at_bytes``)."""

    host: str
    hold: str
    gpu: int
    started: float
    uuid: str | None = None
    pid: int | None = None
    create_time: float | None = None
    user: str | None = None
    container: str | None = None  # its label (Container.label()): docker:trainer, lxc:200(trainer), k8s:ns/pod/ctr
    run_id: str | None = None
    rank: int | None = None
    attribution: str | None = None
    ended: float | None = None
    end_evidence: str | None = None
    last_seen: float | None = None
    bytes: int | None = None  # at its latest record
    peak: int | None = None
    at_bytes: int | None = None  # at the time asked about (--at), else unset


_COLS = (
    "host, hold, gpu, started, uuid, pid, create_time, user, container, run_id, rank, attribution, ended, end_evidence, "
    "last_seen, bytes, peak"
)
_NAMES = [c.strip() for c in _COLS.split(",")]


def create_tables(conn: sqlite3.Connection) -> None:
    """The tables and indexes (idempotent)."""
    for stmt in _CREATE:
        conn.execute(stmt)


def _int(d: dict[str, Any], k: str) -> int | None:
    v = d.get(k)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"gpu_hold: {k} is not an integer")
    return v


def _num(d: dict[str, Any], k: str) -> float | None:
    v = d.get(k)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"gpu_hold: {k} is not a number")
    return float(v)


def _container(d: dict[str, Any]) -> str | None:
    """The holder's container as one label (``docker:trainer``, ``k8s:ns/pod/ctr``), from the record's Container."""
    v = d.get("container")
    if v is None:
        return None
    try:
        return msgspec.convert(v, Container).label()[:256]
    except (msgspec.ValidationError, TypeError) as exc:
        raise ValueError(f"gpu_hold: container is not a container record ({exc})") from None


def _str(d: dict[str, Any], k: str) -> str | None:
    v = d.get(k)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValueError(f"gpu_hold: {k} is not text")
    return v[:256]


def fold(conn: sqlite3.Connection, host: str, epoch: str, ts: float, data: dict[str, Any]) -> None:
    """Fold one newly inserted ``gpu_hold`` record into its hold's row and points; ValueError for one that is not a hold."""
    hold, gpu, started = _str(data, "hold"), _int(data, "gpu"), _num(data, "started")
    change = _str(data, "change")
    if not hold or gpu is None or started is None or change not in ("start", "level", "attribution", "continued", "end"):
        raise ValueError("gpu_hold: a record without its hold, gpu, start or change")
    row = {
        "uuid": _str(data, "uuid"),
        "pid": _int(data, "pid"),
        "create_time": _num(data, "create_time"),
        "user": _str(data, "user"),
        "container": _container(data),
        "run_id": _str(data, "run"),
        "rank": _int(data, "rank"),
        "attribution": _str(data, "attribution"),
        "bytes": _int(data, "bytes"),
        "peak": _int(data, "peak"),
    }
    ended = ts if change == "end" else None
    conn.execute(
        f"""INSERT INTO {HOLDS} (host, hold, epoch, gpu, uuid, pid, create_time, user, container, run_id, rank, attribution,
        started, ended, end_evidence, last_seen, bytes, peak, updated) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)
        ON CONFLICT(host, hold) DO UPDATE SET
          uuid=COALESCE(excluded.uuid, uuid), pid=COALESCE(excluded.pid, pid), user=COALESCE(excluded.user, user),
          container=COALESCE(excluded.container, container), run_id=COALESCE(excluded.run_id, run_id),
          rank=COALESCE(excluded.rank, rank),
          attribution=CASE WHEN excluded.updated >= COALESCE(updated, 0) THEN excluded.attribution ELSE attribution END,
          bytes=CASE WHEN excluded.updated >= COALESCE(updated, 0) THEN excluded.bytes ELSE bytes END,
          peak=MAX(COALESCE(peak, 0), COALESCE(excluded.peak, 0)),
          started=MIN(started, excluded.started),
          ended=COALESCE(excluded.ended, ended), end_evidence=COALESCE(excluded.end_evidence, end_evidence),
          last_seen=COALESCE(excluded.last_seen, last_seen), updated=MAX(COALESCE(updated, 0), excluded.updated)""",
        (
            host,
            hold,
            epoch,
            gpu,
            row["uuid"],
            row["pid"],
            row["create_time"],
            row["user"],
            row["container"],
            row["run_id"],
            row["rank"],
            row["attribution"],
            started,
            ended,
            _str(data, "evidence") if change == "end" else None,
            _num(data, "last_seen"),
            row["bytes"],
            row["peak"] if row["peak"] is not None else row["bytes"],
            ts,
        ),
    )
    # the start's point is at the hold's start (the record may be a later one: compaction, or a restart's continued)
    conn.execute(
        f"INSERT OR REPLACE INTO {POINTS} (host, hold, ts, bytes) VALUES (?,?,?,?)",
        (host, hold, started if change == "start" else ts, 0 if change == "end" else row["bytes"]),
    )


def _records(rows: list[tuple]) -> list[HoldRecord]:
    return [HoldRecord(**{k: v for k, v in zip(_NAMES, r) if v is not None}) for r in rows]


def held_between(
    conn: sqlite3.Connection, host: str, gpu: int | None, since: float, until: float, run: str | None = None
) -> list[HoldRecord]:
    """The holds on ``host`` (one GPU, or all; one run's, or anyone's) open at some time in ``[since, until]``."""
    sql = f"SELECT {_COLS} FROM {HOLDS} WHERE host=? "
    params: list[Any] = [host]
    if gpu is not None:
        sql += "AND gpu=? "
        params.append(gpu)
    if run is not None:
        sql += "AND run_id=? "
        params.append(run)
    sql += "AND started <= ? AND (ended IS NULL OR ended >= ?) ORDER BY gpu, started"
    params += [until, since]
    return _records(conn.execute(sql, params).fetchall())


def held_at(conn: sqlite3.Connection, host: str, gpu: int | None, at: float, run: str | None = None) -> list[HoldRecord]:
    """The holds open at ``at``, each with the bytes it held then (its newest point at or before ``at``)."""
    out = held_between(conn, host, gpu, at, at, run)
    for h in out:
        row = conn.execute(
            f"SELECT bytes FROM {POINTS} WHERE host=? AND hold=? AND ts <= ? ORDER BY ts DESC LIMIT 1", (host, h.hold, at)
        ).fetchone()
        h.at_bytes = row[0] if row is not None else h.bytes
    return out


def run_holds(conn: sqlite3.Connection, host: str | None, run: str) -> list[HoldRecord]:
    """Every hold of one run (on one host, or on every host), oldest first."""
    if host is None:
        rows = conn.execute(f"SELECT {_COLS} FROM {HOLDS} WHERE run_id=? ORDER BY host, gpu, started", (run,)).fetchall()
    else:
        rows = conn.execute(f"SELECT {_COLS} FROM {HOLDS} WHERE host=? AND run_id=? ORDER BY gpu, started", (host, run)).fetchall()
    return _records(rows)
