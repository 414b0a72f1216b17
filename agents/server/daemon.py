"""Provides the agent daemon: a Unix-socket server over the supervisor, journal and samplers.

The socket lives in a 0700 folder and is itself 0600; each connection's peer
uid is checked (``SO_PEERCRED``) and only the agent's own user or root is
served. The agent never listens on TCP. Every request gets a structured reply
or a typed ``Error``; malformed input never ends the connection, let alone the
agent.
"""

from __future__ import annotations

import asyncio
import errno
import faulthandler
import fcntl
import logging
import math
import os
import resource
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from gpudeck.agents import __version__
from gpudeck.agents.health import triage
from gpudeck.agents.observe import namespace as pid_namespace
from gpudeck.agents.observe.gpus import make_sampler
from gpudeck.agents.observe.procs import ProcTable
from gpudeck.agents.observe.telemetry import step_series
from gpudeck.agents.runs.launch import SHIMS, check_env
from gpudeck.agents.runs.supervisor import Supervisor, hostname
from gpudeck.agents.safety import envs, unaccounted
from gpudeck.agents.safety.membership import cmdline_of
from gpudeck.agents.server.peers import ConnBudget, Peer, PeerFinder
from gpudeck.agents.server.snapshot import EncodedSnapshot, SnapshotBuilder, SnapshotCache, StateKey
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire import paths
from gpudeck.agents.wire.errors import AgentError, BadRequest, StorageError, VersionMismatch
from gpudeck.agents.wire.protocol import (
    MAX_OUTPUT_CHUNK,
    TERMINAL_STATES,
    Cancel,
    Error,
    Event,
    EventBatch,
    Fingerprint,
    FingerprintReply,
    FrameReader,
    GetEvents,
    GetMetrics,
    GetRun,
    GetSnapshot,
    Hello,
    HelloReply,
    Launch,
    LaunchReply,
    LaunchSpec,
    LeftoverList,
    ListLeftovers,
    ListRuns,
    Member,
    Metrics,
    OutputChunk,
    Ping,
    Pong,
    Preflight,
    PreflightReply,
    ReadOutput,
    RebuildEnv,
    Reclaim,
    Request,
    RunInfo,
    RunList,
    RunReply,
    Snapshot,
    Stop,
    StopReply,
    StreamEnd,
    TriageReply,
    TriageRun,
    VerifyReply,
    VerifyRun,
    WatchSnapshots,
    decode_request,
    encode,
    speaks,
    versions_spoken,
)

log = logging.getLogger("gpudeck.agent")

TICK_S = 0.5  # supervision tick: member discovery, exit detection
SNAPSHOT_WARM_S = 10.0  # a client asking for snapshots at most this far apart finds the next sampled ahead (SnapshotCache.due)
REPLY_DURABLE_S = 5.0  # a Launch/Stop/Reclaim reply waits this long at most for its journal records to be on disk
WRITE_BUFFER_LIMIT = 8 << 20  # a slower client than this skips snapshots instead of growing memory

# What any client can make the agent hold (README, Reliability). Per connection: the socket read (64 KiB chunk, at
# most 128 KiB buffered by the StreamReader), the framer's partial line (MAX_FRAME, 1 MiB), MAX_INFLIGHT requests
# (each a decoded frame of at most 1 MiB, and its reply once built), MAX_STREAMS streams (each holding at most the
# one item it is sending), and the write buffer (WRITE_PAUSE_AT, plus the one reply being written). Past
# MAX_INFLIGHT unanswered requests, or with more than WRITE_PAUSE_AT not taken by the client, the agent stops
# reading that connection: a client that sends and never reads stalls itself, nobody else. A stream past
# MAX_STREAMS gets a typed error (a console never waits on it).
MAX_INFLIGHT = 8  # requests (not streams) of one connection being served at once
MAX_STREAMS = 16  # streams (watch_snapshots, get_events, read_output) open on one connection
WRITE_PAUSE_AT = 1 << 20  # bytes waiting to go to the client: past this, nothing more is read from it
MAX_CONNECTIONS = 256  # connections served at once; one more gets a typed `busy` error and is closed
IDLE_EVICT_S = 5.0  # at the cap, a connection with nothing in flight and silent this long gives its place to a new one
FD_RESERVE = 64  # file descriptors never given to clients: the tick, launches and the journal always have these
FD_HEADROOM = 32  # fds between the connection cap and the reserve: runs' files, journal reopen, the busy replies
ACCEPT_BATCH = 32  # connections accepted per wake-up of the listening socket
LINGER_S = 1.0  # a refused connection stays open this long at most for its client to read the refusal
LINGER_MAX = 32  # refused connections lingering at once (inside FD_HEADROOM); past it one is closed at once
DRAIN_AT_EOF_S = 30.0  # a client that half-closed gets its in-flight answers for this long at most
SHUTDOWN_GRACE_S = 0.5  # SIGTERM: what is in flight gets this long, then every connection is cut
_PEERCRED = struct.Struct("3i")


LOOP_MONITOR_ENV = "GPUDECK_LOOP_MONITOR"  # a file: the agent appends its event loop's lag there every second (benchmarks)
LOOP_MONITOR_BEAT_S = 0.001


async def _loop_monitor(path: Path) -> None:
    """How late the event loop runs a 1 ms heartbeat: one JSON line a second with the worst lag, the most CPU the
    loop's thread spent within one beat (work on the loop; the rest of a lag is waiting for a CPU or the GIL)."""
    loop = asyncio.get_running_loop()
    worst, busy, beats, t_report = 0.0, 0.0, 0, loop.time() + 1.0
    with open(path, "a", buffering=1) as fh:
        while True:
            t0, c0 = loop.time(), time.thread_time()
            await asyncio.sleep(LOOP_MONITOR_BEAT_S)
            lag = loop.time() - t0 - LOOP_MONITOR_BEAT_S
            worst, busy, beats = max(worst, lag), max(busy, time.thread_time() - c0), beats + 1
            if loop.time() >= t_report:
                fh.write(
                    f'{{"ts": {time.time():.3f}, "max_lag_ms": {worst * 1000:.3f}, "max_busy_ms": {busy * 1000:.3f}, "beats": {beats}}}\n'
                )
                worst, busy, beats, t_report = 0.0, 0.0, 0, t_report + 1.0


class AlreadyRunning(AgentError):
    """Another agent already serves this state directory."""

    code = "already_running"


