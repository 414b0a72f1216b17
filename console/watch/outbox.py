"""Provides the watcher's outbox: every notification to send, kept on disk until delivered or expired.

``watch.db`` (SQLite, ``0600``, next to the history) holds one row per (event, target): the event is named by
``(host, epoch, seq)`` as in the history, so a notification exists once whatever happens. The cursor into the
history's ``events`` table is moved in the same transaction that adds the event's rows, so an event is either
queued or will be read again after a crash (and then adds nothing new). A row goes ``pending`` → ``delivered``
when the target accepted it, or → ``expired`` when it could not be delivered within the expiry
(:data:`EXPIRE_S` by default). A failing target is retried with exponential backoff and jitter
(:data:`BACKOFF_MIN_S` doubling to :data:`BACKOFF_MAX_S`), one attempt at a time, oldest message first.

The one window left (delivery is at-least-once there): a target that accepted a message whose ``delivered`` mark
was not committed yet when the watcher was killed gets it again after the restart. The watcher makes the mark from
the thread that sent the message as soon as apprise returns (service.Watcher._attempt), so the window is the
target's reply on its way back plus one commit; every message carries its event key (``host/epoch/seq``) so a
receiver can drop a repeat.
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gpudeck.agents.wire import paths
from gpudeck.console.watch import targets

EXPIRE_S = 24 * 3600.0  # a notification not delivered within a day is dropped (and counted, per target)
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 300.0
KEEP_S = 7 * 86400.0  # delivered and expired rows are kept a week (for --status), then pruned
T = TypeVar("T")
FAILING_AFTER = 3  # a target whose last this many attempts failed is "failing" (--status, the metrics)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS outbox(
  host TEXT NOT NULL, epoch TEXT NOT NULL, seq INTEGER NOT NULL, target TEXT NOT NULL,
  rule INTEGER, word TEXT, run_id TEXT, title TEXT, body TEXT, notify_type TEXT, late INTEGER,
  event_ts REAL, created REAL, state TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
  last_error TEXT, done REAL,
  PRIMARY KEY(host, epoch, seq, target));
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox(state, target, event_ts);
CREATE TABLE IF NOT EXISTS targets(
  target TEXT PRIMARY KEY, delivered INTEGER NOT NULL DEFAULT 0, failures INTEGER NOT NULL DEFAULT 0,
  expired INTEGER NOT NULL DEFAULT 0, consecutive INTEGER NOT NULL DEFAULT 0, next_try REAL NOT NULL DEFAULT 0,
  last_ok REAL, last_fail REAL, last_error TEXT);
"""


class OutboxError(Exception):
    """The outbox cannot be opened or written; the message says what to fix."""


@dataclass(frozen=True)
class Item:
    """One notification for one target, as queued."""

    host: str
    epoch: str
    seq: int
    target: str
    rule: int
    word: str
    run_id: str
    title: str
    body: str
    notify_type: str
    late: bool
    event_ts: float

    @property
    def key(self) -> str:
        """The event's key as every message shows it."""
        return f"{self.host}/{self.epoch}/{self.seq}"


@dataclass(frozen=True)
class TargetStatus:
    """One target's record (``gpudeck watch --status``)."""

    target: str
    pending: int
    oldest_pending: float | None
    delivered: int
    failures: int
    expired: int
    consecutive: int
    last_ok: float | None
    last_fail: float | None
    last_error: str | None

    @property
    def failing(self) -> bool:
        """Its last attempts failed (or its only ones did)."""
        return self.consecutive >= FAILING_AFTER or (self.consecutive > 0 and self.last_ok is None)


def backoff_s(consecutive: int) -> float:
    """The wait before the next attempt after ``consecutive`` failures in a row (full jitter over the upper half)."""
    top = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** max(0, consecutive - 1))
    return random.uniform(top / 2, top)


