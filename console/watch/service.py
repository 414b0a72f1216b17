"""Provides the watcher: the long-lived process behind ``gpudeck watch``.

It follows the fleet exactly as the console does (one :class:`~gpudeck.console.fleet.fleet.Fleet` with the history, so
every agent's journal is pulled into ``history.db``), reads the history's new events in the order they arrived,
queues a notification for each (event, target) a rule picks in the outbox (console/watch/outbox.py), delivers
them through apprise, and serves the metrics endpoint when asked. One watcher per history: a second one is refused.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import json
import os
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudeck.agents.wire import paths
from gpudeck.console.core import config as cfg
from gpudeck.console.core import gcpolicy
from gpudeck.console.core.sanitize import terminal_text
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.fleet.transport import SshOptions
from gpudeck.console.history.replica import History
from gpudeck.console.ops.rank_death import attach as attach_rank_death
from gpudeck.console.watch import deliver
from gpudeck.console.watch.cli import DEFAULT_METRICS
from gpudeck.console.watch.metrics import FleetCollector, MetricsEndpoint, WatchHealth
from gpudeck.console.watch.outbox import Item, Outbox
from gpudeck.console.watch.rules import Rule, on_word, targets_for, unusable
from gpudeck.console.watch.targets import privacy_form

SCAN_BATCH = 1000
DEFAULT_INTERVAL_S = 5.0  # snapshots as often as Prometheus usually scrapes; events do not wait for them (they are long-polled)
# once the fleet is connected, the start-up heap is frozen and the collector left to its own (larger) thresholds:
# console/core/gcpolicy.py says why
SCAN_EVERY_S = 2.0  # the history is read at least this often (and at once after a sync brings events)
DELIVER_CHECK_S = 5.0
_KINDS = ("run_state", "alert")


class WatchError(Exception):
    """The watcher cannot start or run; the message says what to do."""


def outbox_path() -> Path:
    """The outbox, next to the history."""
    return cfg.history_path().parent / "watch.db"


def lock_path() -> Path:
    """The file a running watcher holds locked (it holds the watcher's pid)."""
    return cfg.history_path().parent / "watch.lock"


def running_pid() -> int | None:
    """The pid of the watcher running on this history, or None."""
    p = lock_path()
    if not p.exists():
        return None
    try:
        with open(p) as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                txt = fh.read().strip()
                return int(txt) if txt.isdigit() else -1
            fcntl.flock(fh, fcntl.LOCK_UN)
    except OSError:
        return None
    return None


def parse_address(text: str) -> tuple[str, int]:
    """``PORT``, ``HOST:PORT`` or ``[V6]:PORT`` as (address, port); WatchError says the form."""
    host, port = DEFAULT_METRICS[0], text
    if ":" in text:
        host, _, port = text.rpartition(":")
        host = host.strip("[]") or DEFAULT_METRICS[0]
    if not port.isdigit() or not 0 <= int(port) < 65536:  # 0: any free port (the log line names it)
        raise WatchError(f"--metrics {text!r}: give PORT or ADDRESS:PORT, e.g. --metrics 127.0.0.1:9464")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise WatchError(f"--metrics {text!r}: {host!r} is not an IP address; give one, e.g. 127.0.0.1:9464") from None
    return host, int(port)


def log(msg: str) -> None:
    """One line on stderr (the journal, under systemd)."""
    print(terminal_text(f"gpudeck watch: {msg}"), file=sys.stderr, flush=True)


@dataclass
class WatchOptions:
    """How to run: rules, where the metrics go (None: no endpoint), the snapshot interval, SSH options."""

    config: cfg.Config
    rules: list[Rule]
    metrics: tuple[str, int] | None = None
    interval_s: float = DEFAULT_INTERVAL_S
    expire_s: float | None = None
    ssh: SshOptions | None = None
    state_dir: Path | None = None


class Watcher:
    """Follows the fleet, queues and delivers notifications, serves metrics."""

    def __init__(self, opts: WatchOptions) -> None:
        self.opts = opts
        self.started = time.time()
        self.health = WatchHealth(started=self.started)
        self._lock_fh: Any = None
        self._scan_wake = asyncio.Event()
        self._deliver_wake = asyncio.Event()
        self._redacted: dict[str, str] = {}
        self.broken_rules: dict[int, str] = {}  # rules SQLite cannot evaluate (number -> why): skipped, the others go on
        self._told_broken: set[int] = set()
        self._in_flight: set[tuple[str, str]] = set()  # (event key, target) of attempts not answered yet
        self._flight_lock = threading.Lock()
        self.metrics_port: int | None = None
        self.fleet: Fleet | None = None  # set once run() has built it (the benchmark follows its links)

    def _take_lock(self) -> None:
        p = lock_path()
        paths.ensure_private_dir(p.parent)
        paths.private_file(p)
        fh = open(p, "r+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = fh.read().strip()
            fh.close()
            raise WatchError(f"another gpudeck watch (pid {other or '?'}) follows {cfg.history_path()}; one watcher per history") from None
        fh.truncate(0)
        fh.write(str(os.getpid()))
        fh.flush()
        self._lock_fh = fh

    def redact(self, url: str) -> str:
        """A target fit for the log: its privacy form (cached: apprise parses the URL)."""
        if url not in self._redacted:
            self._redacted[url] = privacy_form(url)
        return self._redacted[url]

    # ------------------------------------------------------------------ reading the history

    def _scan(self, conn: sqlite3.Connection, outbox: Outbox) -> int:
        """Queue what the history's new events call for; returns how many events were read."""
        cursor = outbox.cursor() or 0
        now = time.time()
        expire_s = outbox.expire_s
        conn.execute("BEGIN")  # one snapshot of the history: the cursor moves to what these reads saw
        try:
            top = conn.execute("SELECT MAX(rowid) FROM events").fetchone()[0] or 0
            if cursor > top:
                log(
                    f"the history {cfg.history_path()} is newer than the outbox's place in it: reading it from the start (delivered events are not sent again)"
                )
                cursor = 0
            kinds = ",".join("?" * len(_KINDS))
            rows = conn.execute(
                f"SELECT rowid, host, epoch, seq, ts, kind, run_id, data FROM events WHERE rowid > ? AND rowid <= ? AND kind IN ({kinds})"
                " ORDER BY rowid LIMIT ?",
                (cursor, top, *_KINDS, SCAN_BATCH),
            ).fetchall()
            new_cursor = rows[-1][0] if len(rows) == SCAN_BATCH else top
            items: list[Item] = []
            for _rowid, host, epoch, seq, ts, kind, run_id, data_json in rows:
                try:
                    data = json.loads(data_json or "{}")
                except ValueError:
                    continue
                if not isinstance(data, dict) or not run_id:
                    continue
                word = on_word(kind, data)
                if word is None or not isinstance(ts, (int, float)):
                    continue
                if now - ts > expire_s:
                    continue  # older than the expiry: it would be dropped undelivered anyway
                picks = targets_for(conn, self.opts.rules, word, host, run_id, self.broken_rules)
                if not picks:
                    continue
                run = self._run_row(conn, host, run_id)
                late = ts < self.started
                msg = deliver.compose(word, host, f"{host}/{epoch}/{seq}", run_id, ts, data, run, late)
                for target, rule in picks:
                    items.append(Item(host, epoch, seq, target, rule, word, run_id, msg.title, msg.body, msg.notify_type, late, ts))
        finally:
            conn.execute("COMMIT")
            self._tell_broken()
        if new_cursor != cursor or items or outbox.cursor() != new_cursor:
            new = outbox.enqueue(items, new_cursor)
            if new:
                log(f"queued {new} notification(s)")
                self._deliver_wake.set()
        self.health.events_read += len(rows)
        return len(rows)

    def _tell_broken(self) -> None:
        for number, why in self.broken_rules.items():
            if number not in self._told_broken:
                self._told_broken.add(number)
                log(f"[[notify]] number {number} is skipped: {why}; the other rules go on (`gpudeck watch --check` checks the rules)")

    @staticmethod
    def _run_row(conn: sqlite3.Connection, host: str, run_id: str) -> dict[str, Any]:
        cur = conn.execute("SELECT name, kind, state, cause, last_step, last_loss FROM runs WHERE host=? AND id=?", (host, run_id))
        row = cur.fetchone()
        return dict(zip([d[0] for d in cur.description], row)) if row else {}

    async def _scan_loop(self, conn: sqlite3.Connection, outbox: Outbox) -> None:
        while True:
            try:
                await asyncio.wait_for(self._scan_wake.wait(), SCAN_EVERY_S)
                await asyncio.sleep(0.1)  # let a burst of synced batches land: one read for all of them
            except TimeoutError:
                pass
            self._scan_wake.clear()
            try:
                while await asyncio.to_thread(self._scan, conn, outbox) == SCAN_BATCH:
                    pass
            except sqlite3.Error as exc:
                log(f"cannot read the history ({exc}); trying again in {SCAN_EVERY_S:.0f} s")

    # ------------------------------------------------------------------ delivery

    def _attempt(self, outbox: Outbox, it: Item) -> tuple[str, str | None, float]:
        """One delivery attempt and its record, in one worker thread: (outcome, why, seconds from apprise's return to the commit).

        The target's answer is written to the outbox as soon as apprise returns it, from the thread that sent it: no hop
        back to the event loop and no second thread between the two (the duplicate window after a kill -9 is this one
        commit). An attempt the loop stopped waiting for still records its own answer when it comes."""
        msg = deliver.Message(it.title, it.body, it.notify_type)
        try:
            try:
                why = deliver.send(it.target, msg)
            except deliver.UnusableTarget as exc:
                outbox.expire_item(it, str(exc))
                return "unusable", str(exc), 0.0
            t0 = time.perf_counter()
            if why is None:
                outbox.delivered(it)
                return "delivered", None, time.perf_counter() - t0
            outbox.failed(it, why)
            return "failed", why, time.perf_counter() - t0
        finally:
            with self._flight_lock:
                self._in_flight.discard((it.key, it.target))

    async def _send(self, outbox: Outbox, it: Item) -> None:
        with self._flight_lock:
            self._in_flight.add((it.key, it.target))
        task = asyncio.ensure_future(asyncio.to_thread(self._attempt, outbox, it))
        task.add_done_callback(lambda _t: self._deliver_wake.set())
        try:
            outcome, why, record_s = await asyncio.wait_for(asyncio.shield(task), deliver.SEND_TIMEOUT_S * 2)
        except TimeoutError:
            # not a failure: the attempt goes on in its thread and records what the target answers; the target gets
            # nothing else until then (marking it failed here would send it again while the first may still arrive)
            log(f"{self.redact(it.target)} has not answered within {deliver.SEND_TIMEOUT_S * 2:.0f} s; waiting for its answer to {it.key}")
            return
        if outcome == "unusable":
            log(f"{why}; event {it.key} dropped for it")
        elif outcome == "delivered":
            log(
                f"delivered {it.word} of {it.run_id} ({it.key}) to {self.redact(it.target)} (recorded {1000 * record_s:.1f} ms after the answer)"
            )
        else:
            log(f"{self.redact(it.target)} failed ({why}); retrying with backoff")

    async def _deliver_loop(self, outbox: Outbox) -> None:
        last_expire = 0.0
        while True:
            now = time.time()
            if now - last_expire > 60:
                last_expire = now
                n = await asyncio.to_thread(outbox.expire, now)
                if n:
                    log(f"{n} notification(s) expired undelivered (older than {outbox.expire_s / 3600:.0f} h)")
            due = await asyncio.to_thread(outbox.due)
            with self._flight_lock:  # an attempt still waiting for its target's answer is not made again
                due = [it for it in due if (it.key, it.target) not in self._in_flight]
            if due:
                await asyncio.gather(*(self._send(outbox, it) for it in due))  # one per target at a time, targets in parallel
            self.health.targets = await asyncio.to_thread(outbox.status)
            if due:
                continue
            nxt = await asyncio.to_thread(outbox.next_due)
            wait = DELIVER_CHECK_S if nxt is None else min(DELIVER_CHECK_S, max(0.05, nxt - time.time()))
            if self._in_flight:  # what is due may be an attempt still in flight: its answer wakes the loop (no 50 ms polling)
                wait = max(wait, 1.0)
            try:
                await asyncio.wait_for(self._deliver_wake.wait(), wait)
            except TimeoutError:
                pass
            self._deliver_wake.clear()

    # ------------------------------------------------------------------ the whole

    def _start_metrics(self, fleet: Fleet, hist_path: Path) -> MetricsEndpoint:
        assert self.opts.metrics is not None
        addr, port = self.opts.metrics
        conn = sqlite3.connect(f"file:{hist_path}?mode=ro", uri=True, check_same_thread=False, timeout=10.0)
        endpoint = MetricsEndpoint(FleetCollector(fleet, conn, self.health))
        try:
            self.metrics_port = endpoint.start(addr, port)
        except OSError as exc:
            raise WatchError(f"cannot serve metrics on {addr}:{port} ({exc}): pick another port with --metrics ADDRESS:PORT") from None
        if not ipaddress.ip_address(addr).is_loopback:
            log(f"metrics on {addr}:{port}, NOT loopback: anyone who reaches it sees the fleet's GPUs and runs")
        log(f"metrics on http://{addr}:{self.metrics_port}/metrics")
        return endpoint

    async def _freeze_gc(self, fleet: Fleet) -> None:
        t0 = time.monotonic()
        for _ in range(int(gcpolicy.FREEZE_AFTER_S) + 1):  # a check a second
            if gcpolicy.freeze_due((ln.status.state for ln in fleet.links.values()), time.monotonic() - t0):
                break
            await asyncio.sleep(1.0)
        gcpolicy.freeze_startup_heap(gcpolicy.HEADLESS_THRESHOLDS)

    async def run(self, stop: asyncio.Event) -> int:
        """Run until ``stop`` is set; 0 on a clean stop."""
        self._take_lock()
        history = History()
        outbox = Outbox(outbox_path(), **({"expire_s": self.opts.expire_s} if self.opts.expire_s else {}))
        self.health.label = outbox.label
        hist_path = history.path
        scan_conn = sqlite3.connect(f"file:{hist_path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False, timeout=10.0)
        try:
            self.broken_rules.update(unusable(scan_conn, self.opts.rules))
        except sqlite3.Error:
            pass  # a history not readable yet: the scan says so, and finds a broken rule when it first evaluates it
        self._tell_broken()
        if outbox.cursor() is None:
            top = scan_conn.execute("SELECT MAX(rowid) FROM events").fetchone()[0] or 0
            outbox.enqueue([], top)  # a first start follows from the history's end: the past is not announced
            log("first start: notifying events from now on")
        fleet = Fleet(
            config=self.opts.config, history=history, interval_s=self.opts.interval_s, ssh=self.opts.ssh, state_dir=self.opts.state_dir
        )
        self.fleet = fleet
        attach_rank_death(fleet)  # --on-rank-death stop across a multi-node run's hosts, as the console does
        for link in fleet.links.values():
            link.on_synced(lambda _host, n: self._scan_wake.set() if n else None)
        server = self._start_metrics(fleet, hist_path) if self.opts.metrics else None
        targets = {u for r in self.opts.rules for u in r.to}
        log(f"following {len(fleet.links)} host(s), {len(self.opts.rules)} rule(s), {len(targets)} target(s)")
        fleet.start()
        self._scan_wake.set()
        tasks = [
            asyncio.ensure_future(self._scan_loop(scan_conn, outbox)),
            asyncio.ensure_future(self._deliver_loop(outbox)),
            asyncio.ensure_future(self._freeze_gc(fleet)),
        ]
        try:
            loops = tasks[:2]  # run for ever; the GC freeze ends by itself
            done, _ = await asyncio.wait([*loops, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t in loops and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            return 0
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if server is not None:
                server.shutdown()
            await fleet.close()
            history.close()
            outbox.close()
            scan_conn.close()
            log("stopped")