class Agent:
    """The host agent: owns the journal, the supervisor and the socket."""

    def __init__(self, state_dir: Path | None = None, host: str | None = None) -> None:
        self.state_dir = Path(state_dir or paths.state_dir())
        self.host = host or hostname()
        paths.ensure_private_dir(self.state_dir)
        self._lock_fh = open(paths.private_file(self.state_dir / "agent.lock"), "a+")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_fh.close()
            raise AlreadyRunning(f"an agent already runs for {self.state_dir}: `gpudeck agent status` shows it") from None
        self._lock_fh.seek(0)
        self._lock_fh.truncate()
        self._lock_fh.write(str(os.getpid()))
        self._lock_fh.flush()
        self.journal = Journal(paths.journal_path(self.state_dir), self.host)
        self.procs = ProcTable(paths.runs_dir(self.state_dir))
        # GPUDECK_SIMULATE_GPUS selects labelled simulated GPUs (CI, benchmarks); otherwise NVML
        self.gpus = make_sampler(self.procs)
        if self.gpus.simulated:
            log.warning("SIMULATED GPUs: %s", getattr(self.gpus, "description", "GPUDECK_SIMULATE_GPUS is set"))
        self.event_waiters: set[asyncio.Event] = set()  # one per following stream
        self.supervisor = Supervisor(
            self.journal, paths.runs_dir(self.state_dir), self.host, self.gpus, self.procs, on_event=self._on_event
        )
        self.snapshots = SnapshotBuilder(self.host, self.journal.epoch, self.gpus, self.procs, self.supervisor)
        self.supervisor.attribute = self.snapshots.attribute
        # GetSnapshot's answers: the latest sample, encoded once, while young enough and nothing it shows changed
        self.snapshot_cache = SnapshotCache(self.snapshots, self.journal_note)
        self.socket_path = paths.socket_path(self.state_dir)
        self._listener: socket.socket | None = None
        self._conns: set[Connection] = set()
        self._conn_tasks: set[asyncio.Task] = set()
        self.conn_cap = MAX_CONNECTIONS  # set at start from RLIMIT_NOFILE (see _fd_budget)
        # how many connections a run's processes may hold (agents/server/peers.py): never the operator's reserve
        self.budget = ConnBudget(self.conn_cap)
        self.peers = PeerFinder(self.supervisor.containment.group_of_pid, self._member_pids)
        self._conn_peers: dict[asyncio.Task, Peer] = {}
        self._lingering: set[socket.socket] = set()  # refused connections waiting for the client to read why
        self.busy_refused = 0  # connections turned away with `busy` (a figure for tests and the log)
        self.idle_evicted = 0  # idle connections closed at the cap to let a new one in
        self._fd_paused = False
        self._journal_seen: str | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()
        self.uid = os.getuid()
        # process scans and NVML samples run here, one at a time, never on the event loop: a big /proc or a
        # slow driver delays the snapshot that needs it, not a ping or another client's request
        self._sampler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpudeck-sample")

    async def snapshot(self) -> Snapshot:
        """A snapshot built off the event loop."""
        snap = await asyncio.get_running_loop().run_in_executor(self._sampler, self.snapshots.build)
        snap.journal_note = self.journal_note()
        return snap

    async def snapshot_line(self, request_id: str, max_age_s: float) -> bytes:
        """The encoded answer to a GetSnapshot: the latest sample when it may answer (SnapshotCache says when; then
        no thread hop, no build, no encode), else a new one made in the sampler thread and kept for the next."""
        cache = self.snapshot_cache
        cache.note_request()
        key = cache.state_key()
        got = cache.fresh(max_age_s, key)
        if got is None:
            got = await asyncio.get_running_loop().run_in_executor(self._sampler, cache.sample, key)
            cache.keep(got)
        return got.reply(request_id)

    def journal_note(self) -> str | None:
        """What `agent status`, snapshots and the console say of the journal: a problem now, else its last recreation."""
        j = self.journal
        if j.problem:
            return f"journal problem: {j.problem}"
        if not j.recreated:
            return None
        r = j.recreated[-1]
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(r.get("ts", time.time())))
        runs = r.get("runs") or []
        text = f"journal recreated {when} ({r['reason']}: {r.get('detail') or r['reason']})"
        if r.get("moved_to"):
            text += f"; the old file is kept as {r['moved_to']}"
        text += f"; new epoch {j.epoch}; {len(runs)} live run(s) re-recorded"
        if len(j.recreated) > 1:
            text += f" ({len(j.recreated)} recreations since the agent started)"
        return text

    def _journal_recreated(self, info: dict[str, Any]) -> None:  # the journal's writer thread
        try:
            self._loop.call_soon_threadsafe(self._after_recreate)
        except RuntimeError:  # the loop is closed (shutdown)
            pass

    def _after_recreate(self) -> None:
        self.snapshots.epoch = self.journal.epoch  # followers see the new epoch (and start it from seq 0)
        self._wake_followers()

    # ------------------------------------------------------------------ lifecycle

    def _on_event(self, ev: Event) -> None:
        # queued, not yet readable: followers are woken by the journal's commit (_on_commit); a cached snapshot
        # shows the state before it, so the next GetSnapshot samples again
        self.snapshot_cache.events += 1

    def _wake_followers(self) -> None:
        for waiter in self.event_waiters:
            waiter.set()

    def _on_commit(self, seq: int) -> None:  # the journal's writer thread
        try:
            self._loop.call_soon_threadsafe(self._wake_followers)
        except RuntimeError:  # the loop is closed (shutdown)
            pass

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def start(self) -> None:
        """Adopt runs left by an earlier agent, open the socket, start the supervision tick."""
        self._loop = asyncio.get_running_loop()
        self.journal.on_commit = self._on_commit
        self.journal.live_source = self.supervisor.live_runs
        self.journal.on_recreate = self._journal_recreated
        found = await asyncio.to_thread(rediscover_runs, self.journal, self.supervisor)
        notes = self.supervisor.adopt()
        self._record_start_recovery(found)
        self.journal.append(
            "agent_started", None, {"pid": os.getpid(), "version": __version__, "gpu_error": self.gpus.error, "adopted": notes}
        )
        # what adoption settled is on disk before anyone is served (a client reading the journal sees it)
        try:
            async with asyncio.timeout(REPLY_DURABLE_S):
                await self.journal.wait_durable()
        except TimeoutError:
            log.warning("serving before the adoption's records are on disk (%s)", self.journal.storage_error or "slow disk")
        for run in self.supervisor.pending_stops():
            ev = self.journal.last_event(run.id, "run_state")
            grace = float((ev.data if ev else {}).get("grace_s", 10.0))  # the grace the operator asked for
            self._spawn(self.supervisor.stop(run.id, grace_s=grace))
        paths.ensure_private_dir(self.socket_path.parent)
        if self.socket_path.exists():
            self.socket_path.unlink()  # we hold the lock, so no live agent owns it
        self.conn_cap = _fd_budget()
        self.budget.cap = self.conn_cap
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            lsock.bind(str(self.socket_path))
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        lsock.listen(128)
        lsock.setblocking(False)
        self._listener = lsock
        self._loop.add_reader(lsock.fileno(), self._accept_ready)
        self._spawn(self._tick_loop())
        monitor = os.environ.get(LOOP_MONITOR_ENV)
        if monitor:
            self._spawn(_loop_monitor(Path(monitor)))
        log.info(
            "agent %s serving %s (GPUs: %s; connections: %d at most, %d of them kept for peers in no run)",
            os.getpid(),
            self.socket_path,
            self.gpus.error or self.gpus.count,
            self.conn_cap,
            self.budget.reserve,
        )
        log.info("PID namespace: %s", pid_namespace.current().label)

    def _record_start_recovery(self, found: list[str]) -> None:
        """A journal recreated at start (corrupt), or one that lacked live runs (deleted while the agent was down):
        a typed ``journal_recreated`` event says so, with the runs found again through their containment."""
        at_start = [r for r in self.journal.recreated if r.get("at_start")]
        if not at_start and not found:
            return
        info: dict[str, Any] = at_start[-1] if at_start else {"reason": "missing", "detail": "", "moved_to": None, "previous_epoch": None}
        if not at_start:
            info["detail"] = (
                f"{len(found)} live run(s) in {paths.runs_dir(self.state_dir)} had no record in {self.journal.path} "
                "(deleted or replaced while the agent was down)"
            )
            info["at_start"] = True
            info["ts"] = time.time()
            self.journal.recreated.append(info)
        info["runs"] = [f.split(":", 1)[0] for f in found]
        data = {k: info[k] for k in ("reason", "detail", "moved_to", "previous_epoch", "runs", "at_start")}
        data["detail"] = (data["detail"] + "; " if data["detail"] else "") + "; ".join(found)[:2000] if found else data["detail"]
        self.journal.append("journal_recreated", None, data)
        log.error("journal: %s", self.journal_note())

    async def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        await self._stopped.wait()
        await self.close()

    async def close(self) -> None:
        """Stop serving; runs keep going (they outlive the agent by design). Bounded whatever the clients do: the
        listener closes, what is in flight gets SHUTDOWN_GRACE_S, then every connection is cut (its transport
        aborted: no drain waits on a client that does not read)."""
        log.info("agent %s stopping; %d live run(s) keep going", os.getpid(), len(self.supervisor.live_runs()))
        self._stop_accepting()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for sock in list(self._lingering):  # refused connections still waiting for their client to read why
            self._close_refused(sock)
        if self._conn_tasks:
            await asyncio.wait(list(self._conn_tasks), timeout=SHUTDOWN_GRACE_S)
        for conn in list(self._conns):
            conn.abort()
        for t in list(self._conn_tasks):
            t.cancel()
        if self._conn_tasks:
            await asyncio.wait(list(self._conn_tasks), timeout=SHUTDOWN_GRACE_S)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=SHUTDOWN_GRACE_S)
        try:
            self.socket_path.unlink()
        except OSError:
            pass
        self._sampler.shutdown(wait=False, cancel_futures=True)
        self.supervisor.containment.release()
        await asyncio.to_thread(self.journal.close)  # commits what is queued
        self._lock_fh.close()

    def _tick_reads(self, key: StateKey | None) -> tuple[str | None, EncodedSnapshot | None]:
        """The tick's reads in the sampler thread: the journal's path (gone, replaced, written by someone? the writer
        mends it before any commit) and the process table; what is wrong with the journal, if anything. With a
        ``key`` (clients asked for snapshots lately), a sample for the next GetSnapshot too, from that same table."""
        problem = self.journal.check()
        self.procs.refresh()
        return problem, (self.snapshot_cache.sample(key) if key is not None else None)

    async def _tick_loop(self) -> None:
        # the process scan runs in the sampler thread; the supervisor's own refresh of the table right after
        # finds nothing new (one read of /proc/loadavg), and its scans run in a thread: the tick on the loop
        # is only the runs' logic
        loop = asyncio.get_running_loop()
        while True:
            try:
                # one hop off the loop for both reads (an idle agent's tick is mostly these two); while clients ask
                # for snapshots, a sample for them rides along (none when nobody asked: an idle agent pays nothing)
                cache = self.snapshot_cache
                ahead = cache.state_key() if cache.due(SNAPSHOT_WARM_S) else None
                problem, sample = await loop.run_in_executor(self._sampler, self._tick_reads, ahead)
                if sample is not None:
                    cache.keep(sample)
                if problem is not None and problem != self._journal_seen:
                    log.error("journal: %s", problem)
                self._journal_seen = problem
                await self.supervisor.tick()  # its full scans, NVML sample and liveness checks run in a thread too
                self.snapshots.storage_error = None
            except StorageError as exc:  # disk full: keep supervising, say so in every snapshot, retry next tick
                if self.snapshots.storage_error is None:
                    log.error("journal write failed: %s", exc.message)
                self.snapshots.storage_error = exc.message
            except Exception:  # one bad tick must not end supervision
                log.exception("supervision tick failed")
            await asyncio.sleep(TICK_S)

    # ------------------------------------------------------------------ connections

    def _member_pids(self) -> dict[int, str]:
        """The live runs' member pids, as the supervisor tracks them: pid -> run id."""
        return {m.pid: r.id for r in self.supervisor.live_runs() for m in r.members}

    def _peer_uid(self, writer: asyncio.StreamWriter) -> int | None:
        cred = _peercred(writer.get_extra_info("socket"))
        return None if cred is None else cred[1]

    def _stop_accepting(self) -> None:
        if self._listener is not None:
            try:
                self._loop.remove_reader(self._listener.fileno())
            except (ValueError, OSError):
                pass

    def _accept_ready(self) -> None:
        """The listening socket is readable: accept what the connection cap and the fd budget allow. Past the cap a
        connection gets one `busy` frame and is closed; when even that would eat the supervision's reserve
        (another part of the agent holds many fds), accepting pauses until a connection closes."""
        lsock = self._listener
        if lsock is None:
            return
        for _ in range(ACCEPT_BATCH):
            if not _fds_left_for_clients():
                # the backlog waits in the kernel, costing us nothing; resumed when a connection closes, and
                # looked at again shortly (an idle connection may be closed to make room meanwhile)
                self._evict_idle()
                self._stop_accepting()
                self._loop.call_later(0.5, self._resume_accepting)
                if not self._fd_paused:
                    log.warning("accepting paused: file descriptors are down to the supervision's reserve (%d)", FD_RESERVE)
                self._fd_paused = True
                return
            self._fd_paused = False
            try:
                sock, _addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE/ENFILE from elsewhere: stop for now, a closing connection resumes
                log.warning("accept failed: %s", exc)
                self._stop_accepting()
                self._loop.call_later(0.5, self._resume_accepting)
                return
            cred = _peercred(sock)
            peer = self.peers.peer(*cred) if cred is not None else Peer(pid=0, uid=-1)
            why = self.budget.refusal(peer, self.host)
            if why is not None:  # a run's processes at their share: refused whatever the rest of the cap holds
                self._refuse_limit(sock, peer, why)
                continue
            if len(self._conn_tasks) >= self.conn_cap and not self._evict_idle():  # tasks: counted from the accept on
                self._refuse_busy(sock)
                continue
            sock.setblocking(False)
            task = asyncio.ensure_future(self._open_conn(sock))
            self._conn_tasks.add(task)
            self.budget.add(peer)
            self._conn_peers[task] = peer
            task.add_done_callback(self._conn_done)

    def _evict_idle(self) -> bool:
        """At the cap: close the connection idle longest (nothing in flight, no stream, silent for IDLE_EVICT_S) to make
        room, so connections held open and unused never lock fresh clients out. False when none qualifies."""
        now = time.monotonic()
        idle = [c for c in self._conns if not c.closed and not c.busy() and now - c.last_active >= IDLE_EVICT_S]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_active)
        self.idle_evicted += 1
        victim.refuse(
            Error(
                code="busy",
                message=f"closed by the agent on {self.host}: idle for {now - victim.last_active:.0f} s while all "
                f"{self.conn_cap} connections were taken; reconnect when needed",
            )
        )
        return True

    def _resume_accepting(self) -> None:
        if self._listener is not None and not self._stopped.is_set():
            self._stop_accepting()
            self._loop.add_reader(self._listener.fileno(), self._accept_ready)

    def _conn_done(self, task: asyncio.Task) -> None:
        self._conn_tasks.discard(task)
        peer = self._conn_peers.pop(task, None)
        if peer is not None:
            self.budget.remove(peer)
        self._resume_accepting()

    def _refuse_limit(self, sock: socket.socket, peer: Peer, why: str) -> None:
        n = self.budget.refused
        if n in (1, 10, 100, 1000) or n % 10000 == 0:
            log.warning("connection of %s refused: %s (%d refused so far)", peer.describe(), why, n)
        self._last_frame(sock, Error(code="connection_limit", message=why))

    def _refuse_busy(self, sock: socket.socket) -> None:
        self.busy_refused += 1
        if self.busy_refused in (1, 10, 100, 1000) or self.busy_refused % 10000 == 0:
            log.warning(
                "connection refused as busy (%d served, the cap is %d); %d refused so far",
                len(self._conn_tasks),
                self.conn_cap,
                self.busy_refused,
            )
        self._last_frame(
            sock,
            Error(
                code="busy",
                message=f"the agent on {self.host} serves {self.conn_cap} connections at most and all are taken; "
                "close idle consoles or CLIs (`ss -xp | grep agent.sock` shows them) and retry",
            ),
        )

    def _last_frame(self, sock: socket.socket, err: Error) -> None:
        """Send one error frame on a just-accepted socket and end the connection. Our side is shut for writing at
        once (the client reads the frame, then EOF) and the socket is closed when the client closes its side, or
        after LINGER_S: closed at once, with the client's Hello unread, the kernel would reset the connection and
        the client's asyncio stream would drop the frame unread. At most LINGER_MAX linger; past that, closed."""
        try:
            sock.setblocking(False)
            sock.send(encode(err))  # one small frame into an empty socket buffer: never blocks
            if len(self._lingering) >= LINGER_MAX:
                raise OSError("enough refused connections linger already")
            sock.shutdown(socket.SHUT_WR)
            self._loop.add_reader(sock.fileno(), self._drain_refused, sock)
        except OSError:
            sock.close()
            return
        self._lingering.add(sock)
        self._loop.call_later(LINGER_S, self._close_refused, sock)

    def _drain_refused(self, sock: socket.socket) -> None:
        try:
            if sock.recv(65536):
                return  # what the client sent before it read the refusal: discarded
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._close_refused(sock)

    def _close_refused(self, sock: socket.socket) -> None:
        if sock in self._lingering:
            self._lingering.discard(sock)
            try:
                self._loop.remove_reader(sock.fileno())
            except (ValueError, OSError):
                pass
            sock.close()

    async def _open_conn(self, sock: socket.socket) -> None:
        loop = self._loop
        reader = asyncio.StreamReader(limit=1 << 16, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
        except OSError:
            sock.close()
            return
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        await self._serve_conn(reader, writer)

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(self, reader, writer)
        self._conns.add(conn)
        try:
            await self._serve_checked(conn, writer)
        finally:
            self._conns.discard(conn)

    async def _serve_checked(self, conn: Connection, writer: asyncio.StreamWriter) -> None:
        uid = self._peer_uid(writer)
        if uid is None or uid not in (self.uid, 0):
            await conn.send(
                Error(
                    code="permission_denied",
                    message=f"uid {uid} may not use this agent (it serves uid {self.uid}); connect as that user, e.g. over `ssh {self.host}`",
                )
            )
            await conn.close()
            return
        await conn.run()


class Connection:
    """One client connection: framing, dispatch, streams (public: the bench's SIMULATED stand-in, bench/standin.py, serves
    its hosts with it and gates :meth:`handle`)."""

    def __init__(self, agent: Agent, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.agent = agent
        self.reader = reader
        self.writer = writer
        self.frames = FrameReader()
        self.streams: dict[str, asyncio.Task] = {}
        self._wlock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(MAX_INFLIGHT)  # requests in flight; the reader waits for a free one
        self._slotted: set[asyncio.Task] = set()  # the requests holding a slot
        self._open_streams: set[asyncio.Task] = set()
        try:
            writer.transport.set_write_buffer_limits(high=WRITE_PAUSE_AT)
        except (AttributeError, RuntimeError, ValueError):
            pass
        self.closed = False
        self.alias = ""  # what the client calls this host (from Hello), for the commands messages suggest
        self.last_active = time.monotonic()  # the last byte read from the client or reply sent to it

    def busy(self) -> bool:
        """Serving something: a request in flight or an open stream."""
        return bool(self._tasks) or bool(self.streams)

    def refuse(self, err: Error) -> None:
        """Send one last error frame (if the socket takes it now) and cut the connection."""
        try:
            if self.writer.transport.get_write_buffer_size() == 0:
                self.writer.write(encode(err))
        except (RuntimeError, OSError):
            pass
        self.closed = True
        try:
            self.writer.transport.close()  # flushes what it can, then closes; the reader sees EOF
        except (RuntimeError, OSError):
            pass

    def abort(self) -> None:
        """Cut the connection now (shutdown): buffered replies are dropped, every drain waiting on it returns."""
        self.closed = True
        try:
            self.writer.transport.abort()
        except (RuntimeError, OSError):
            pass

    async def _backpressure(self) -> None:
        """Read no more while the client leaves more than WRITE_PAUSE_AT of our replies unread."""
        if not self.closed and self.writer.transport.get_write_buffer_size() > WRITE_PAUSE_AT:
            await self.writer.drain()  # returns once the transport is below its low-water mark (or raises: gone)

    async def send(self, msg: msgspec.Struct, droppable: bool = False) -> None:
        if self.closed:
            return
        if droppable and self.writer.transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            return
        await self.send_line(encode(msg))

    async def send_line(self, line: bytes) -> None:
        """Write one encoded message (its newline included) and wait for the transport to take it."""
        if self.closed:
            return
        async with self._wlock:
            try:
                self.writer.write(line)
                await self.writer.drain()
                self.last_active = time.monotonic()
            except (ConnectionError, RuntimeError):
                self.closed = True

    async def close(self) -> None:
        self.closed = True
        for t in list(self.streams.values()) + list(self._tasks):
            t.cancel()
        try:
            self.writer.close()
            await self.writer.wait_closed()
        except (ConnectionError, RuntimeError):
            pass

    async def run(self) -> None:
        try:
            while not self.closed:
                await self._backpressure()
                data = await self.reader.read(65536)
                if not data:
                    break
                self.last_active = time.monotonic()
                for frame in self.frames.feed(data):
                    if frame is None:
                        await self.send(
                            Error(
                                code="frame_too_large",
                                message=f"a message was longer than {self.frames.max_frame} bytes and was discarded; send smaller messages",
                            )
                        )
                        continue
                    req = decode_request(frame)
                    if isinstance(req, Error):
                        await self.send(req)
                        continue
                    if type(req) in _STREAMS:
                        if len(self._open_streams) >= MAX_STREAMS and not (req.request_id and req.request_id in self.streams):
                            await self.send(
                                Error(
                                    request_id=req.request_id,
                                    code="too_many_streams",
                                    message=f"{MAX_STREAMS} streams are open on this connection already; cancel one first",
                                )
                            )
                            continue
                        self._start(req, slotted=False)
                        continue
                    await self._slots.acquire()  # past MAX_INFLIGHT, this connection waits (and is not read)
                    if self.closed:
                        self._slots.release()
                        break
                    self._start(req, slotted=True)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed = True
        finally:
            # the client may half-close after its last request (dial does): answer what is in flight (bounded)
            for t in self.streams.values():
                t.cancel()
            pending = [t for t in self._tasks if not t.done()]
            if pending and not self.closed:
                await asyncio.wait(pending, timeout=DRAIN_AT_EOF_S)
            await self.close()

    def _start(self, req: Request, slotted: bool) -> None:
        """Serve one request in its own task; a request holds one of the connection's slots until it is answered,
        a stream counts against MAX_STREAMS while it is open."""
        task = asyncio.ensure_future(self._handle_safely(req))
        self._tasks.add(task)
        (self._slotted if slotted else self._open_streams).add(task)
        task.add_done_callback(self._finished)
        if type(req) in _STREAMS and req.request_id:
            old = self.streams.pop(req.request_id, None)
            if old is not None:
                old.cancel()
            self.streams[req.request_id] = task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._open_streams.discard(task)
        if task in self._slotted:
            self._slotted.discard(task)
            self._slots.release()

    async def _handle_safely(self, req: Request) -> None:
        rid = req.request_id
        try:
            await self.handle(req)
        except AgentError as exc:
            await self.send(Error(request_id=rid, code=exc.code, message=exc.message))
        except asyncio.CancelledError:
            await self.send(StreamEnd(request_id=rid, reason="cancelled"))
            raise
        except Exception as exc:  # the agent stays up whatever one request does
            log.exception("request %s failed", type(req).__name__)
            await self.send(
                Error(
                    request_id=rid,
                    code="internal",
                    message=f"the agent failed on this request: {type(exc).__name__}: {exc}; see {paths.log_path(self.agent.state_dir)}",
                )
            )
        finally:
            if self.streams.get(rid) is asyncio.current_task():
                self.streams.pop(rid, None)

    async def handle(self, req: Request) -> None:
        handler = _HANDLERS.get(type(req))
        if handler is None:  # pragma: no cover - decode_request only yields known types (a test checks the table is complete)
            raise BadRequest(f"unsupported request {type(req).__name__}")
        await handler(self, req)

    # one handler per request type; _HANDLERS (below the class) maps each type to its handler

    async def _hello(self, req: Hello) -> None:
        a = self.agent
        self.alias = req.host_alias[:253]
        if not speaks(req.version):
            raise VersionMismatch(
                f"the client speaks protocol version {req.version}; the agent on {a.host} (gpudeck {__version__}) speaks "
                f"{versions_spoken()}: upgrade the older of the two (`gpudeck --version` on each end)"
            )
        await self.send(
            HelloReply(
                request_id=req.request_id,
                version=req.version,  # the connection speaks the client's version
                agent_version=__version__,
                host=a.host,
                epoch=a.journal.epoch,
                pid=os.getpid(),
                uid=a.uid,
                state_dir=str(a.state_dir),
                gpu_error=a.gpus.error,
                simulated=a.gpus.simulated,
                containment=a.supervisor.containment.label,
                journal=a.journal_note(),
                namespace=pid_namespace.current(),
            )
        )

    async def _ping(self, req: Ping) -> None:
        await self.send(Pong(request_id=req.request_id, ts=time.time()))

    async def _get_snapshot(self, req: GetSnapshot) -> None:
        if not req.max_age_s >= 0:  # negative or NaN
            raise BadRequest(f"max_age_s must be 0 or more (0: a sample made for this request), not {req.max_age_s}")
        await self.send_line(await self.agent.snapshot_line(req.request_id, req.max_age_s))

    async def _watch_snapshots(self, req: WatchSnapshots) -> None:
        if not (math.isfinite(req.interval_s) and math.isfinite(req.phase_s) and req.phase_s >= 0):
            raise BadRequest(
                f"interval_s must be a finite number and phase_s a finite number 0 or more, not {req.interval_s} and {req.phase_s}"
            )
        interval = max(0.05, min(req.interval_s, 3600.0))
        phase = req.phase_s % interval
        first = True
        while True:
            snap = await self.agent.snapshot()
            snap.request_id = req.request_id
            if req.compact and not first:
                snap.compact = True
                for g in snap.gpus:  # static facts went out with the first snapshot of this stream
                    g.uuid, g.name, g.memory_total, g.power_limit_w = "", "", 0, None
                snap.namespace = None  # so did the agent's PID namespace
            first = False
            await self.send(snap, droppable=True)
            # a fixed rate on the wall clock's grid (every whole interval, plus the phase the console asked for), not
            # interval + work: the agents of one phase sample at the same instant (one coherent picture of them), and
            # the console takes them in one burst rather than one wake-up per host; a big fleet's console spreads its
            # hosts over a few phases so that no burst is the whole fleet (console/fleet/fleet.py SNAPSHOT_GROUP)
            delay = interval - (time.time() - phase) % interval
            await asyncio.sleep(delay if delay > interval / 10 else delay + interval)  # just sent for the coming point

    async def _settled(self) -> None:
        """Before answering a request that changed something: what it queued in the journal is on disk (a reply is
        an acknowledgement). On a disk that stays full the answer goes after REPLY_DURABLE_S anyway: what the
        request did is real, its record is queued and retried, and snapshots say the journal cannot be written."""
        try:
            async with asyncio.timeout(REPLY_DURABLE_S):
                await self.agent.journal.wait_durable()
        except TimeoutError:
            log.warning("replying before the journal committed (%s)", self.agent.journal.storage_error or "slow disk")

    async def _launch(self, req: Launch) -> None:
        run, dup = await self.agent.supervisor.launch(req.spec, req.request_id, host_name=self.alias or None)
        await self._settled()
        await self.send(LaunchReply(request_id=req.request_id, run=run, duplicate=dup))

    async def _list_runs(self, req: ListRuns) -> None:
        a = self.agent
        runs = await asyncio.to_thread(a.journal.list_runs, max(1, min(req.limit, 100000)))
        live = {r.id: r for r in a.supervisor.live_runs()}
        await self.send(RunList(request_id=req.request_id, runs=[live.get(r.id, r) for r in runs]))

    async def _get_run(self, req: GetRun) -> None:
        await self.send(RunReply(request_id=req.request_id, run=self.agent.supervisor.resolve(req.run_id)))

    async def _stop(self, req: Stop) -> None:
        reason = f"stopped by gpudeck: {req.reason[:500]}" if req.reason else "stopped by operator"
        result = await self.agent.supervisor.stop(req.run_id, req.grace_s, reason=reason)
        await self._settled()
        await self.send(StopReply(request_id=req.request_id, result=result))

    async def _get_metrics(self, req: GetMetrics) -> None:
        run = self.agent.supervisor.resolve(req.run_id)
        points = max(2, min(req.max_points, 5000))
        steps, loss, tps, mfu, total = await asyncio.to_thread(step_series, Path(run.run_dir or "") / "telemetry.jsonl", points)
        await self.send(
            Metrics(request_id=req.request_id, run_id=run.id, steps=steps, loss=loss, tokens_per_s=tps, mfu=mfu, total_steps=total)
        )

    async def _preflight(self, req: Preflight) -> None:
        result = await self.agent.supervisor.preflight(req.spec, host_name=self.alias or None)
        await self.send(PreflightReply(request_id=req.request_id, result=result))

    async def _list_leftovers(self, req: ListLeftovers) -> None:
        a = self.agent
        found = await a.supervisor.leftovers(include_live=req.include_live, host_name=self.alias or None)
        gpus = a.supervisor.attributed_gpus() if a.gpus.available else []
        await self.send(
            LeftoverList(
                request_id=req.request_id,
                leftovers=found,
                gpus=gpus,
                gpu_error=a.gpus.error,
                unaccounted=unaccounted.holders(gpus, pid_namespace.current(), a.gpus.simulated),
            )
        )

    async def _reclaim(self, req: Reclaim) -> None:
        result = await self.agent.supervisor.reclaim(req.pids, req.grace_s, req.include_live, host_name=self.alias or None)
        await self._settled()
        await self.send(StopReply(request_id=req.request_id, result=result))

    async def _fingerprint(self, req: Fingerprint) -> None:
        check_env(req.env)  # a run's environment on top of the agent's, as a launch gets it (the cross-node gate sends it)
        env = {**os.environ, **req.env} if req.env else None
        fp = await asyncio.to_thread(envs.fingerprint, req.python, driver=self.agent.gpus.driver_version, env=env)
        await self.send(FingerprintReply(request_id=req.request_id, env=fp))

    async def _rebuild_env(self, req: RebuildEnv) -> None:
        a = self.agent
        dest = paths.envs_dir(a.state_dir) / f"{(req.env.freeze_hash or 'env')[:12]}-{int(time.time())}"
        fp = await asyncio.to_thread(envs.rebuild, req.env, dest, driver=a.gpus.driver_version)
        a.journal.append(
            "env_rebuilt", None, {"path": str(dest), "from": req.env.python, "freeze_hash": fp.freeze_hash, "python": fp.python}
        )
        await self._settled()
        await self.send(FingerprintReply(request_id=req.request_id, env=fp, path=str(dest)))

    async def _verify_run(self, req: VerifyRun) -> None:
        run, rows = self.agent.supervisor.verify(req.run_id)
        await self.send(VerifyReply(request_id=req.request_id, run_id=run.id, rows=rows, alerts=run.alerts))

    async def _triage_run(self, req: TriageRun) -> None:
        t = await triage.on_demand(self.agent.supervisor, req.run_id)
        await self.send(TriageReply(request_id=req.request_id, triage=t))

    async def _cancel(self, req: Cancel) -> None:
        task = self.streams.pop(req.target, None)
        if task is None:
            raise BadRequest(f"no open stream with request_id {req.target!r}")
        task.cancel()

    async def _events(self, req: GetEvents) -> None:
        a = self.agent
        after = max(0, req.after_seq)
        limit = max(1, min(req.limit, 10000))
        wake = asyncio.Event()
        a.event_waiters.add(wake)
        waited = False
        try:
            while True:
                wake.clear()
                events = await asyncio.to_thread(a.journal.events_after, after, limit, False)
                if not events and not req.follow and req.wait_s > 0 and not waited:
                    waited = True  # long poll: wait once for the next event, then answer (maybe empty)
                    try:
                        async with asyncio.timeout(min(req.wait_s, 300.0)):
                            await wake.wait()
                    except TimeoutError:
                        pass
                    continue
                if events or not req.follow:
                    await self.send(
                        EventBatch(request_id=req.request_id, epoch=a.journal.epoch, events=events, last_seq=a.journal.committed_seq)
                    )
                    if events:
                        after = events[-1].seq
                    if not req.follow:
                        return
                    if len(events) == limit:
                        continue
                try:
                    # woken by every committed event; the timeout also catches events written by another process
                    async with asyncio.timeout(1.0):  # not wait_for: on 3.11 it can swallow the stream's cancel
                        await wake.wait()
                except TimeoutError:
                    pass
        finally:
            a.event_waiters.discard(wake)

    async def _output(self, req: ReadOutput) -> None:
        a = self.agent
        run = a.supervisor.resolve(req.run_id)
        path = Path(run.run_dir or "") / "output.log"
        if req.offset < 0:  # from the end: the last |offset| bytes
            size = path.stat().st_size if path.exists() else 0
            offset = max(0, size + req.offset)
        else:
            offset = req.offset
        max_bytes = max(1, min(req.max_bytes, MAX_OUTPUT_CHUNK))
        idle_after_end = 0
        while True:
            data = await asyncio.to_thread(_read_at, path, offset, max_bytes)
            state = a.supervisor.run_state(run.id)
            ended = state in TERMINAL_STATES or state == "ended"
            if data or not req.follow:
                # never split a UTF-8 sequence across chunks
                cut = _utf8_boundary(data) if len(data) == max_bytes else len(data)
                chunk = data[:cut]
                await self.send(
                    OutputChunk(
                        request_id=req.request_id,
                        run_id=run.id,
                        offset=offset,
                        next_offset=offset + len(chunk),
                        data=chunk.decode("utf-8", "replace"),
                        run_ended=ended and len(data) < max_bytes,
                    )
                )
                offset += len(chunk)
                if not req.follow:
                    return
                if len(data) == max_bytes:
                    continue
            if ended:
                idle_after_end += 1
                if idle_after_end > 1:
                    await self.send(StreamEnd(request_id=req.request_id, reason=f"run {run.id} ended ({state})"))
                    return
            await asyncio.sleep(0.2)


# the dispatch table: request type -> handler (tests check every Request type has one)
_HANDLERS: dict[type, Callable[[Connection, Any], Awaitable[None]]] = {
    Hello: Connection._hello,
    Ping: Connection._ping,
    GetSnapshot: Connection._get_snapshot,
    WatchSnapshots: Connection._watch_snapshots,
    Launch: Connection._launch,
    ListRuns: Connection._list_runs,
    GetRun: Connection._get_run,
    Stop: Connection._stop,
    GetEvents: Connection._events,
    ReadOutput: Connection._output,
    GetMetrics: Connection._get_metrics,
    Preflight: Connection._preflight,
    ListLeftovers: Connection._list_leftovers,
    Reclaim: Connection._reclaim,
    Fingerprint: Connection._fingerprint,
    RebuildEnv: Connection._rebuild_env,
    VerifyRun: Connection._verify_run,
    TriageRun: Connection._triage_run,
    Cancel: Connection._cancel,
}
# requests that open a stream (cancelled with Cancel, or replaced by a new one with the same request_id)
_STREAMS = frozenset({WatchSnapshots, GetEvents, ReadOutput})


def _peercred(sock: socket.socket | None) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel recorded them at connect()."""
    if sock is None:
        return None
    try:
        pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return None
    return pid, uid


def _read_at(path: Path, offset: int, n: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(n)
    except FileNotFoundError:
        return b""


def _utf8_boundary(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that ends on a UTF-8 character boundary."""
    end = len(data)
    for back in range(1, min(4, end) + 1):
        b = data[end - back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4
            return end if back >= need else end - back
    return end


MAX_SPEC_BYTES = 4 << 20  # a run folder's spec.json read when the journal lost the run (the agent wrote it: small)


def rediscover_runs(journal: Journal, supervisor: Supervisor) -> list[str]:
    """Live runs the journal has no record of — it was recreated (corrupt) or deleted while the agent was down — found
    through their containment, as adoption finds members: a populated cgroup of this agent named after the run, or
    processes of this user carrying the run's tag (GPUDECK_RUN_ID), with the run's folder and its spec.json under
    this agent's runs folder. Each is recorded as ``running`` (created at its spec.json's time) for
    :meth:`Supervisor.adopt` to take over: members by cgroup/tag + ancestry, the end from exit.json. One note each."""
    procs = supervisor.procs
    procs.refresh(full=True)
    evidence: dict[str, str] = {}
    try:
        groups = supervisor.containment.groups()
    except OSError:
        groups = {}
    for rid, group in groups.items():
        if group.populated():
            evidence[rid] = "cgroup"
    me = os.getuid()
    for e in procs.tagged(anyone=True):  # runs the journal lost are no run of "ours" to the table's filter
        if e.run_id and (e.uid is None or e.uid == me):
            evidence.setdefault(e.run_id, "tag")
    found = []
    runs_dir = supervisor.runs_dir
    for rid, how in sorted(evidence.items()):
        if not rid or "/" in rid or rid.startswith(".") or len(rid) > 128 or journal.get_run(rid) is not None:
            continue
        spec_path = runs_dir / rid / "spec.json"
        try:
            st = os.lstat(spec_path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SPEC_BYTES:
                continue
            spec = msgspec.json.decode(spec_path.read_bytes(), type=LaunchSpec)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            log.warning("run %s has live processes (by %s) but its spec.json cannot be read (%s): left as a leftover", rid, how, exc)
            continue
        now = time.time()
        # the shim (outside the run's cgroup by design, it writes exit.json) is the run's shim again: the run ends
        # when it does, and a stop never signals it as a stray
        shims = [
            Member(pid=e.pid, create_time=e.create_time, role="shim", first_seen=now, cmdline=("gpudeck-shim",))
            for e in procs.tagged(rid, anyone=True)
            if SHIMS.intersection(cmdline_of(e.pid)[:4])
        ]
        run = RunInfo(
            id=rid,
            host=journal.host,
            state="running",
            spec=spec,
            name=spec.name,
            created=st.st_mtime,
            started=st.st_mtime,
            run_dir=str(runs_dir / rid),
            members=shims[:1],
        )
        try:
            journal.create_run(run)
        except StorageError as exc:
            log.error("run %s found again by its %s but not recorded: %s", rid, how, exc.message)
            continue
        found.append(f"{rid}: found again by its {how}")
    if found:
        log.warning("runs the journal did not know, found again through their containment: %s", "; ".join(found))
    return found


def _nofile() -> int:
    """The soft RLIMIT_NOFILE, raised to the hard limit (up to 65536) first: clients and supervision share it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 65536, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return 65536 if soft == resource.RLIM_INFINITY else int(soft)


def _fds_open() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
    except OSError:
        return 0


def _fds_left_for_clients() -> bool:
    """Whether one more client fits without eating into FD_RESERVE (counted now: runs, logs and the journal vary)."""
    return _fds_open() + 1 < resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_RESERVE


def _fd_budget() -> int:
    """Connections served at once: MAX_CONNECTIONS, or fewer when RLIMIT_NOFILE leaves less beside the reserve."""
    limit = _nofile()
    # FD_HEADROOM more than the reserve: connections past the cap still get their `busy` frame (accepting pauses only
    # when something else in the agent has used the headroom as well)
    return max(1, min(MAX_CONNECTIONS, limit - FD_RESERVE - FD_HEADROOM - _fds_open()))


class StateDirUnusable(AgentError):
    """The agent's state folder cannot be written: a read-only filesystem, a full disk, no permission."""

    code = "state_dir_unusable"


EXIT_BAD_SETUP = 2  # a setting or the state folder stops the agent at start (README: `gpudeck agent serve` exit codes)
EXIT_ALREADY_RUNNING = 3


def state_dir_error(state_dir: Path, exc: OSError) -> StateDirUnusable:
    """The typed error for an OSError met while the agent sets up ``state_dir``: what happened and what to do."""
    where = exc.filename or state_dir
    fix = {
        errno.EROFS: "it is on a read-only filesystem: point GPUDECK_HOME or --state-dir at a writable folder",
        errno.ENOSPC: f"the disk is full: free space there (`df -h {state_dir}`) or point GPUDECK_HOME or --state-dir elsewhere",
        errno.EDQUOT: "your disk quota is used up: free space (`quota -s`) or point GPUDECK_HOME or --state-dir elsewhere",
        errno.EACCES: f"uid {os.geteuid()} may not write there: fix its owner or mode, or point GPUDECK_HOME or --state-dir elsewhere",
        errno.EPERM: f"uid {os.geteuid()} may not write there (an immutable file?): fix it, or point GPUDECK_HOME or --state-dir elsewhere",
    }.get(exc.errno or 0, "point GPUDECK_HOME or --state-dir at a writable local folder")
    return StateDirUnusable(f"the state folder {state_dir} cannot be used ({where}: {exc.strerror or exc}): {fix}")


class _LogFile(logging.FileHandler):
    """The agent's log file; a record it cannot write (disk full) is dropped, not printed to stderr as a traceback:
    snapshots and `agent status` say the state folder cannot be written."""

    def handleError(self, record: logging.LogRecord) -> None:
        self.dropped = getattr(self, "dropped", 0) + 1


def setup_logging(state_dir: Path) -> None:
    """Log to the agent's log file (stdout may be an SSH channel or nothing)."""
    handler = _LogFile(paths.private_file(paths.log_path(state_dir)))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("gpudeck")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _refuse_start(exc: AgentError) -> int:
    """Say why the agent does not start, on one line (stderr and, where it can be written, the log); the exit code."""
    # another agent's start-up racing this one (autostart) is no error of the running agent's log; and without the
    # log file set up, logging would print the line to stderr a second time
    if not isinstance(exc, AlreadyRunning) and any(isinstance(h, _LogFile) for h in logging.getLogger("gpudeck").handlers):
        log.error("agent cannot start: %s", exc.message)
    print(f"gpudeck agent: {exc.message}", file=sys.stderr)
    return EXIT_ALREADY_RUNNING if isinstance(exc, AlreadyRunning) else EXIT_BAD_SETUP


def serve(state_dir: Path | None = None, on_exit: Callable[[], None] | None = None) -> int:
    """``gpudeck agent serve``: run the agent in the foreground until SIGTERM. ``on_exit`` runs once the loop has
    stopped serving (also on the ``os._exit`` way out below, which skips a caller's ``finally`` and atexit):
    a profiler's dump (bench/agent_sample.py --profile). Exit codes: 0 stopped, 2 a bad setting or a state folder
    that cannot be written (read-only, full), 3 another agent serves this state folder."""
    sd = Path(state_dir or paths.state_dir())
    try:
        paths.ensure_private_dir(sd)
        setup_logging(sd)
        # `kill -USR1 <agent pid>` writes every thread's stack to the agent's log (a stuck agent says where it is)
        faulthandler.register(signal.SIGUSR1, file=open(paths.log_path(sd), "a"), all_threads=True)
    except OSError as exc:
        return _refuse_start(state_dir_error(sd, exc))
    except AgentError as exc:  # UnsafePath: a link or another user's file where the state goes
        return _refuse_start(exc)

    async def main() -> None:
        agent = Agent(sd)
        await agent.serve_forever()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    except AgentError as exc:  # a bad setting (e.g. GPUDECK_SIMULATE_GPUS), a full disk: say it, never start half-configured
        return _refuse_start(exc)
    except OSError as exc:  # the lock, the journal's folder, the socket: the state folder cannot be written
        log.debug("start-up failed", exc_info=True)
        return _refuse_start(state_dir_error(sd, exc))
    finally:
        # not asyncio.run: its shutdown waits for every worker thread still busy (a slow fingerprint, a stat on a
        # hung mount); SIGTERM is answered within a second whatever those do. The journal is closed by now.
        loop.close()
    busy = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if busy:
        log.info("agent exits with %d worker thread(s) still busy: %s", len(busy), ", ".join(t.name for t in busy[:5]))
        if on_exit is not None:
            on_exit()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # interpreter shutdown would join them (concurrent.futures waits for its workers)
    if on_exit is not None:
        on_exit()
    return 0
