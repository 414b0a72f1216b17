"""Provides the agent's journal: runs and an event log in SQLite that survives ``kill -9``.

WAL with ``synchronous=FULL``. Every write goes through ONE writer thread that
commits whatever has queued up in one transaction (one fsync per batch), so the
agent's event loop never waits on the disk: ``append``, ``append_many`` and
``update_run`` queue the write and return at once. Events are numbered by
``seq`` when they are queued, strictly increasing with no gaps, within an
``epoch`` (a UUID made with the database), so a replica can pull "everything
after (epoch, seq)" and never duplicate or miss anything. An event is readable
(``events_after``) only once committed, and so is sent to nobody before.

Durability, for a caller that acknowledges something only once it is on disk
(a launch is acknowledged only after its record is durable):

* ``create_run`` (and ``append_durable``) block until their commit and raise
  ``StorageError`` if it failed (disk full: such writes fail fast);
* from the event loop, ``await durable_create_run(run)`` /
  ``await durable_append_many(items)`` / ``await durable_update_run(...)`` do the
  same without blocking it; ``await wait_durable()`` / ``flush()`` wait for
  everything queued so far.

A queued (not fail-fast) write that cannot be committed (disk full, the file
locked for longer than the busy timeout) is retried until it can be, in order;
``storage_error`` says why meanwhile. A fail-fast write that fails leaves a
``void`` event in each seq it was given, so seqs stay gapless.

Reads see the writer's queue: a run's queued field changes are applied to what
``get_run``/``find_runs``/``list_runs``/``run_by_request`` return and
``last_event`` looks at queued events first; ``events_after`` waits (unless
``wait=False``) for what was queued before it was called. Reads use their own
connection, so a commit in progress never holds them up.

Payloads are typed (``agents/wire/events.py``): each is validated against its kind's
type when it is queued; the stored JSON is the dict the caller gave.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gpudeck.agents.wire import events as payloads
from gpudeck.agents.wire import paths
from gpudeck.agents.wire.errors import AgentError, StorageError
from gpudeck.agents.wire.protocol import (
    Alert,
    EnvFingerprint,
    Event,
    LaunchSpec,
    Member,
    PreflightResult,
    RunInfo,
    encode_safe,
    scrub,
    scrub_text,
)

log = logging.getLogger("gpudeck.journal")

_BASE_TABLES = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS runs (
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
)""",
    "CREATE INDEX IF NOT EXISTS runs_state ON runs(state)",
    """CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    run_id TEXT,
    data TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS events_run ON events(run_id, kind, seq)",
)

_RUN_FIELDS = ("state", "cause", "exit_code", "signal", "started", "ended", "members", "name", "preflight", "env", "alerts")
# columns added to runs before the schema carried a version: (name, SQL type)
_ADDED_COLUMNS = (("preflight", "TEXT"), ("env", "TEXT"), ("alerts", "TEXT NOT NULL DEFAULT '[]'"))


def _to_v1(conn: sqlite3.Connection) -> None:
    """Version 1: the schema as it stood when versions began (commit 68f3ea7). A new file gets every table; a file
    an unversioned agent wrote (user_version 0) gets what it lacks: the tables, and the columns added in place
    since the first release (an older file may lack some)."""
    for stmt in _BASE_TABLES:
        conn.execute(stmt)
    have = {r[1] for r in conn.execute("PRAGMA table_info(runs)")}
    for col, decl in _ADDED_COLUMNS:
        if col not in have:
            conn.execute(f"ALTER TABLE runs ADD COLUMN {col} {decl}")


# The journal's schema versions: MIGRATIONS[i] takes a file from version i to i + 1 (``PRAGMA user_version``). A
# change to the schema is a new function appended here, never an edit of one already released: files written by
# every earlier agent open (tests/unit/test_journal_schema.py opens the reference files under tests/reference/journal/).
def _to_v2(conn: sqlite3.Connection) -> None:
    """Version 2: events found by kind (the GPU ledger's records are read back at start and compacted by kind)."""
    conn.execute("CREATE INDEX IF NOT EXISTS events_kind ON events(kind, seq)")


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_to_v1, _to_v2)
SCHEMA_VERSION = len(MIGRATIONS)


class NewerSchema(StorageError):
    """The journal was written by a newer agent (a schema version this one does not know)."""


def _migrate(conn: sqlite3.Connection, path: Path) -> int:
    """Bring the file at ``conn`` to SCHEMA_VERSION: every migration it lacks, in order, in one transaction (all or
    none: a crash midway leaves the file as it was). The version it had; NewerSchema for a newer file."""
    with _transaction(conn):
        have = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if have > SCHEMA_VERSION:
            raise NewerSchema(
                f"the journal {path} has schema version {have}, written by a newer gpudeck agent; this one ({SCHEMA_VERSION}) "
                f"cannot read it: install that newer gpudeck on this host, or point GPUDECK_HOME or --state-dir elsewhere"
            )
        for step in MIGRATIONS[have:]:
            step(conn)
        if have != SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    if have != SCHEMA_VERSION:
        log.info("journal %s: schema version %d -> %d", path, have, SCHEMA_VERSION)
    return have


_STRUCT_FIELDS = {"members": list[Member], "preflight": PreflightResult | None, "env": EnvFingerprint | None, "alerts": list[Alert]}

