"""Provides the console's run history: a SQLite replica of every agent's journal (sqlite-utils).

Each agent numbers its events by ``(epoch, seq)`` with no gaps. The console
pulls the events after the last ``seq`` it holds for a host's current epoch
and inserts them with ``(host, epoch, seq)`` unique, so a reconnect or a
replay never duplicates anything; the ``runs`` table is rebuilt from events as
they are inserted, once each. A new epoch (the agent's journal was recreated)
is recorded in ``epochs`` and starts its own sequence: nothing is merged
blindly.

Writes go through one writer thread that commits whatever has queued up in a
single transaction, so the UI's event loop never waits on SQLite and hundreds
of hosts cost one commit per batch, not one per event.

The file is plain SQLite: ``sqlite-utils`` and ``datasette`` work on it as
they are (schema in README.md, "History").
"""

from __future__ import annotations

import asyncio
import json
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gpudeck.agents.wire import paths
from gpudeck.agents.wire.causes import cause_class
from gpudeck.agents.wire.protocol import TERMINAL_STATES, Event
from gpudeck.console.core import config
from gpudeck.console.core.records import EpochRecord, EventRecord, HostRecord, MetricPoint, Problem, RunRecord, loads
from gpudeck.console.history import ledger_index, quarantine, sqlite_lib
from gpudeck.console.history.query import compile_query, compile_terms

if TYPE_CHECKING:
    import sqlite_utils

SCHEMA_VERSION = 1
MAX_MEMBERS = 256  # members kept per run row (the events keep all of them)
_RUN_COLUMNS = {
    "host": str,
    "id": str,
    "epoch": str,
    "name": str,
    "kind": str,
    "state": str,
    "cause": str,
    "cause_class": str,
    "exit_code": int,
    "signal": str,
    "created": float,
    "started": float,
    "ended": float,
    "updated": float,
    "operator": str,
    "parent": str,
    "start": str,
    "cwd": str,
    "gpus": str,  # JSON list
    "argv": str,  # JSON list
    "spec": str,  # JSON
    "env": str,  # JSON: the environment fingerprint
    "env_hash": str,
    "env_torch": str,
    "members": str,  # JSON list
    "ranks_seen": int,
    "params_total": int,
    "world_size": int,
    "config_hash": str,
    "dataset_samples": int,
    "dataset_tokens": int,
    "last_step": int,
    "last_loss": float,
    "tokens_per_s": float,
    "mfu": float,
    "mem_peak_gib": float,
    "last_checkpoint": int,
    "tau": float,
    "final_step": int,
    "error": str,
    "telemetry": str,  # JSON: the last record of each type
    "alerts": str,  # JSON list
    "alert_count": int,
    "preflight": str,  # JSON
    "stop": str,  # JSON: the verified stop result
    "claims": str,  # JSON: claimed vs observed rows, as recorded when the run ended
}


WRITE_TXN_EVENTS = 20_000  # events in one write transaction at most (about a second on a loaded 2-core machine)


class HistoryError(Exception):
    """The history cannot answer (unknown or ambiguous run); the message says what to do."""


@dataclass(frozen=True)
class Cursor:
    """Where a host's replica stands: the agent epoch and the last seq held for it."""

    host: str
    epoch: str
    last_seq: int
    new_epoch: bool = False  # this epoch was not seen before (first contact, or the journal was recreated)


def _j(value: Any) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))


_encode = msgspec.json.Encoder().encode
JOB_TIMEOUT_S = 120.0  # a cursor, link-state note or pending stop queued for the writer: past this, a typed HistoryError


def _data_text(data: dict[str, Any]) -> str:
    """An event's data as the history stores it, for data that passed :func:`quarantine.check_event`: msgspec's
    encoder (several times faster than the stdlib's), unless the text is not ASCII, where the stdlib's escapes
    keep every stored row ASCII as before (no raw control characters of other scripts in a column)."""
    try:
        raw = _encode(data)
    except (msgspec.EncodeError, TypeError, OverflowError, ValueError):
        return _j(data)
    return raw.decode() if raw.isascii() else _j(data)


# what refuses one event: it is quarantined by itself (console/history/quarantine.py)
_REFUSED = (quarantine.BadEvent, sqlite3.Error, OverflowError, ValueError, TypeError, AttributeError, KeyError, RecursionError)


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10.0)
    conn.execute("PRAGMA busy_timeout=10000")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # a replica: anything lost in a power cut is pulled again
    return conn


