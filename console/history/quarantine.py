"""Provides the history's quarantine: an event that cannot go into the history is kept raw, by itself, and counted.

An agent's journal is input from outside the console. Each event is checked
on its way into the history (:func:`check_event`): its seq a positive 64-bit
integer, its ts a finite number, kind and run id short strings, its data a
JSON object in which every integer fits SQLite's 64-bit INTEGER and every
string is valid Unicode. An event that fails, or that SQLite refuses while it
is folded into the runs table, is stored in the ``quarantine`` table with its
raw JSON and the reason, under its ``(host, epoch, seq)``; the rest of the
batch goes in, and the host's cursor moves past it, so one bad event never
blocks a host's history. ``gpudeck history --problems`` lists them.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from typing import Any

from gpudeck.agents.wire.protocol import Event
from gpudeck.console.core.records import Problem

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
MAX_DEPTH = 64
MAX_KIND = 64
MAX_RUN_ID = 256


class BadEvent(ValueError):
    """An event the history cannot hold; the message says which field and why."""


def create_table(conn: sqlite3.Connection) -> None:
    """The quarantine table (idempotent)."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS quarantine (host TEXT NOT NULL, epoch TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT, run_id TEXT,"
        " raw TEXT NOT NULL, error TEXT NOT NULL, quarantined REAL NOT NULL, PRIMARY KEY (host, epoch, seq))"
    )


def _plain(value: Any, depth: int) -> bool:
    """Whether ``value`` is certainly storable: JSON of exact dicts, lists, str, int, float, bool and None, strings
    ASCII or valid Unicode, integers in SQLite's range, floats finite, no deeper than MAX_DEPTH. False means "look
    closer" (:func:`_walk` then decides, and says where): anything unusual, a tuple or an int subclass say, is left
    to it. No path is built on the way: on telemetry, the bulk of what a history sync takes in, this is several times
    faster than the walk (bench/RESULTS.md 33-sync)."""
    if depth >= MAX_DEPTH:  # near the limit: the walk counts exactly
        return False
    t = type(value)
    if t is dict:
        items: Any = value.values()
        for k in value:
            if type(k) is not str or not (k.isascii() or _utf8(k)):
                return False
    elif t is list:
        items = value
    else:
        return False
    for x in items:
        tx = type(x)
        if tx is str:
            if not (x.isascii() or _utf8(x)):
                return False
        elif tx is float:
            if not math.isfinite(x):
                return False
        elif tx is int:
            if not INT_MIN <= x <= INT_MAX:
                return False
        elif tx is bool or x is None:
            continue
        elif not _plain(x, depth + 1):
            return False
    return True


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _walk(value: Any) -> None:
    stack: list[tuple[Any, str, int]] = [(value, "data", 1)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadEvent(f"{where}: nested deeper than {MAX_DEPTH}")
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int):
            if not INT_MIN <= v <= INT_MAX:
                raise BadEvent(f"{where}: integer {str(v)[:30]}{'...' if len(str(v)) > 30 else ''} does not fit SQLite's 64-bit INTEGER")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise BadEvent(f"{where}: {v} is not a finite number")
        elif isinstance(v, str):
            _text(v, where)
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise BadEvent(f"{where}: a key that is not a string ({type(k).__name__})")
                _text(k, where)
                stack.append((x, f"{where}.{k}"[:200], depth + 1))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
        else:
            raise BadEvent(f"{where}: a {type(v).__name__} is not JSON")


def _text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BadEvent(f"{where}: a string that is not valid Unicode (a lone surrogate)") from None


def check_event(ev: Event) -> None:
    """Raise :class:`BadEvent` if the history could not store ``ev`` as it is."""
    if not isinstance(ev.seq, int) or isinstance(ev.seq, bool) or not 0 < ev.seq <= INT_MAX:
        raise BadEvent(f"seq {str(ev.seq)[:30]} is not a positive 64-bit integer")
    if not isinstance(ev.ts, (int, float)) or not math.isfinite(ev.ts):
        raise BadEvent(f"ts {ev.ts!r} is not a finite number")
    if not isinstance(ev.kind, str) or not 0 < len(ev.kind) <= MAX_KIND:
        raise BadEvent(f"kind {str(ev.kind)[:80]!r} is not a name of 1..{MAX_KIND} characters")
    _text(ev.kind, "kind")
    if ev.run_id is not None and (not isinstance(ev.run_id, str) or len(ev.run_id) > MAX_RUN_ID):
        raise BadEvent(f"run_id {str(ev.run_id)[:80]!r} is not a string of at most {MAX_RUN_ID} characters")
    if ev.run_id is not None:
        _text(ev.run_id, "run_id")
    if not isinstance(ev.data, dict):
        raise BadEvent(f"data is a {type(ev.data).__name__}, not a JSON object")
    if not _plain(ev.data, 1):
        _walk(ev.data)


def raw_json(ev: Event) -> str:
    """The event as JSON that SQLite can always store (ASCII; huge integers and odd values kept as text)."""
    try:
        return json.dumps(
            {"seq": ev.seq, "ts": ev.ts, "kind": ev.kind, "run_id": ev.run_id, "data": ev.data}, default=repr, ensure_ascii=True
        )
    except (ValueError, RecursionError) as exc:  # deeper than json can write: keep what can be said
        return json.dumps({"seq": repr(ev.seq)[:40], "kind": repr(ev.kind)[:80], "unprintable": str(exc)[:200]})


def put(conn: sqlite3.Connection, host: str, epoch: str, ev: Event, error: str) -> None:
    """Keep ``ev`` raw in the quarantine (once per host, epoch and seq)."""
    seq = ev.seq if isinstance(ev.seq, int) and INT_MIN <= ev.seq <= INT_MAX else -1
    kind = ev.kind if isinstance(ev.kind, str) else repr(ev.kind)
    run_id = ev.run_id if isinstance(ev.run_id, str) else None
    conn.execute(
        "INSERT OR IGNORE INTO quarantine(host, epoch, seq, kind, run_id, raw, error, quarantined) VALUES (?,?,?,?,?,?,?,?)",
        (
            host,
            epoch,
            seq,
            kind.encode("utf-8", "backslashreplace").decode()[: MAX_KIND * 2],
            run_id.encode("utf-8", "backslashreplace").decode()[:MAX_RUN_ID] if run_id else None,
            raw_json(ev),
            error[:2000],
            time.time(),
        ),
    )


def rows(conn: sqlite3.Connection, host: str | None = None) -> list[Problem]:
    """Every quarantined event (one host's, or all), oldest first."""
    cols = ("host", "epoch", "seq", "kind", "run_id", "error", "quarantined", "raw")
    sql = f"SELECT {', '.join(cols)} FROM quarantine" + (" WHERE host=?" if host else "") + " ORDER BY quarantined, host, seq"
    return [Problem(*r) for r in conn.execute(sql, (host,) if host else ()).fetchall()]