BATCH_MAX = 512  # writes folded into one transaction
RETRY_MAX_S = 0.25  # a failing commit is retried at least this often (and newly queued writes join it)
DURABLE_TIMEOUT_S = 60.0  # a blocking durable write gives up (StorageError) after this long
CLOSE_TIMEOUT_S = 10.0  # close() waits this long for queued writes on a failing disk, then drops them (logged)
# The journal's path is looked at (deleted? replaced? changed by someone?) by the agent's tick (check(), two lstat calls)
# and by the writer before every batch and after every commit; a full probe (a read through a fresh connection: ~150 us)
# runs only when that look finds the file (or its WAL) changed since the last full probe, and at least every
# FULL_PROBE_S while nothing changes (the writer sleeps that long when idle: a changed file wakes it through check())
FULL_PROBE_S = 5.0


def _storage_error(exc: sqlite3.Error, path: Path) -> StorageError:
    text = str(exc)
    if "full" in text or "disk I/O" in text:
        return StorageError(
            f"the agent's journal {path} cannot be written ({text}): free space in {path.parent} and retry; nothing was recorded"
        )
    if "locked" in text or "busy" in text:
        return StorageError(
            f"the agent's journal {path} is locked by another process ({text}): the write is retried; `fuser {path}` shows who holds it"
        )
    return StorageError(f"the agent's journal {path} failed: {text}")


class _Corrupt(Exception):
    """What the journal's path holds is not a sound SQLite journal."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def _is_corrupt(exc: sqlite3.Error) -> bool:
    """SQLITE_CORRUPT or SQLITE_NOTADB: the file's bytes are wrong (not a passing condition like a full disk)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    text = str(exc)
    return "malformed" in text or "not a database" in text


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any error (the error goes on)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        raise


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=5.0)
    conn.execute("PRAGMA busy_timeout=5000")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


@dataclass
class _Op:
    """One write: its statements and events, committed together or not at all."""

    opno: int
    stmts: list[tuple[str, tuple]]
    events: list[Event]  # seq and ts assigned when queued; the seq may shift if another process wrote meanwhile
    encoded: list[str]  # each event's data as stored
    fail_fast: bool
    fut: Future = field(default_factory=Future)  # the caller's: done at commit, or failed at once (fail-fast)
    settled: Future = field(default_factory=Future)  # done when its seqs are on disk (its events, or void ones)
    run_keys: list[tuple[str, str]] = field(default_factory=list)  # (run id, field) this op set in the overlay
    new_run: str | None = None  # a run this op creates (overlay of runs not yet committed)
    error: StorageError | None = None

    def void(self, reason: str) -> None:
        """Give up this write; its seqs get ``void`` events instead."""
        self.stmts = []
        self.encoded = [json.dumps({"reason": reason[:500]}) for _ in self.events]
        self.events = [Event(seq=e.seq, ts=e.ts, kind="void", run_id=e.run_id, data={"reason": reason[:500]}) for e in self.events]
        self.fail_fast = False