# what ensure_schema makes: the tables, and the indexes (sqlite-utils names each idx_<table>_<columns>)
_TABLES = ("hosts", "epochs", "events", "runs", "metrics", "meta", "pending_stops", "quarantine", *ledger_index.TABLES)
_EVENT_INDEX = ["host", "run_id", "seq"]
_RUN_INDEXES = (["id"], ["state"], ["created"], ["cause_class"], ["config_hash"])
_INDEXES = (
    *(f"idx_{table}_{'_'.join(cols)}" for table, cols in [("events", _EVENT_INDEX), *(("runs", c) for c in _RUN_INDEXES)]),
    *ledger_index.INDEXES,
)


def schema_current(conn: sqlite3.Connection) -> bool:
    """Whether the file already has everything :func:`ensure_schema` makes, so it would change nothing.

    Read with plain sqlite3: a history whose schema is current never imports sqlite-utils (``sqlite_lib``)."""
    have = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")}
    if not have.issuperset(_TABLES) or not have.issuperset(_INDEXES):
        return False
    columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    if not columns.issuperset(_RUN_COLUMNS):
        return False
    return conn.execute("SELECT 1 FROM meta WHERE key = 'schema_version'").fetchone() is not None


def ensure_schema(db: sqlite_utils.Database) -> None:
    """Create the tables and indexes (idempotent)."""
    db.table("hosts").create(
        {
            "name": str,
            "epoch": str,
            "first_seen": float,
            "last_seen": float,
            "agent_version": str,
            "agent_host": str,
            "state": str,
            "error": str,
        },
        pk="name",
        if_not_exists=True,
    )
    db.table("epochs").create(
        {"host": str, "epoch": str, "first_seen": float, "last_seq": int, "replaces": str}, pk=("host", "epoch"), if_not_exists=True
    )
    db.table("events").create(
        {"host": str, "epoch": str, "seq": int, "ts": float, "kind": str, "run_id": str, "data": str},
        pk=("host", "epoch", "seq"),
        if_not_exists=True,
    )
    db.table("events").create_index(_EVENT_INDEX, if_not_exists=True)
    db.table("runs").create(_RUN_COLUMNS, pk=("host", "id"), if_not_exists=True)
    have = set(db["runs"].columns_dict)
    for col, typ in _RUN_COLUMNS.items():  # a history made by an older gpudeck gains the new columns
        if col not in have:
            db.table("runs").add_column(col, typ)
    for cols in _RUN_INDEXES:
        db.table("runs").create_index(cols, if_not_exists=True)
    db.table("metrics").create(
        {"host": str, "run_id": str, "step": int, "ts": float, "loss": float, "tokens_per_s": float, "mfu": float, "mem_peak_gib": float},
        pk=("host", "run_id", "step"),
        if_not_exists=True,
    )
    db.table("meta").create({"key": str, "value": str}, pk="key", if_not_exists=True)
    db.table("pending_stops").create(
        {"host": str, "run_id": str, "grace_s": float, "requested": float}, pk=("host", "run_id"), if_not_exists=True
    )
    quarantine.create_table(db.conn)
    ledger_index.create_tables(db.conn)
    db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])


@dataclass
class _RunFold:
    """A run row's telemetry columns as the events of one batch leave them, written once when the batch ends."""

    telemetry: dict[str, Any]  # the last record of each type
    mem_peak_gib: float | None
    fields: dict[str, Any]  # column -> value, the last one set
    ts: float = 0.0