class Outbox:
    """The outbox database; safe to use from several threads (one connection under a lock)."""

    def __init__(self, path: Path, expire_s: float = EXPIRE_S) -> None:
        self.path = path
        self.expire_s = expire_s
        try:
            paths.ensure_private_dir(path.parent)
            paths.private_file(path)
            self._c = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10.0)
            self._c.execute("PRAGMA busy_timeout=10000")
            self._c.execute("PRAGMA journal_mode=WAL")
            self._c.execute("PRAGMA synchronous=FULL")  # the record of what was sent: a power cut must not forget a delivery
            self._c.executescript(_SCHEMA)
            # the key of the targets' ids (metrics labels, --status): random per outbox, so an id says nothing of its URL
            self._c.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('label_key', ?)", (os.urandom(16).hex(),))
            (key,) = self._c.execute("SELECT value FROM meta WHERE key='label_key'").fetchone()
            self._label_key = bytes.fromhex(key)
        except paths.UnsafePath as exc:
            raise OutboxError(f"cannot open the outbox {path}: {exc.message}") from None
        except (sqlite3.Error, OSError) as exc:
            raise OutboxError(f"cannot open the outbox {path} ({exc}): free space in {path.parent} or fix its permissions") from None
        self._lock = threading.Lock()

    def label(self, target: str) -> str:
        """The target's id (``t-`` and 8 hex digits): the ``target`` label of the metrics, named by ``--status`` too."""
        return targets.label(target, self._label_key)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._c.close()

    def _tx(self, fn: Callable[[], T]) -> T:
        with self._lock:
            self._c.execute("BEGIN IMMEDIATE")
            try:
                out = fn()
                self._c.execute("COMMIT")
                return out
            except BaseException:
                self._c.execute("ROLLBACK")
                raise

    # ------------------------------------------------------------------ the cursor into the history

    def cursor(self) -> int | None:
        """The last history ``events`` rowid read (None: this outbox never read a history)."""
        with self._lock:
            row = self._c.execute("SELECT value FROM meta WHERE key='events_rowid'").fetchone()
        return int(row[0]) if row else None

    def enqueue(self, items: list[Item], cursor: int, now: float | None = None) -> int:
        """Queue ``items`` (those already queued are left as they are) and move the cursor, in one transaction; how many were new."""
        now = time.time() if now is None else now

        def run() -> int:
            n = 0
            for it in items:
                cur = self._c.execute(
                    "INSERT OR IGNORE INTO outbox(host, epoch, seq, target, rule, word, run_id, title, body, notify_type, late, event_ts,"
                    " created) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        it.host,
                        it.epoch,
                        it.seq,
                        it.target,
                        it.rule,
                        it.word,
                        it.run_id,
                        it.title,
                        it.body,
                        it.notify_type,
                        int(it.late),
                        it.event_ts,
                        now,
                    ),
                )
                n += cur.rowcount
                self._c.execute("INSERT OR IGNORE INTO targets(target) VALUES (?)", (it.target,))
            self._c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('events_rowid', ?)", (str(cursor),))
            return n

        return int(self._tx(run))

    # ------------------------------------------------------------------ delivery

    def due(self, now: float | None = None, limit: int = 100) -> list[Item]:
        """The oldest pending item of every target that is not backing off."""
        now = time.time() if now is None else now
        with self._lock:
            rows = self._c.execute(
                "SELECT o.host, o.epoch, o.seq, o.target, o.rule, o.word, o.run_id, o.title, o.body, o.notify_type, o.late, o.event_ts"
                " FROM targets t JOIN outbox o ON o.rowid = (SELECT rowid FROM outbox WHERE state='pending' AND target=t.target"
                " ORDER BY event_ts, host, epoch, seq LIMIT 1) WHERE t.next_try <= ? LIMIT ?",
                (now, limit),
            ).fetchall()
        return [Item(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], bool(r[10]), r[11]) for r in rows]

    def next_due(self) -> float | None:
        """When the next attempt is due (None: nothing pending)."""
        with self._lock:
            row = self._c.execute(
                "SELECT MIN(t.next_try) FROM targets t WHERE EXISTS (SELECT 1 FROM outbox o WHERE o.state='pending' AND o.target=t.target)"
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def delivered(self, it: Item, now: float | None = None) -> None:
        """The target accepted ``it``."""
        now = time.time() if now is None else now

        def run() -> None:
            self._c.execute(
                "UPDATE outbox SET state='delivered', done=?, attempts=attempts+1 WHERE host=? AND epoch=? AND seq=? AND target=?",
                (now, it.host, it.epoch, it.seq, it.target),
            )
            self._c.execute(
                "UPDATE targets SET delivered=delivered+1, consecutive=0, next_try=0, last_ok=? WHERE target=?", (now, it.target)
            )

        self._tx(run)

    def failed(self, it: Item, error: str, now: float | None = None) -> None:
        """The target refused ``it`` or could not be reached: back off (expire it when it is too old)."""
        now = time.time() if now is None else now
        error = error[:1000]

        def run() -> None:
            (consecutive,) = self._c.execute("SELECT consecutive FROM targets WHERE target=?", (it.target,)).fetchone()
            self._c.execute(
                "UPDATE outbox SET attempts=attempts+1, last_error=? WHERE host=? AND epoch=? AND seq=? AND target=?",
                (error, it.host, it.epoch, it.seq, it.target),
            )
            self._c.execute(
                "UPDATE targets SET failures=failures+1, consecutive=consecutive+1, next_try=?, last_fail=?, last_error=? WHERE target=?",
                (now + backoff_s(consecutive + 1), now, error, it.target),
            )

        self._tx(run)
        self.expire(now)

    def expire(self, now: float | None = None) -> int:
        """Give up on pending items older than the expiry (counted per target); prune old finished rows."""
        now = time.time() if now is None else now

        def run() -> int:
            old = now - self.expire_s
            for target, n in self._c.execute(
                "SELECT target, COUNT(*) FROM outbox WHERE state='pending' AND created < ? GROUP BY target", (old,)
            ).fetchall():
                self._c.execute("UPDATE targets SET expired=expired+? WHERE target=?", (n, target))
            cur = self._c.execute(
                "UPDATE outbox SET state='expired', done=?, last_error=COALESCE(last_error, '') || ' (expired)' WHERE state='pending' AND created < ?",
                (now, old),
            )
            self._c.execute("DELETE FROM outbox WHERE state!='pending' AND done < ?", (now - KEEP_S,))
            return cur.rowcount

        return int(self._tx(run))

    def expire_item(self, it: Item, why: str, now: float | None = None) -> None:
        """Give up on one item at once (a target apprise cannot use: retrying will not fix it)."""
        now = time.time() if now is None else now

        def run() -> None:
            self._c.execute(
                "UPDATE outbox SET state='expired', done=?, last_error=? WHERE host=? AND epoch=? AND seq=? AND target=?",
                (now, why[:1000], it.host, it.epoch, it.seq, it.target),
            )
            self._c.execute(
                "UPDATE targets SET expired=expired+1, failures=failures+1, consecutive=consecutive+1, last_fail=?, last_error=? WHERE target=?",
                (now, why[:1000], it.target),
            )

        self._tx(run)

    # ------------------------------------------------------------------ reading

    def status(self) -> list[TargetStatus]:
        """Every target's record, failing ones first."""
        with self._lock:
            rows = self._c.execute(
                "SELECT t.target, (SELECT COUNT(*) FROM outbox o WHERE o.target=t.target AND o.state='pending'),"
                " (SELECT MIN(created) FROM outbox o WHERE o.target=t.target AND o.state='pending'),"
                " t.delivered, t.failures, t.expired, t.consecutive, t.last_ok, t.last_fail, t.last_error FROM targets t ORDER BY t.target"
            ).fetchall()
        out = [TargetStatus(*r) for r in rows]
        return sorted(out, key=lambda s: not s.failing)

    def items(self, state: str | None = None) -> list[tuple]:
        """(host, epoch, seq, target, state) of every row, oldest first (tests and ``--status --json``)."""
        sql = "SELECT host, epoch, seq, target, state FROM outbox"
        params: tuple = ()
        if state is not None:
            sql, params = sql + " WHERE state=?", (state,)
        with self._lock:
            return [tuple(r) for r in self._c.execute(sql + " ORDER BY event_ts, host, epoch, seq", params).fetchall()]


def failing_summary(path: Path) -> str | None:
    """One line naming the failing notification targets of the outbox at ``path`` (for the console's header), or None.

    Reads only: an outbox that does not exist or cannot be read says nothing (the watcher may never have run)."""
    if not path.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return None
    try:
        rows = conn.execute("SELECT target, consecutive, last_ok, last_error FROM targets WHERE consecutive > 0").fetchall()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    failing = [r for r in rows if r[1] >= FAILING_AFTER or r[2] is None]
    if not failing:
        return None
    names = ", ".join(targets.privacy_form(r[0]) for r in failing[:3]) + (f" and {len(failing) - 3} more" if len(failing) > 3 else "")
    return f"notifications failing to {names}: `gpudeck watch --status` says why"