class Journal:
    """The agent's durable record of runs and events; thread-safe, writes never block the caller (see module doc)."""

    def __init__(self, path: Path, host: str) -> None:
        self.path = Path(path)
        self.host = host
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.recreated: list[dict[str, Any]] = []  # each time the file was found gone, replaced or corrupt (newest last)
        self.problem: str | None = None  # what is wrong with the path right now, when it cannot be mended yet
        # the runs that are live, from their supervisor's memory (set by the agent): re-recorded in a new file
        self.live_source: Callable[[], list[RunInfo]] | None = None
        self.on_recreate: Callable[[dict[str, Any]], None] | None = None  # called from the writer thread
        try:
            self._open_file()
        except _Corrupt as exc:  # garbage, truncated, not SQLite: moved aside, a new epoch starts (never a traceback)
            moved = self._move_aside("corrupt")
            log.error("journal %s is corrupt (%s); moved aside to %s, starting a new one", self.path, exc.why, moved)
            self._open_file()
            self.recreated.append(
                {"reason": "corrupt", "detail": exc.why, "moved_to": moved, "previous_epoch": None, "at_start": True, "ts": time.time()}
            )
        self._rlock = threading.Lock()  # the read connection
        self._plock = threading.Lock()  # the queue, the seq counter and the overlay
        self._cond = threading.Condition(self._plock)
        self._queue: list[_Op] = []  # queued, not yet taken by the writer
        self._pending: dict[int, _Op] = {}  # queued or in flight, by opno, oldest first
        self._ov_fields: dict[str, dict[str, tuple[int, Any]]] = {}
        self._ov_new: dict[str, tuple[int, RunInfo]] = {}
        self._opno = 0
        self._committed_seq = self._read_last_seq()
        self._next_seq = self._committed_seq + 1
        self._last_op: _Op | None = None
        self._inflight: list[_Op] = []  # the batch the writer is committing
        self._closing = False
        self._closed = False
        self._suspect = False  # check() saw the path change: the writer looks at once
        self._probed = time.monotonic()
        self._probed_sig: tuple[int, ...] | None = None  # the file (and its WAL) as the last clean full probe found them
        self._path_s, self._wal_s = str(self.path), f"{self.path}-wal"  # _sig's, every tick: no Path built each time
        self.storage_error: str | None = None  # why commits fail right now (None when they succeed)
        self.on_commit: Callable[[int], None] | None = None  # called from the writer thread after each commit
        self.batches_committed = 0
        self.full_probes = 0  # reads of the file through a fresh connection (tests: an idle journal is not read each tick)
        self._writer = threading.Thread(target=self._write_loop, name="journal-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ the file itself

    def _open_file(self) -> None:
        """Open (or create) the database at the path: connections, schema, epoch, and the (st_dev, st_ino) it names.

        Raises _Corrupt when what is there is not a sound SQLite journal; StorageError when it cannot be opened."""
        # 0600 whatever the umask (specs hold --env values; SQLite gives -wal/-shm the database's mode), never through
        # a link. Once, before any connection: closing another descriptor of the file would drop SQLite's POSIX locks
        # on it (fcntl locks belong to the process), and then readers elsewhere stop seeing the writer's commits.
        paths.private_file(self.path)
        wconn: sqlite3.Connection | None = None
        try:
            wconn = _connect(self.path)
            ok = wconn.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise _Corrupt(f"SQLite's quick_check: {str(ok)[:300]}")
            _migrate(wconn, self.path)
            wconn.execute("BEGIN IMMEDIATE")
            row = wconn.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()
            if row is None:
                self.epoch = str(uuid.uuid4())
                wconn.execute("INSERT INTO meta(key, value) VALUES ('epoch', ?)", (self.epoch,))
                wconn.execute("INSERT INTO meta(key, value) VALUES ('created', ?)", (repr(time.time()),))
            else:
                self.epoch = str(row[0])
            wconn.execute("COMMIT")
            rconn = _connect(self.path)
            st = os.stat(self.path)
        except (_Corrupt, StorageError):
            if wconn is not None:
                wconn.close()
            raise
        except sqlite3.Error as exc:
            if wconn is not None:
                wconn.close()
            if _is_corrupt(exc):
                raise _Corrupt(str(exc)) from None
            raise _storage_error(exc, self.path) from exc
        self._wconn, self._rconn = wconn, rconn
        self._ident = (st.st_dev, st.st_ino)

    def _move_aside(self, why: str) -> str | None:
        """Rename what the path names (and its -wal/-shm) to ``journal.db.<why>-<UTC time>``, 0600; the new name, or
        None when nothing was there. A name taken already gets a counter."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        base = self.path.with_name(f"{self.path.name}.{why}-{stamp}")
        n = 1
        while os.path.lexists(base):
            n += 1
            base = self.path.with_name(f"{self.path.name}.{why}-{stamp}.{n}")
        moved = None
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            if not os.path.lexists(src):
                continue
            dst = Path(str(base) + suffix)
            os.rename(src, dst)
            if not suffix:
                moved = str(dst)
            try:
                if not os.path.islink(dst):
                    os.chmod(dst, 0o600)
            except OSError:
                pass
        return moved

    def _path_problem(self) -> tuple[str, str] | None:
        """(kind, detail) when the path no longer names the file this journal writes: ``deleted``, ``replaced``,
        ``corrupt`` (what it names is not SQLite any more), ``unreadable``; None when all is well. Reads through a
        new SQLite connection only (never a bare descriptor of the file: closing one would drop SQLite's locks)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return "deleted", f"{self.path} was deleted"
        except OSError as exc:
            return "unreadable", f"{self.path} cannot be looked at ({exc.strerror})"
        if (st.st_dev, st.st_ino) != self._ident:
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "another file"
            return "replaced", f"{self.path} was replaced by {what}"
        return None

    def _sig(self) -> tuple[int, ...] | None:
        """What changes whenever anyone writes the file or its WAL (inode, size, mtime; the file's ctime too: not the
        WAL's, which SQLite's own opening of it changes when run as root, a chown); None when the path cannot be
        looked at. Two lstat calls: cheap enough for every tick."""
        out: list[int] = []
        for path, ctime in ((self._path_s, True), (self._wal_s, False)):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                out += (-1, -1, -1, -1)
                continue
            except OSError:
                return None
            out += (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns if ctime else 0)
        return tuple(out)

    def _changed(self) -> bool:
        """Whether the file or its WAL changed since the last clean full probe (then it is probed again)."""
        return self._probed_sig is None or self._sig() != self._probed_sig

    def _full_probe(self) -> None:
        """:meth:`_probe` and :meth:`_mend` (writer thread); a clean result remembers the file's signature, so the
        next look costs two lstat calls until something writes it."""
        self._probed = time.monotonic()
        self.full_probes += 1
        sig = self._sig()  # before the read: a change after it is seen by the next look
        found = self._probe()
        self._probed_sig = sig if found is None else None
        self._mend(found)

    def _probe(self) -> tuple[str, str] | None:
        """:meth:`_path_problem`, then a read of the meta table through a fresh connection (the header and page 1)."""
        found = self._path_problem()
        if found is not None:
            return found
        try:
            conn = sqlite3.connect(f"file:{urllib.parse.quote(str(self.path))}?mode=ro", uri=True, timeout=1.0)
            try:
                row = conn.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()
            finally:
                conn.close()
        except sqlite3.Error as exc:
            if _is_corrupt(exc):
                return "corrupt", f"{self.path} is no longer a sound SQLite file ({exc})"
            if "locked" in str(exc) or "busy" in str(exc):
                return None
            return "unreadable", f"{self.path} cannot be read ({exc})"
        if row is None or row[0] != self.epoch:
            return "replaced", f"{self.path} holds another journal (epoch {row[0] if row else 'none'}, this agent wrote {self.epoch})"
        return None

    def _live_now(self) -> list[RunInfo]:
        source = self.live_source
        if source is None:
            return []
        for _ in range(20):
            try:
                return [msgspec.structs.replace(r) for r in source()]
            except RuntimeError:  # the supervisor's dict changed under us (another thread): read it again
                time.sleep(0.001)
        return []

    def _recreate(self, kind: str, detail: str) -> None:
        """The path no longer names a sound journal of ours: move aside what is there, open a new file (a new epoch)
        and re-record in it every run the old file held (read through the connection still open on it, when it reads)
        and every live run as the supervisor holds it; a ``journal_recreated`` event says what happened. Writer thread
        only (the one user of the write connection). Pending writes follow in the new file, renumbered."""
        old_epoch = self.epoch
        # said until the new file holds its story (self.recreated): the new epoch is visible from _open_file on, and a
        # status read in between must not show a new epoch with nothing said of the journal
        self.problem = f"{kind}: {detail}; a new journal is being made"
        salvaged: list[tuple] = []
        salvage_note = ""
        try:
            salvaged = self._wconn.execute(f"SELECT {self._COLS} FROM runs").fetchall()
        except sqlite3.Error as exc:
            salvage_note = f"the old file's runs could not be read ({exc})"
        live = self._live_now()
        moved = None
        if kind != "deleted":
            moved = self._move_aside("corrupt" if kind == "corrupt" else kind)
        else:
            for suffix in ("-wal", "-shm"):  # the deleted file's own: a new database must not pick them up
                if os.path.lexists(str(self.path) + suffix):
                    self._move_aside("deleted")
                    break
        with self._rlock:
            for conn in (self._rconn, self._wconn):
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
            self._open_file()  # StorageError when the folder itself is gone or unwritable: the caller retries
        conn = self._wconn
        live_ids = [r.id for r in live]
        info: dict[str, Any] = {
            "reason": kind,
            "detail": detail[:500] + (f"; {salvage_note}" if salvage_note else ""),
            "moved_to": moved,
            "previous_epoch": old_epoch,
            "runs": live_ids,
            "at_start": False,
        }
        items: list[tuple[str, str | None, dict[str, Any]]] = [("journal_recreated", None, info)]
        try:
            self._rerecord(conn, salvaged, live, items)
        except BaseException:
            self._ident = (-1, -1)  # this new file lacks the runs: the next check finds it "replaced" and starts over
            raise
        top = len(items)
        with self._plock:
            pend = [e for op in self._pending.values() for e in op.events]
            if pend:
                shift = top + 1 - pend[0].seq
                for e in pend:
                    e.seq += shift
                self._next_seq += shift
            else:
                self._next_seq = top + 1
            self._committed_seq = top
        info["ts"] = time.time()
        self.recreated.append(info)
        self.problem = None
        log.error(
            "journal %s: %s; a new journal (epoch %s) was started%s and %d live run(s) re-recorded (%d run record(s) carried over)",
            self.path,
            detail,
            self.epoch,
            f", the old file moved aside to {moved}" if moved else "",
            len(live),
            len(salvaged),
        )
        cb = self.on_recreate
        if cb is not None:
            try:
                cb(info)
            except Exception:
                log.exception("journal on_recreate callback failed")

    def _rerecord(
        self, conn: sqlite3.Connection, salvaged: list[tuple], live: list[RunInfo], items: list[tuple[str, str | None, dict[str, Any]]]
    ) -> None:
        """Into a new file: the old file's run rows, the live runs as the supervisor holds them, and ``items`` (the
        ``journal_recreated`` event) followed by each live run's ``run_created`` and ``run_adopted``; one transaction."""
        with _transaction(conn):
            cols = self._COLS.split(", ")
            marks = ",".join("?" * len(cols))
            for row in salvaged:
                conn.execute(f"INSERT OR REPLACE INTO runs({self._COLS}) VALUES ({marks})", row)
            for run in live:
                stmt, created = self._create_stmt(run, replace=True)
                conn.execute(*stmt)
                items.append(created)
                items.append(
                    ("run_adopted", run.id, {"state": run.state, "containment": run.containment.label if run.containment else None})
                )
            for i, (k, rid, d) in enumerate(items):
                payloads.validate(k, d)
                conn.execute(
                    "INSERT INTO events(seq, ts, kind, run_id, data) VALUES (?, ?, ?, ?, ?)", (i + 1, time.time(), k, rid, json.dumps(d))
                )

    def _mend(self, found: tuple[str, str] | None) -> bool:
        """Act on what :meth:`_probe`/:meth:`_path_problem` found; True when the journal was recreated."""
        if found is None:
            self.problem = None
            return False
        kind, detail = found
        if kind == "unreadable":  # the file we hold is still the path's: keep writing it, say so, look again
            if self.problem != detail:
                log.error("journal %s: %s", self.path, detail)
            self.problem = detail
            return False
        try:
            self._recreate(kind, detail)
        except (AgentError, _Corrupt, OSError, sqlite3.Error) as exc:  # AgentError: StorageError, UnsafePath
            why = exc.message if isinstance(exc, AgentError) else str(exc)
            problem = f"{detail}, and a new journal cannot be made there yet ({why})"
            if self.problem != problem:
                log.error("journal %s: %s", self.path, problem)
            self.problem = problem
            return False
        return True

    def check(self) -> str | None:
        """From any thread (the agent's tick): what is wrong with the journal's path now, if anything. The writer
        thread is woken to mend it, and to probe the file fully when someone wrote it since its last probe (it
        looks on its own before every batch and at least every FULL_PROBE_S too)."""
        found = self._path_problem()
        if found is not None or self._changed():
            with self._cond:
                if not self._suspect:
                    self._suspect = True
                    self._cond.notify()
        return found[1] if found is not None else self.problem

    # ------------------------------------------------------------------ plumbing

    def _read_last_seq(self) -> int:
        row = self._wconn.execute("SELECT MAX(seq) FROM events").fetchone()
        return int(row[0] or 0)

    def _submit(
        self,
        stmts: list[tuple[str, tuple]],
        items: list[tuple[str, str | None, dict[str, Any]]],
        *,
        fail_fast: bool = False,
        ts: float | None = None,
        run_fields: tuple[str, dict[str, Any]] | None = None,
        new_run: RunInfo | None = None,
    ) -> _Op:
        for kind, _rid, data in items:
            payloads.validate(kind, data)  # BadEvent names the kind and the field
        encoded = [json.dumps(d, default=str) for _k, _r, d in items]
        if any("\\ud" in e for e in encoded):  # a lone surrogate (a run's text): stored, and so served, as U+FFFD
            items = [(k, r, scrub(d)) for k, r, d in items]
            encoded = [json.dumps(d, default=str) for _k, _r, d in items]
        ts = time.time() if ts is None else ts
        with self._plock:
            if self._closing:
                raise StorageError(f"the agent's journal {self.path} is closed; nothing was recorded")
            self._opno += 1
            seq0 = self._next_seq
            self._next_seq += len(items)
            evs = [Event(seq=seq0 + i, ts=ts, kind=k, run_id=r, data=d) for i, (k, r, d) in enumerate(items)]
            op = _Op(opno=self._opno, stmts=stmts, events=evs, encoded=encoded, fail_fast=fail_fast)
            # running: a waiter that gives up (a cancelled wrap_future, a timeout) cannot cancel them under the writer
            op.fut.set_running_or_notify_cancel()
            op.settled.set_running_or_notify_cancel()
            if run_fields is not None:
                rid, fields = run_fields
                ov = self._ov_fields.setdefault(rid, {})
                for k, v in fields.items():
                    ov[k] = (op.opno, v)
                    op.run_keys.append((rid, k))
            if new_run is not None:
                self._ov_new[new_run.id] = (op.opno, msgspec.structs.replace(new_run))
                op.new_run = new_run.id
            self._queue.append(op)
            self._pending[op.opno] = op
            self._last_op = op
            self._cond.notify()
        return op

    def _forget(self, op: _Op) -> None:
        """Drop a processed op from the queue's view (overlay, pending); caller holds _plock."""
        self._pending.pop(op.opno, None)
        self._unoverlay(op)

    def _unoverlay(self, op: _Op) -> None:
        """Readers stop seeing this op's run changes (committed, or given up); caller holds _plock."""
        for rid, k in op.run_keys:
            ov = self._ov_fields.get(rid)
            if ov is not None and ov.get(k, (None,))[0] == op.opno:
                del ov[k]
                if not ov:
                    del self._ov_fields[rid]
        if op.new_run is not None and self._ov_new.get(op.new_run, (None,))[0] == op.opno:
            del self._ov_new[op.new_run]

    def _take(self, batch: list[_Op], block: bool) -> bool:
        """Move queued ops into ``batch``; False when closing and nothing is left. Waits at most FULL_PROBE_S
        (the journal is probed fully that often while idle; check() wakes it sooner when the file changed)."""
        with self._cond:
            if block and not self._queue and not self._closing and not self._suspect:
                self._cond.wait(FULL_PROBE_S)
            room = BATCH_MAX - len(batch)
            batch.extend(self._queue[:room])
            del self._queue[:room]
            return bool(batch) or not self._closing

    def _write_loop(self) -> None:
        while True:
            try:
                if not self._write_some():
                    return
            except Exception:  # the writer must outlive anything one batch does; what it held is retried
                log.exception("journal writer failed; retrying")
                time.sleep(RETRY_MAX_S)

    def _write_some(self) -> bool:
        """One batch, committed (retried until it is); False once closed and drained. The batch stays in
        ``_inflight`` until it is committed, so an unexpected error loses none of it (the loop calls again).

        Before the batch, the path is checked against the file this journal opened (a full probe when the file
        changed since the last one, and every FULL_PROBE_S); after it too: a commit is done (and so a launch
        acknowledged) only once it is in the file the path names. A journal found gone, replaced or corrupt is
        recreated first (:meth:`_recreate`)."""
        batch = self._inflight
        if not batch:
            if not self._take(batch, block=True):
                return False
            with self._plock:
                suspect, self._suspect = self._suspect, False
            if suspect or time.monotonic() - self._probed >= FULL_PROBE_S or self._changed():
                self._full_probe()
            if not batch:
                return True
        elif self._path_problem() is not None:
            self._mend(self._path_problem())
        give_up_at: float | None = None
        while True:
            try:
                if not self._inflight_checked():
                    # nothing goes into a file the path no longer names: fail-fast writes fail now, others wait
                    raise sqlite3.OperationalError(self.problem or "the journal's path names no journal")
                pre = self._sig()
                self._commit(self._wconn, batch)
                after = self._path_problem()
                if after is None and pre is not None and pre == self._probed_sig:
                    self._probed_sig = self._sig()  # unchanged but for this commit: our own write is no reason to probe
                if after is not None and after[0] != "unreadable":
                    # committed into a file the path no longer names: the new one has the runs (carried over);
                    # the batch's events go in too, renumbered, before anyone is told it is done
                    if not self._mend(after):
                        raise sqlite3.OperationalError(self.problem or after[1])  # not acknowledged: fail-fast writes fail
                    self._commit_events(self._wconn, batch)
                break
            except sqlite3.Error as exc:
                if _is_corrupt(exc) and self._mend(("corrupt", f"{self.path} is no longer a sound SQLite file ({exc})")):
                    continue  # the batch goes into the new file
                err = _storage_error(exc, self.path)
                if self.storage_error != err.message:
                    log.error("journal commit failed (retrying): %s", err.message)
                self.storage_error = err.message
                for op in batch:
                    if op.fail_fast:
                        op.error = err
                        op.void(f"write failed: {exc}")
                        with self._plock:
                            self._unoverlay(op)
                        if not op.fut.done():
                            op.fut.set_exception(err)  # the caller knows now; its seqs get void events
                with self._plock:
                    closing = self._closing
                if closing:
                    give_up_at = give_up_at or time.monotonic() + CLOSE_TIMEOUT_S
                    if time.monotonic() >= give_up_at:
                        log.error("journal closed with %d queued write(s) never committed: %s", len(batch), err.message)
                        for op in batch:
                            if not op.fut.done():
                                op.fut.set_exception(err)
                            if not op.settled.done():
                                op.settled.set_result(None)
                        batch.clear()
                        return True
                time.sleep(RETRY_MAX_S)
                self._take(batch, block=False)  # what was queued meanwhile joins the retry (fail-fast ops fail now)
        self.storage_error = None
        self.batches_committed += 1
        with self._plock:
            for op in batch:
                self._forget(op)
                if op.events:
                    self._committed_seq = max(self._committed_seq, op.events[-1].seq)
            top = self._committed_seq
        done = list(batch)
        batch.clear()
        for op in done:
            if not op.fut.done():
                if op.error is not None:
                    op.fut.set_exception(op.error)
                else:
                    op.fut.set_result(None)
            if not op.settled.done():
                op.settled.set_result(None)
        cb = self.on_commit
        if cb is not None:
            try:
                cb(top)
            except Exception:  # a listener must not stop the writer
                log.exception("journal on_commit callback failed")
        return True

    def _inflight_checked(self) -> bool:
        """False while the path is known bad and cannot be mended (nothing is committed into a lost file meanwhile)."""
        found = self._path_problem()
        if found is None:
            return True
        return self._mend(found) or found[0] == "unreadable"

    def _commit_events(self, conn: sqlite3.Connection, batch: list[_Op]) -> None:
        with _transaction(conn):
            for op in batch:
                self._insert_events(conn, op)

    def _commit(self, conn: sqlite3.Connection, batch: list[_Op]) -> None:
        with _transaction(conn):
            top = int(conn.execute("SELECT MAX(seq) FROM events").fetchone()[0] or 0)
            first = next((op.events[0].seq for op in batch if op.events), None)
            if first is not None and top != first - 1:
                self._renumber(top + 1 - first)  # another process wrote to this file: shift ours past its events
            for op in batch:
                conn.execute("SAVEPOINT op")
                try:
                    for sql, params in op.stmts:
                        conn.execute(sql, params)
                    self._insert_events(conn, op)
                except sqlite3.IntegrityError as exc:  # this write is impossible (a duplicate id): it alone fails
                    conn.execute("ROLLBACK TO op")
                    op.error = StorageError(f"the agent's journal {self.path} refused a write: {exc}")
                    op.void(f"write refused: {exc}")
                    self._insert_events(conn, op)
                conn.execute("RELEASE op")

    @staticmethod
    def _insert_events(conn: sqlite3.Connection, op: _Op) -> None:
        if op.events:
            conn.executemany(
                "INSERT INTO events(seq, ts, kind, run_id, data) VALUES (?, ?, ?, ?, ?)",
                [(e.seq, e.ts, e.kind, e.run_id, d) for e, d in zip(op.events, op.encoded)],
            )

    def _renumber(self, shift: int) -> None:
        with self._plock:
            log.warning(
                "journal %s: another process wrote events; shifting %d queued seq(s) by %d",
                self.path,
                sum(len(o.events) for o in self._pending.values()),
                shift,
            )
            for op in self._pending.values():
                for e in op.events:
                    e.seq += shift
            self._next_seq += shift

    def close(self) -> None:
        """Commit what is queued (waiting up to CLOSE_TIMEOUT_S on a failing disk), then close the database."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.notify_all()
        self._writer.join(CLOSE_TIMEOUT_S + 30)
        self._closed = True
        with self._rlock:
            self._rconn.close()
        self._wconn.close()

    @property
    def last_seq(self) -> int:
        """The newest seq handed out (committed, or queued to be committed in order)."""
        with self._plock:
            return self._next_seq - 1

    @property
    def committed_seq(self) -> int:
        """The newest seq on disk: what a replica can read now."""
        return self._committed_seq

    @property
    def queued(self) -> int:
        """Writes queued or being committed."""
        return len(self._pending)

    # ------------------------------------------------------------------ durability

    def flush(self, timeout: float | None = DURABLE_TIMEOUT_S) -> None:
        """Block until every write queued before this call is processed; StorageError if that takes over ``timeout``."""
        op = self._last_op
        if op is None or op.settled.done():
            return
        try:
            op.settled.result(timeout=timeout)
        except FutureTimeout:
            raise StorageError(
                f"the agent's journal {self.path} did not commit within {timeout:g} s ({self.storage_error or 'a slow disk'})"
            ) from None

    async def wait_durable(self) -> None:
        """Wait, without blocking the event loop, until every write queued before this call is processed."""
        op = self._last_op
        if op is not None and not op.settled.done():
            await asyncio.wrap_future(op.settled)

    def _result(self, op: _Op, timeout: float | None) -> None:
        try:
            op.fut.result(timeout=timeout)
        except FutureTimeout:
            raise StorageError(
                f"the agent's journal {self.path} did not commit within {timeout:g} s ({self.storage_error or 'a slow disk'}); the write stays queued"
            ) from None

    # ------------------------------------------------------------------ events

    def append(self, kind: str, run_id: str | None = None, data: dict[str, Any] | None = None) -> Event:
        """Queue one event and return it (with its seq); it is committed shortly, in order."""
        return self.append_many([(kind, run_id, data or {})])[0]

    def append_many(self, items: list[tuple[str, str | None, dict[str, Any]]]) -> list[Event]:
        """Queue several events, committed in one transaction."""
        if not items:
            return []
        return self._submit([], items).events

    def append_durable(
        self, kind: str, run_id: str | None = None, data: dict[str, Any] | None = None, timeout: float | None = DURABLE_TIMEOUT_S
    ) -> Event:
        """Commit one event and return once it is on disk (blocking); StorageError if it cannot be."""
        op = self._submit([], [(kind, run_id, data or {})], fail_fast=True)
        self._result(op, timeout)
        return op.events[0]

    async def durable_append_many(self, items: list[tuple[str, str | None, dict[str, Any]]]) -> list[Event]:
        """Commit events and return once they are on disk, without blocking the loop; StorageError if they cannot be."""
        op = self._submit([], items, fail_fast=True)
        await asyncio.wrap_future(op.fut)
        return op.events

    def events_after(self, after_seq: int, limit: int = 10000, wait: bool = True) -> list[Event]:
        """Committed events with seq > after_seq, oldest first; with ``wait``, once what was queued before is committed."""
        if wait:
            try:
                self.flush()
            except StorageError:
                pass  # what is committed is still the truth
        rows = self._select("SELECT seq, ts, kind, run_id, data FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))
        return [Event(seq=r[0], ts=r[1], kind=r[2], run_id=r[3], data=json.loads(r[4])) for r in rows]

    def last_event(self, run_id: str, kind: str) -> Event | None:
        """The newest event of one kind for one run (queued ones included)."""
        with self._plock:
            for op in reversed(self._pending.values()):
                for e in reversed(op.events):
                    if e.run_id == run_id and e.kind == kind:
                        return e
        rows = self._select(
            "SELECT seq, ts, kind, run_id, data FROM events WHERE run_id=? AND kind=? ORDER BY seq DESC LIMIT 1", (run_id, kind)
        )
        r = rows[0] if rows else None
        return Event(seq=r[0], ts=r[1], kind=r[2], run_id=r[3], data=json.loads(r[4])) if r else None

    # ------------------------------------------------------------------ the GPU ledger's records

    def events_of_kind(self, kind: str, after_seq: int = 0, before_ts: float | None = None) -> list[Event]:
        """Committed events of one kind after ``after_seq`` (and older than ``before_ts``), oldest first."""
        sql = "SELECT seq, ts, kind, run_id, data FROM events WHERE kind=? AND seq > ?"
        params: tuple = (kind, after_seq)
        if before_ts is not None:
            sql += " AND ts < ?"
            params += (before_ts,)
        rows = self._select(sql + " ORDER BY seq", params)
        return [Event(seq=r[0], ts=r[1], kind=r[2], run_id=r[3], data=json.loads(r[4])) for r in rows]

    def void_events(self, seqs: list[int], reason: str) -> None:
        """Replace committed events by ``void`` ones in place (the ledger's compaction): the file shrinks and the seqs
        stay gapless (a replica asks again at a gap). Queued like any write; ``reason`` is what a replica reads."""
        if not seqs:
            return
        data = json.dumps({"reason": reason[:500]})
        stmts = [("UPDATE events SET kind='void', run_id=NULL, data=? WHERE seq=?", (data, s)) for s in seqs]
        self._submit(stmts, [])

    # ------------------------------------------------------------------ runs

    def _create_stmt(self, run: RunInfo, replace: bool = False) -> tuple[tuple[str, tuple], tuple[str, str | None, dict[str, Any]]]:
        """The INSERT of a run's row and its ``run_created`` event."""
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        stmt = (
            f"{verb} INTO runs(id, request_id, host, name, state, cause, exit_code, signal, created, started, ended, spec, run_dir, members,"
            " preflight, env, alerts) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                run.id,
                run.request_id or None,
                run.host,
                None if run.name is None else scrub_text(run.name),
                run.state,
                None if run.cause is None else scrub_text(run.cause),
                run.exit_code,
                run.signal,
                run.created,
                run.started,
                run.ended,
                encode_safe(run.spec).decode(),
                run.run_dir,
                encode_safe(run.members).decode(),
                None if run.preflight is None else encode_safe(run.preflight).decode(),
                None if run.env is None else encode_safe(run.env).decode(),
                encode_safe(run.alerts).decode(),
            ),
        )
        item: tuple[str, str | None, dict[str, Any]] = (
            "run_created",
            run.id,
            {"state": run.state, "spec": msgspec.to_builtins(run.spec), "name": run.name},
        )
        return stmt, item

    def _create_op(self, run: RunInfo) -> _Op:
        stmt, item = self._create_stmt(run)
        return self._submit([stmt], [item], fail_fast=True, ts=run.created, new_run=run)

    def create_run(self, run: RunInfo) -> Event:
        """Record a new run and its ``run_created`` event in one transaction; returns once it is on disk (blocking).

        A launch must not start what is not recorded, so this waits for the commit and raises StorageError when it
        fails. On the event loop prefer ``await durable_create_run(run)``.
        """
        op = self._create_op(run)
        self._result(op, DURABLE_TIMEOUT_S)
        return op.events[0]

    async def durable_create_run(self, run: RunInfo) -> Event:
        """``create_run`` without blocking the event loop: returns once the record is on disk; StorageError if not."""
        op = self._create_op(run)
        await asyncio.wrap_future(op.fut)
        return op.events[0]

    def _update_op(
        self, run_id: str, event_kind: str | None, event_data: dict[str, Any] | None, fields: dict[str, Any], fail_fast: bool
    ) -> _Op:
        bad = set(fields) - set(_RUN_FIELDS)
        if bad:
            raise ValueError(f"unknown run fields {bad}")
        values = []
        for key, value in fields.items():
            if key in _STRUCT_FIELDS:
                value = None if value is None else encode_safe(value).decode()
            elif isinstance(value, str):
                value = scrub_text(value)  # SQLite (UTF-8) cannot bind a lone surrogate
            values.append(value)
        stmts = []
        if fields:
            sets = ", ".join(f"{k}=?" for k in fields)
            stmts.append((f"UPDATE runs SET {sets} WHERE id=?", (*values, run_id)))
        items: list[tuple[str, str | None, dict[str, Any]]] = [(event_kind, run_id, event_data or {})] if event_kind else []
        return self._submit(stmts, items, fail_fast=fail_fast, run_fields=(run_id, dict(fields)) if fields else None)

    def update_run(
        self, run_id: str, event_kind: str | None = None, event_data: dict[str, Any] | None = None, **fields: Any
    ) -> Event | None:
        """Queue a change of a run's fields and (optionally) an event, committed atomically."""
        op = self._update_op(run_id, event_kind, event_data, fields, fail_fast=False)
        return op.events[0] if op.events else None

    async def durable_update_run(
        self, run_id: str, event_kind: str | None = None, event_data: dict[str, Any] | None = None, **fields: Any
    ) -> Event | None:
        """``update_run``, returning once it is on disk (without blocking the loop); StorageError if it cannot be."""
        op = self._update_op(run_id, event_kind, event_data, fields, fail_fast=True)
        await asyncio.wrap_future(op.fut)
        return op.events[0] if op.events else None

    def _overlay(self) -> tuple[dict[str, dict[str, Any]], dict[str, RunInfo]]:
        """Queued run changes, copied BEFORE a read (so a commit between the copy and the read loses nothing)."""
        with self._plock:
            fields = {rid: {k: v for k, (_n, v) in ov.items()} for rid, ov in self._ov_fields.items()}
            new = {rid: msgspec.structs.replace(r) for rid, (_n, r) in self._ov_new.items()}
        return fields, new

    @staticmethod
    def _apply(run: RunInfo, fields: dict[str, dict[str, Any]]) -> RunInfo:
        for k, v in fields.get(run.id, {}).items():
            setattr(run, k, v)
        return run

    def _select(self, sql: str, params: tuple) -> list[tuple]:
        """A read; a file found corrupt under it wakes the writer to mend it and fails as a StorageError (typed)."""
        try:
            with self._rlock:
                return self._rconn.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            if _is_corrupt(exc):
                with self._cond:
                    self._suspect = True
                    self._cond.notify()
            raise _storage_error(exc, self.path) from exc

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
        fields, new = self._overlay()
        rows = self._select(f"SELECT {self._COLS} FROM runs WHERE id=?", (run_id,))
        run = self._row_to_run(rows[0]) if rows else new.get(run_id)
        return self._apply(run, fields) if run is not None else None

    def find_runs(self, prefix: str) -> list[RunInfo]:
        """Runs whose id starts with ``prefix`` or whose name equals it."""
        fields, new = self._overlay()
        rows = self._select(
            f"SELECT {self._COLS} FROM runs WHERE id LIKE ? ESCAPE '\\' OR name=? ORDER BY created DESC",
            (prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%", prefix),
        )
        runs = [self._apply(self._row_to_run(r), fields) for r in rows]
        have = {r.id for r in runs}
        extra = [self._apply(r, fields) for rid, r in new.items() if rid not in have and (rid.startswith(prefix) or r.name == prefix)]
        return sorted(runs + extra, key=lambda r: -r.created) if extra else runs

    def run_by_request(self, request_id: str) -> RunInfo | None:
        """The run a Launch with this request_id created, if any."""
        fields, new = self._overlay()
        rows = self._select(f"SELECT {self._COLS} FROM runs WHERE request_id=?", (request_id,))
        run = self._row_to_run(rows[0]) if rows else next((r for r in new.values() if r.request_id == request_id), None)
        return self._apply(run, fields) if run is not None else None

    def list_runs(self, limit: int = 1000, states: frozenset[str] | None = None) -> list[RunInfo]:
        """Runs, newest first, optionally only those in ``states``."""
        fields, new = self._overlay()
        if states:
            marks = ",".join("?" * len(states))
            rows = self._select(
                f"SELECT {self._COLS} FROM runs WHERE state IN ({marks}) ORDER BY created DESC LIMIT ?", (*sorted(states), limit)
            )
        else:
            rows = self._select(f"SELECT {self._COLS} FROM runs ORDER BY created DESC LIMIT ?", (limit,))
        runs = [self._apply(self._row_to_run(r), fields) for r in rows]
        if not fields and not new:
            return runs
        # queued changes may move runs into or out of ``states``, and queued creates are not in the table yet
        have = {r.id for r in runs}
        moved = [rid for rid, f in fields.items() if rid not in have and "state" in f and rid not in new]
        if states and moved:
            marks = ",".join("?" * len(moved))
            runs += [
                self._apply(self._row_to_run(r), fields)
                for r in self._select(f"SELECT {self._COLS} FROM runs WHERE id IN ({marks})", tuple(moved))
            ]
        runs += [self._apply(r, fields) for rid, r in new.items() if rid not in have]
        if states:
            runs = [r for r in runs if r.state in states]
        runs.sort(key=lambda r: -r.created)
        return runs[:limit]

    def throughput_baseline(self, config_hash: str, world_size: int | None, exclude: str, min_points: int = 5) -> tuple[str, float] | None:
        """(run id, median tokens/s) of the newest other run with this config hash (and world size) that has enough steps."""
        with self._rlock:
            rows = self._rconn.execute(
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
                    for r in self._rconn.execute(
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
        with self._rlock:
            return self._rconn.execute("PRAGMA integrity_check").fetchone()[0]