class _Apply:
    """Folds one newly inserted event into the ``runs`` and ``metrics`` tables.

    With ``defer`` set (a host's batch going in whole), a run's telemetry (most of a busy host's journal: a step
    record every 10 s) is folded in memory and its ``runs`` row written once, at :meth:`flush`, instead of read,
    decoded, encoded and written again for every event (issue 33: that was most of the history writer's time while
    a fleet's backlog went in). Any other event flushes first, so every handler reads the row as the events before
    it left it."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.c = conn
        self.defer = False
        self._held: dict[tuple[str, str], _RunFold] = {}

    def __call__(self, host: str, epoch: str, ev: Event) -> None:
        if ev.kind == "gpu_hold":  # the GPU ledger: folded into its own index (console/history/ledger_index.py)
            ledger_index.fold(self.c, host, epoch, ev.ts, ev.data)
            return
        fn = getattr(self, f"_on_{ev.kind}", None)
        if fn is not None and ev.run_id:
            if self._held and ev.kind != "telemetry":
                self.flush()
            fn(host, epoch, ev)

    def flush(self) -> None:
        """Write the runs rows whose telemetry is held in memory."""
        held, self._held = self._held, {}
        for (host, run_id), fold in held.items():
            self._update(host, run_id, fold.ts, telemetry=_j(fold.telemetry), **fold.fields)

    def drop(self) -> None:
        """Forget what is held (the batch it came from was rolled back)."""
        self._held = {}

    def _update(self, host: str, run_id: str, ts: float, **fields: Any) -> None:
        cols = [k for k in fields if k in _RUN_COLUMNS]
        sets = ", ".join(f"{k}=?" for k in cols)
        self.c.execute(f"UPDATE runs SET {sets}, updated=? WHERE host=? AND id=?", [*(fields[k] for k in cols), ts, host, run_id])

    def _row(self, host: str, run_id: str, cols: str) -> tuple | None:
        return self.c.execute(f"SELECT {cols} FROM runs WHERE host=? AND id=?", (host, run_id)).fetchone()

    def _on_run_created(self, host: str, epoch: str, ev: Event) -> None:
        d = ev.data
        spec = d.get("spec") or {}
        self.c.execute(
            "INSERT OR IGNORE INTO runs(host, id, epoch, name, kind, state, created, updated, operator, parent, start, cwd, gpus, argv, spec,"
            " members, ranks_seen, alerts, alert_count) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,'[]',0,'[]',0)",
            (
                host,
                ev.run_id,
                epoch,
                d.get("name") or spec.get("name"),
                spec.get("kind", "command"),
                d.get("state", "starting"),
                ev.ts,
                ev.ts,
                spec.get("operator"),
                spec.get("parent"),
                spec.get("start"),
                spec.get("cwd"),
                _j(spec.get("gpus")) if spec.get("gpus") is not None else None,
                _j(spec.get("argv", [])),
                _j(spec),
            ),
        )

    def _on_run_state(self, host: str, epoch: str, ev: Event) -> None:
        d = ev.data
        state = d.get("state")
        if not state:
            return
        fields: dict[str, object] = {"state": state}  # column -> value
        for k in ("cause", "exit_code", "signal"):
            if k in d:
                fields[k] = d[k]
        if state == "running":
            row = self._row(host, ev.run_id or "", "started, members, argv")
            if row is not None and row[0] is None:
                fields["started"] = d.get("started", ev.ts)
            pid = d.get("pid")
            if row is not None and pid is not None:
                # the process the agent started heads the members list (the "members" events name only the ones
                # found under it)
                members = loads(row[1], [])
                if not any(m.get("pid") == pid for m in members):
                    members.insert(0, {"pid": pid, "role": "leader", "rank": None, "local_rank": None, "cmdline": loads(row[2], [])[:8]})
                    fields["members"] = _j(members)
        if state in TERMINAL_STATES:
            fields["ended"] = d.get("ended", ev.ts)
            fields["cause_class"] = d.get("cause_class") or cause_class(state, d.get("cause"))
            if not d.get("lingering"):  # ended with nothing left behind: a stop waiting for this host has nothing to do
                # (one delivered by a short-lived `gpudeck` call could end with the process before it was marked done)
                self.c.execute("DELETE FROM pending_stops WHERE host=? AND run_id=?", (host, ev.run_id or ""))
        if "stop" in d:
            fields["stop"] = _j(d["stop"])
        self._update(host, ev.run_id or "", ev.ts, **fields)

    def _on_run_adopted(self, host: str, epoch: str, ev: Event) -> None:
        state = ev.data.get("state")
        if state:
            self._update(host, ev.run_id or "", ev.ts, state=state)

    def _on_members(self, host: str, epoch: str, ev: Event) -> None:
        row = self._row(host, ev.run_id or "", "members")
        if row is None:
            return
        members = loads(row[0], [])
        updated = {m.get("pid"): m for m in ev.data.get("updated", [])}  # a member first read before its exec
        if updated:
            members = [updated.pop(m.get("pid"), m) for m in members]
            members.extend(updated.values())  # not held here (past MAX_MEMBERS): kept as news
        members.extend(ev.data.get("added", []))
        if len(members) > MAX_MEMBERS:  # the leader stays; of the rest, the newest
            lead = [m for m in members if m.get("role") == "leader"]
            rest = [m for m in members if m.get("role") != "leader"]
            members = lead + rest[len(rest) - (MAX_MEMBERS - len(lead)) :]
        ranks = {m.get("rank") for m in members if m.get("rank") is not None}
        self._update(host, ev.run_id or "", ev.ts, members=_j(members), ranks_seen=len(ranks))

    def _on_telemetry(self, host: str, epoch: str, ev: Event) -> None:
        rec = ev.data.get("record") or {}
        kind = rec.get("type")
        rid = ev.run_id or ""
        fold = self._held.get((host, rid))
        if fold is None:
            row = self._row(host, rid, "telemetry, mem_peak_gib")
            if row is None:
                return
            fold = _RunFold(loads(row[0], {}), row[1], {})
        fold.telemetry[str(kind)] = rec
        fields = fold.fields
        if kind == "manifest":
            for k in ("params_total", "world_size", "config_hash", "dataset_samples", "dataset_tokens"):
                if rec.get(k) is not None:
                    fields[k] = rec[k]
        elif kind == "step":
            step = rec.get("step")
            fields.update(last_step=step, last_loss=rec.get("loss"), tokens_per_s=rec.get("tokens_per_s"), mfu=rec.get("mfu"))
            peak = rec.get("mem_peak_gib")
            if isinstance(peak, (int, float)):
                fold.mem_peak_gib = fields["mem_peak_gib"] = max(peak, fold.mem_peak_gib or 0.0)
            if isinstance(step, int):
                self.c.execute(
                    "INSERT OR REPLACE INTO metrics(host, run_id, step, ts, loss, tokens_per_s, mfu, mem_peak_gib) VALUES (?,?,?,?,?,?,?,?)",
                    (host, rid, step, rec.get("ts", ev.ts), rec.get("loss"), rec.get("tokens_per_s"), rec.get("mfu"), peak),
                )
        elif kind == "checkpoint":
            fields["last_checkpoint"] = rec.get("step")
        elif kind == "eval":
            if rec.get("tau") is not None:
                fields["tau"] = rec["tau"]
        elif kind == "done":
            fields["final_step"] = rec.get("final_step")
        elif kind == "error":
            fields["error"] = str(rec.get("message"))[:2000]
        fold.ts = ev.ts
        if self.defer:
            self._held[(host, rid)] = fold
        else:
            self._update(host, rid, ev.ts, telemetry=_j(fold.telemetry), **fields)

    def _on_alert(self, host: str, epoch: str, ev: Event) -> None:
        row = self._row(host, ev.run_id or "", "alerts")
        if row is None:
            return
        alerts = loads(row[0], [])
        alert = ev.data.get("alert", ev.data)
        alerts.append(alert)
        self._update(host, ev.run_id or "", ev.ts, alerts=_j(alerts[-100:]), alert_count=len(alerts))

    def _on_alert_cleared(self, host: str, epoch: str, ev: Event) -> None:
        row = self._row(host, ev.run_id or "", "alerts")
        if row is None:
            return
        cleared = ev.data.get("alert", {})
        alerts = loads(row[0], [])
        for a in alerts:
            if a.get("kind") == cleared.get("kind") and a.get("ts") == cleared.get("ts"):
                a["cleared"] = cleared.get("cleared", ev.ts)
        self._update(host, ev.run_id or "", ev.ts, alerts=_j(alerts))

    def _on_claims(self, host: str, epoch: str, ev: Event) -> None:
        self._update(host, ev.run_id or "", ev.ts, claims=_j(ev.data.get("rows", [])))

    def _on_preflight(self, host: str, epoch: str, ev: Event) -> None:
        self._update(host, ev.run_id or "", ev.ts, preflight=_j(ev.data.get("result", ev.data)))

    def _on_env_fingerprint(self, host: str, epoch: str, ev: Event) -> None:
        env = ev.data.get("env", ev.data)
        self._update(host, ev.run_id or "", ev.ts, env=_j(env), env_hash=env.get("freeze_hash"), env_torch=env.get("torch"))


@dataclass
class _Batch:
    host: str
    epoch: str
    events: list[Event]
    done: Future


@dataclass
class _Job:
    """A write other than events (a host's cursor, its link state, a pending stop), run by the writer thread between
    its transactions: the console's writes never wait on one another's SQLite lock. Before, they went through the
    reader's connection and waited for the writer's lock; with a backlog queued the writer began its next transaction
    at once, and a host's cursor or link-state note could wait out the 10 s busy timeout ("database is locked":
    issue 33, the restarting host whose link never came back)."""

    fn: Callable[[sqlite3.Connection], Any]
    done: Future


def _settle(fut: Future, result: Any = 0, exception: BaseException | None = None) -> None:
    """Give a waiter its answer unless it stopped waiting: a caller that timed out cancels its future (asyncio's
    wrap_future), and set_result on a cancelled one raises, which ended the writer thread and left every later write
    of the history waiting forever (found by make test-under-load). The batch itself is committed either way."""
    try:
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def _cursor(c: sqlite3.Connection, host: str, epoch: str, agent_version: str | None, agent_host: str | None) -> Cursor:
    now = time.time()
    c.execute("BEGIN IMMEDIATE")
    try:
        row = c.execute("SELECT last_seq FROM epochs WHERE host=? AND epoch=?", (host, epoch)).fetchone()
        prev = c.execute("SELECT epoch FROM hosts WHERE name=?", (host,)).fetchone()
        new = row is None
        if new:
            replaces = prev[0] if prev and prev[0] and prev[0] != epoch else None
            c.execute("INSERT INTO epochs(host, epoch, first_seen, last_seq, replaces) VALUES (?,?,?,0,?)", (host, epoch, now, replaces))
        # the epoch table's last_seq can lag a crash; the events themselves are the truth
        last = c.execute("SELECT MAX(seq) FROM events WHERE host=? AND epoch=?", (host, epoch)).fetchone()[0] or 0
        held = c.execute("SELECT MAX(seq) FROM quarantine WHERE host=? AND epoch=?", (host, epoch)).fetchone()[0] or 0
        last = max(last, held)  # a quarantined event is not pulled again
        c.execute(
            "INSERT INTO hosts(name, epoch, first_seen, last_seen, agent_version, agent_host, state) VALUES (?,?,?,?,?,?,'up')"
            " ON CONFLICT(name) DO UPDATE SET epoch=excluded.epoch, last_seen=excluded.last_seen, agent_version=excluded.agent_version,"
            " agent_host=excluded.agent_host, state='up', error=NULL",
            (host, epoch, now, now, agent_version, agent_host),
        )
        c.execute("COMMIT")
    except BaseException:
        c.execute("ROLLBACK")
        raise
    return Cursor(host=host, epoch=epoch, last_seq=int(last), new_epoch=new)


class History:
    """The console's history database; safe to use from any thread and from asyncio."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path or config.history_path())
        try:
            # private whatever the umask (it holds every run's --env), reached without following links
            paths.ensure_private_dir(self.path.parent)
            paths.private_file(self.path)
            self._read_conn = _connect(self.path)
            if not schema_current(self._read_conn):  # a new file, or one an older gpudeck made
                ensure_schema(sqlite_lib.load().Database(self._read_conn))
        except paths.UnsafePath as exc:
            raise HistoryError(f"cannot open the history {self.path}: {exc.message}") from None
        except (sqlite3.Error, OSError) as exc:
            raise HistoryError(
                f"cannot open the history {self.path} ({exc}): free space in {self.path.parent} or fix its permissions "
                f"(GPUDECK_HOME={config.home() or 'unset'})"
            ) from None
        self._read_lock = threading.Lock()
        self._q: queue.Queue[_Batch | _Job | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._closed = False
        self._put_lock = threading.Lock()  # guards _closed, the writer's start and the queue's end mark
        self.batches_committed = 0  # transactions
        self.host_batches = 0  # hosts' batches written (several to a transaction)
        self.events_inserted = 0
        self.events_quarantined = 0

    # ------------------------------------------------------------------ writer

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="history-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        conn = _connect(self.path)
        apply = _Apply(conn)
        job: _Job | None = None  # met while gathering a transaction: run right after it
        while True:
            item = job or self._q.get()
            job = None
            if item is None:
                break
            if isinstance(item, _Job):
                if not item.done.set_running_or_notify_cancel():
                    continue  # its caller gave up waiting and was told it was not written (_run_job): do not write it now
                try:
                    _settle(item.done, result=item.fn(conn))
                except Exception as exc:  # the caller gets it; the writer keeps going
                    _settle(item.done, exception=exc)
                continue
            batch = [item]
            # whatever else queued up meanwhile goes into the same transaction, up to WRITE_TXN_EVENTS events: a longer
            # one holds the write lock past the busy timeout of another process reading or writing the file
            events = len(item.events)
            while len(batch) < 512 and events < WRITE_TXN_EVENTS:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                if isinstance(nxt, _Job):
                    job = nxt
                    break
                batch.append(nxt)
                events += len(nxt.events)
            try:
                counts = self._commit(conn, apply, batch)
            except Exception as exc:  # report to every waiter; the writer keeps going
                for b in batch:
                    _settle(b.done, exception=exc)
                continue
            for b, n in zip(batch, counts):
                _settle(b.done, result=n)
        conn.close()

    def _run_job(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``fn(connection)`` on the writer thread and return what it returns (raises what it raises)."""
        fut: Future = Future()
        self._enqueue(_Job(fn, fut))
        try:
            return fut.result(timeout=JOB_TIMEOUT_S)
        except FutureTimeout:  # a wedged writer (a disk that stopped answering) must not hang a host's link for good
            # not started yet: dropped, so that what the caller is told (not written) stays true; started: it may land
            fate = "it was not written" if fut.cancel() else "it is being written and may still land"
            raise HistoryError(
                f"the history's writer did not get to this within {JOB_TIMEOUT_S:g} s ({fate}): is the disk of {self.path} "
                "answering, or another process holding history.db? (the sync goes on from its cursor once it does)"
            ) from None

    def _enqueue(self, item: _Batch | _Job) -> None:
        """Queue for the one writer thread, started the first time. Under a lock: jobs come from several threads at
        once (a fleet's hosts connecting), and nothing may be queued behind close()'s end mark, where no one would
        ever answer it."""
        with self._put_lock:
            if self._closed:
                raise HistoryError("the history is closed")
            self._start_writer()
            self._q.put(item)

    def _commit(self, conn: sqlite3.Connection, apply: _Apply, batch: list[_Batch]) -> list[int]:
        counts: list[int] = []
        conn.execute("BEGIN IMMEDIATE")
        try:
            for b in batch:
                n, last = self._put_whole(conn, apply, b)
                if n is None:  # something in it is refused: event by event, the refused ones quarantined
                    n, last = self._put_each(conn, apply, b)
                if last is not None:
                    conn.execute("UPDATE epochs SET last_seq=MAX(last_seq, ?) WHERE host=? AND epoch=?", (last, b.host, b.epoch))
                counts.append(n)
            conn.execute("COMMIT")
        except BaseException:
            apply.drop()
            conn.execute("ROLLBACK")
            raise
        self.batches_committed += 1
        self.host_batches += len(batch)
        self.events_inserted += sum(counts)
        return counts

    def _put_whole(self, conn: sqlite3.Connection, apply: _Apply, b: _Batch) -> tuple[int | None, int | None]:
        """One host's batch in one savepoint, its runs' telemetry folded in memory (see :class:`_Apply`): two
        statements for a step record instead of six. (None, None) when any event is refused: the savepoint is rolled
        back and the caller puts the batch in event by event."""
        conn.execute("SAVEPOINT host_batch")
        apply.defer = True
        n = 0
        last: int | None = None
        try:
            for ev in b.events:
                quarantine.check_event(ev)
                cur = conn.execute(
                    "INSERT OR IGNORE INTO events(host, epoch, seq, ts, kind, run_id, data) VALUES (?,?,?,?,?,?,?)",
                    (b.host, b.epoch, ev.seq, ev.ts, ev.kind, ev.run_id, _data_text(ev.data)),
                )
                if cur.rowcount == 1:
                    n += 1
                    apply(b.host, b.epoch, ev)
                last = ev.seq if last is None else max(last, ev.seq)
            apply.flush()
        except _REFUSED:
            apply.drop()
            conn.execute("ROLLBACK TO host_batch")
            conn.execute("RELEASE host_batch")
            return None, None
        finally:
            apply.defer = False
        conn.execute("RELEASE host_batch")
        return n, last

    def _put_each(self, conn: sqlite3.Connection, apply: _Apply, b: _Batch) -> tuple[int, int | None]:
        """One host's batch event by event: one that fails validation, or that SQLite refuses while it is folded into
        the runs table, is quarantined raw and the rest of the batch goes in (console/history/quarantine.py)."""
        n = 0
        last: int | None = None
        for ev in b.events:
            conn.execute("SAVEPOINT one_event")
            try:
                quarantine.check_event(ev)
                cur = conn.execute(
                    "INSERT OR IGNORE INTO events(host, epoch, seq, ts, kind, run_id, data) VALUES (?,?,?,?,?,?,?)",
                    (b.host, b.epoch, ev.seq, ev.ts, ev.kind, ev.run_id, _j(ev.data)),
                )
                if cur.rowcount == 1:  # new to the replica: fold it into the run once
                    n += 1
                    apply(b.host, b.epoch, ev)
            except _REFUSED as exc:
                conn.execute("ROLLBACK TO one_event")
                quarantine.put(
                    conn,
                    b.host,
                    b.epoch,
                    ev,
                    f"{type(exc).__name__}: {exc}" if not isinstance(exc, quarantine.BadEvent) else str(exc),
                )
                self.events_quarantined += 1
            conn.execute("RELEASE one_event")
            if isinstance(ev.seq, int) and 0 < ev.seq <= quarantine.INT_MAX:
                last = ev.seq if last is None else max(last, ev.seq)
        return n, last

    def submit(self, host: str, epoch: str, events: list[Event]) -> Future:
        """Queue events for the writer; the future gives how many were new."""
        fut: Future = Future()
        self._enqueue(_Batch(host, epoch, list(events), fut))
        return fut

    async def ingest(self, host: str, epoch: str, events: list[Event]) -> int:
        """Insert events (idempotent); returns how many were new. Does not block the event loop."""
        return await asyncio.wrap_future(self.submit(host, epoch, events))

    def close(self) -> None:
        """Finish queued writes and close."""
        with self._put_lock:
            if self._closed:
                return
            self._closed = True
            writer = self._writer
            if writer is not None:
                self._q.put(None)
        if writer is not None:
            writer.join(30)
        with self._read_lock:
            self._read_conn.close()

    # ------------------------------------------------------------------ hosts and cursors

    def _exec(self, sql: str, params: tuple | list = ()) -> list[tuple]:
        with self._read_lock:
            return self._read_conn.execute(sql, params).fetchall()

    def cursor(self, host: str, epoch: str, agent_version: str | None = None, agent_host: str | None = None) -> Cursor:
        """Where to resume pulling ``host``'s events; records a new epoch the first time it is seen."""
        return self._run_job(lambda c: _cursor(c, host, epoch, agent_version, agent_host))

    def note_host(self, host: str, state: str, error: str | None = None) -> None:
        """Record a host's link state (shown by ``gpudeck history`` for hosts it could not reach)."""
        self._run_job(
            lambda c: c.execute(
                "INSERT INTO hosts(name, first_seen, state, error) VALUES (?,?,?,?) ON CONFLICT(name) DO UPDATE SET state=excluded.state, error=excluded.error",
                (host, time.time(), state, error),
            )
        )

    def add_pending_stop(self, host: str, run_id: str, grace_s: float) -> None:
        """Remember to stop ``run_id`` on ``host`` when it is reachable again."""
        self._run_job(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO pending_stops(host, run_id, grace_s, requested) VALUES (?,?,?,?)",
                (host, run_id, grace_s, time.time()),
            )
        )

    def pending_stops(self, host: str) -> list[tuple[str, float]]:
        """(run id, grace) of the stops waiting for ``host``."""
        return [
            (r[0], float(r[1])) for r in self._exec("SELECT run_id, grace_s FROM pending_stops WHERE host=? ORDER BY requested", (host,))
        ]

    def clear_pending_stop(self, host: str, run_id: str) -> None:
        """The stop was delivered."""
        self._run_job(lambda c: c.execute("DELETE FROM pending_stops WHERE host=? AND run_id=?", (host, run_id)))

    def epochs(self, host: str) -> list[EpochRecord]:
        """Every agent epoch seen for a host, oldest first."""
        rows = self._exec("SELECT epoch, first_seen, last_seq, replaces FROM epochs WHERE host=? ORDER BY first_seen", (host,))
        return [EpochRecord(*r) for r in rows]

    def hosts(self) -> list[HostRecord]:
        """Every host the history has heard of."""
        cols = ("name", "epoch", "first_seen", "last_seen", "agent_version", "agent_host", "state", "error")
        return [HostRecord(*r) for r in self._exec(f"SELECT {', '.join(cols)} FROM hosts ORDER BY name")]

    # ------------------------------------------------------------------ queries

    def query(self, text: str | Sequence[str] = "", now: float | None = None) -> list[RunRecord]:
        """Runs matching a filter (see console/history/query.py), newest first, each with its median tokens/s.

        ``text``: typed text (split shell-style), or the words themselves, each one term (the CLI's arguments)."""
        sql, params = (compile_query(text, now) if isinstance(text, str) else compile_terms(text, now)).sql()
        with self._read_lock:
            return add_tokens_median(self._read_conn, read_runs(self._read_conn.execute(sql, params)))

    def matches(self, ref: str, host: str | None = None) -> list[RunRecord]:
        """Every run whose id is ``ref``, starts with it, or whose name is it (the resolver picks: console/ops/resolve.py)."""
        esc = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        where = "(id = ? OR id LIKE ? ESCAPE '\\' OR name = ?)"
        params: list[object] = [ref, esc + "%", ref]
        if host:
            where += " AND host = ?"
            params.append(host)
        with self._read_lock:
            return read_runs(self._read_conn.execute(f"SELECT * FROM runs WHERE {where} ORDER BY created DESC", params))

    def find(self, ref: str, host: str | None = None, unanswered: list[str] | None = None, destructive: bool = False) -> RunRecord:
        """One run by id, unique id prefix or unique name; several matches are refused with the candidates (AmbiguousRun)."""
        from gpudeck.console.ops.resolve import resolve_record

        return resolve_record(self.matches(ref, host), ref, host, unanswered or [], destructive)

    def events(self, host: str, run_id: str, limit: int = 10000, kinds: Sequence[str] = ()) -> list[EventRecord]:
        """A run's events in order (only those of ``kinds`` when given: a long run's step telemetry left out)."""
        only = f" AND kind IN ({','.join('?' * len(kinds))})" if kinds else ""
        rows = self._exec(
            f"SELECT epoch, seq, ts, kind, data FROM events WHERE host=? AND run_id=?{only} ORDER BY epoch, seq LIMIT ?",
            (host, run_id, *kinds, limit),
        )
        return [EventRecord(r[0], r[1], r[2], r[3], loads(r[4], {})) for r in rows]

    def ledger_at(self, host: str, gpu: int | None, at: float, run: str | None = None) -> list[ledger_index.HoldRecord]:
        """The GPU ledger: the holds on a host (one GPU, or all) open at ``at``, with what each held then."""
        with self._read_lock:
            return ledger_index.held_at(self._read_conn, host, gpu, at, run)

    def ledger_between(
        self, host: str, gpu: int | None, since: float, until: float, run: str | None = None
    ) -> list[ledger_index.HoldRecord]:
        """The GPU ledger: the holds on a host (one GPU, or all) open at some time in ``[since, until]``."""
        with self._read_lock:
            return ledger_index.held_between(self._read_conn, host, gpu, since, until, run)

    def ledger_of_run(self, host: str | None, run_id: str) -> list[ledger_index.HoldRecord]:
        """The GPU ledger: every hold of one run (on one host, or all)."""
        with self._read_lock:
            return ledger_index.run_holds(self._read_conn, host, run_id)

    def recreations(self, host: str, epoch: str | None = None) -> list[dict[str, Any]]:
        """The host's ``journal_recreated`` events (its agent found its journal deleted, replaced or corrupt), oldest first."""
        sql = "SELECT epoch, ts, data FROM events WHERE host=? AND kind='journal_recreated'"
        params: tuple = (host,)
        if epoch is not None:
            sql, params = sql + " AND epoch=?", (host, epoch)
        rows = self._exec(sql + " ORDER BY ts", params)
        return [{"epoch": r[0], "ts": r[1], **loads(r[2], {})} for r in rows]

    def metrics(self, host: str, run_id: str) -> list[MetricPoint]:
        """A run's recorded step metrics."""
        rows = self._exec(
            "SELECT step, ts, loss, tokens_per_s, mfu, mem_peak_gib FROM metrics WHERE host=? AND run_id=? ORDER BY step", (host, run_id)
        )
        return [MetricPoint(*r) for r in rows]

    def event_count(self, host: str | None = None) -> int:
        """Events held (for one host or all)."""
        if host is None:
            return int(self._exec("SELECT COUNT(*) FROM events")[0][0])
        return int(self._exec("SELECT COUNT(*) FROM events WHERE host=?", (host,))[0][0])

    def problems(self, host: str | None = None) -> list[Problem]:
        """The events kept out of the history (quarantined), oldest first."""
        with self._read_lock:
            return quarantine.rows(self._read_conn, host)

    def seqs(self, host: str, epoch: str) -> list[int]:
        """Every seq held for one host and epoch, ascending (tests check for gaps and duplicates)."""
        return [r[0] for r in self._exec("SELECT seq FROM events WHERE host=? AND epoch=? ORDER BY seq", (host, epoch))]


def read_runs(cur: sqlite3.Cursor) -> list[RunRecord]:
    """The ``runs`` rows a query returned, as records (the JSON columns decoded)."""
    cols = [d[0] for d in cur.description]
    return [RunRecord.from_columns(dict(zip(cols, r))) for r in cur.fetchall()]


def add_tokens_median(conn: sqlite3.Connection, rows: list[RunRecord]) -> list[RunRecord]:
    """Each record with ``tokens_per_s_median``: the median over its recorded steps (what every view shows as tokens/s)."""
    import statistics

    if not rows:
        return rows
    want = {(r.host, r.id) for r in rows}
    values: dict[tuple[str, str], list[float]] = {}
    ids = sorted({r.id for r in rows})
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        q = f"SELECT host, run_id, tokens_per_s FROM metrics WHERE tokens_per_s IS NOT NULL AND run_id IN ({','.join('?' * len(chunk))})"
        for host, rid, tps in conn.execute(q, chunk).fetchall():
            if (host, rid) in want:
                values.setdefault((host, rid), []).append(float(tps))
    out = []
    for r in rows:
        vs = values.get((r.host, r.id))
        out.append(msgspec.structs.replace(r, tokens_per_s_median=statistics.median(vs) if vs else None))
    return out
