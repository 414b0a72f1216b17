"""Provides the agent daemon: a Unix-socket server over the supervisor, journal and samplers.

The socket lives in a 0700 folder and is itself 0600; each connection's peer
uid is checked (``SO_PEERCRED``) and only the agent's own user or root is
served. The agent never listens on TCP. Every request gets a structured reply
or a typed ``Error``; malformed input never ends the connection, let alone the
agent.
"""

from __future__ import annotations

import asyncio
import faulthandler
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from gpudeck.agents import __version__, envs, paths
from gpudeck.agents.errors import AgentError, BadRequest, StorageError, VersionMismatch
from gpudeck.agents.gpus import make_sampler
from gpudeck.agents.journal import Journal
from gpudeck.agents.procs import ProcTable
from gpudeck.agents.protocol import (
    MAX_OUTPUT_CHUNK,
    PROTOCOL_VERSION,
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
    LeftoverList,
    ListLeftovers,
    ListRuns,
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
    RunList,
    RunReply,
    Snapshot,
    Stop,
    StopReply,
    StreamEnd,
    VerifyReply,
    VerifyRun,
    WatchSnapshots,
    decode_request,
    encode,
)
from gpudeck.agents.snapshot import SnapshotBuilder
from gpudeck.agents.supervisor import Supervisor, hostname
from gpudeck.agents.telemetry import step_series

log = logging.getLogger("gpudeck.agent")

TICK_S = 0.5  # supervision tick: member discovery, exit detection
REPLY_DURABLE_S = 5.0  # a Launch/Stop/Reclaim reply waits this long at most for its journal records to be on disk
WRITE_BUFFER_LIMIT = 8 << 20  # a slower client than this skips snapshots instead of growing memory
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
        self._lock_fh = open(self.state_dir / "agent.lock", "a+")
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
        self._event_waiters: set[asyncio.Event] = set()  # one per following stream
        self.supervisor = Supervisor(
            self.journal, paths.runs_dir(self.state_dir), self.host, self.gpus, self.procs, on_event=self._on_event
        )
        self.snapshots = SnapshotBuilder(self.host, self.journal.epoch, self.gpus, self.procs, self.supervisor)
        self.supervisor.attribute = self.snapshots.attribute
        self.socket_path = paths.socket_path(self.state_dir)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()
        self.uid = os.getuid()
        # process scans and NVML samples run here, one at a time, never on the event loop: a big /proc or a
        # slow driver delays the snapshot that needs it, not a ping or another client's request
        self._sampler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpudeck-sample")

    async def snapshot(self) -> Snapshot:
        """A snapshot built off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._sampler, self.snapshots.build)

    # ------------------------------------------------------------------ lifecycle

    def _on_event(self, ev: Event) -> None:
        pass  # queued, not yet readable: followers are woken by the journal's commit (_on_commit)

    def _wake_followers(self) -> None:
        for waiter in self._event_waiters:
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
        notes = self.supervisor.adopt()
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
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve_conn, path=str(self.socket_path), limit=1 << 16)
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        self._spawn(self._tick_loop())
        monitor = os.environ.get(LOOP_MONITOR_ENV)
        if monitor:
            self._spawn(_loop_monitor(Path(monitor)))
        log.info("agent %s serving %s (GPUs: %s)", os.getpid(), self.socket_path, self.gpus.error or self.gpus.count)

    async def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        await self._stopped.wait()
        await self.close()

    async def close(self) -> None:
        """Stop serving; runs keep going (they outlive the agent by design)."""
        log.info("agent %s stopping; %d live run(s) keep going", os.getpid(), len(self.supervisor.live_runs()))
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            self.socket_path.unlink()
        except OSError:
            pass
        self._sampler.shutdown(wait=False, cancel_futures=True)
        self.supervisor.containment.release()
        await asyncio.to_thread(self.journal.close)  # commits what is queued
        self._lock_fh.close()

    async def _tick_loop(self) -> None:
        # the process scan runs in the sampler thread; the supervisor's own refresh of the table right after
        # finds nothing new (one read of /proc/loadavg), and its scans run in a thread: the tick on the loop
        # is only the runs' logic
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(self._sampler, self.procs.refresh)
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

    def _peer_uid(self, writer: asyncio.StreamWriter) -> int | None:
        sock = writer.get_extra_info("socket")
        if sock is None:
            return None
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        except OSError:
            return None
        _pid, uid, _gid = _PEERCRED.unpack(raw)
        return uid

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(self, reader, writer)
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


class _Conn:
    """One client connection: framing, dispatch, streams."""

    def __init__(self, agent: Agent, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.agent = agent
        self.reader = reader
        self.writer = writer
        self.frames = FrameReader()
        self.streams: dict[str, asyncio.Task] = {}
        self._wlock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.closed = False
        self.alias = ""  # what the client calls this host (from Hello), for the commands messages suggest

    async def send(self, msg: msgspec.Struct, droppable: bool = False) -> None:
        if self.closed:
            return
        if droppable and self.writer.transport.get_write_buffer_size() > WRITE_BUFFER_LIMIT:
            return
        async with self._wlock:
            try:
                self.writer.write(encode(msg))
                await self.writer.drain()
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
                data = await self.reader.read(65536)
                if not data:
                    break
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
                    self._start(req)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed = True
        finally:
            # the client may half-close after its last request (dial does): answer what is in flight
            for t in self.streams.values():
                t.cancel()
            pending = [t for t in self._tasks if not t.done()]
            if pending and not self.closed:
                await asyncio.gather(*pending, return_exceptions=True)
            await self.close()

    def _start(self, req: Request) -> None:
        task = asyncio.ensure_future(self._handle_safely(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if type(req) in _STREAMS and req.request_id:
            old = self.streams.pop(req.request_id, None)
            if old is not None:
                old.cancel()
            self.streams[req.request_id] = task

    async def _handle_safely(self, req: Request) -> None:
        rid = req.request_id
        try:
            await self._handle(req)
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

    async def _handle(self, req: Request) -> None:
        handler = _HANDLERS.get(type(req))
        if handler is None:  # pragma: no cover - decode_request only yields known types (a test checks the table is complete)
            raise BadRequest(f"unsupported request {type(req).__name__}")
        await handler(self, req)

    # one handler per request type; _HANDLERS (below the class) maps each type to its handler

    async def _hello(self, req: Hello) -> None:
        a = self.agent
        self.alias = req.host_alias[:253]
        if req.version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"protocol version {req.version} is not spoken here (agent {__version__} speaks {PROTOCOL_VERSION}); install the same gpudeck version on both ends"
            )
        await self.send(
            HelloReply(
                request_id=req.request_id,
                agent_version=__version__,
                host=a.host,
                epoch=a.journal.epoch,
                pid=os.getpid(),
                uid=a.uid,
                state_dir=str(a.state_dir),
                gpu_error=a.gpus.error,
                containment=a.supervisor.containment.label,
            )
        )

    async def _ping(self, req: Ping) -> None:
        await self.send(Pong(request_id=req.request_id, ts=time.time()))

    async def _get_snapshot(self, req: GetSnapshot) -> None:
        snap = await self.agent.snapshot()
        snap.request_id = req.request_id
        await self.send(snap)

    async def _watch_snapshots(self, req: WatchSnapshots) -> None:
        interval = max(0.05, min(req.interval_s, 3600.0))
        first = True
        while True:
            snap = await self.agent.snapshot()
            snap.request_id = req.request_id
            if req.compact and not first:
                snap.compact = True
                for g in snap.gpus:  # static facts went out with the first snapshot of this stream
                    g.uuid, g.name, g.memory_total, g.power_limit_w = "", "", 0, None
            first = False
            await self.send(snap, droppable=True)
            # a fixed rate on the wall clock's grid (every whole interval), not interval + work: every agent
            # of a fleet samples at the same instant (one coherent picture of the fleet), and the console
            # takes the fleet's snapshots in one burst rather than one wake-up per host
            delay = interval - time.time() % interval
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
        await self.send(
            LeftoverList(
                request_id=req.request_id,
                leftovers=found,
                gpus=a.supervisor.attributed_gpus() if a.gpus.available else [],
                gpu_error=a.gpus.error,
            )
        )

    async def _reclaim(self, req: Reclaim) -> None:
        result = await self.agent.supervisor.reclaim(req.pids, req.grace_s, req.include_live, host_name=self.alias or None)
        await self._settled()
        await self.send(StopReply(request_id=req.request_id, result=result))

    async def _fingerprint(self, req: Fingerprint) -> None:
        fp = await asyncio.to_thread(envs.fingerprint, req.python, driver=self.agent.gpus.driver_version)
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
        a._event_waiters.add(wake)
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
            a._event_waiters.discard(wake)

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
_HANDLERS: dict[type, Callable[[_Conn, Any], Awaitable[None]]] = {
    Hello: _Conn._hello,
    Ping: _Conn._ping,
    GetSnapshot: _Conn._get_snapshot,
    WatchSnapshots: _Conn._watch_snapshots,
    Launch: _Conn._launch,
    ListRuns: _Conn._list_runs,
    GetRun: _Conn._get_run,
    Stop: _Conn._stop,
    GetEvents: _Conn._events,
    ReadOutput: _Conn._output,
    GetMetrics: _Conn._get_metrics,
    Preflight: _Conn._preflight,
    ListLeftovers: _Conn._list_leftovers,
    Reclaim: _Conn._reclaim,
    Fingerprint: _Conn._fingerprint,
    RebuildEnv: _Conn._rebuild_env,
    VerifyRun: _Conn._verify_run,
    Cancel: _Conn._cancel,
}
# requests that open a stream (cancelled with Cancel, or replaced by a new one with the same request_id)
_STREAMS = frozenset({WatchSnapshots, GetEvents, ReadOutput})


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


def setup_logging(state_dir: Path) -> None:
    """Log to the agent's log file (stdout may be an SSH channel or nothing)."""
    handler = logging.FileHandler(paths.log_path(state_dir))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("gpudeck")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def serve(state_dir: Path | None = None) -> int:
    """``gpudeck agent serve``: run the agent in the foreground until SIGTERM."""
    sd = Path(state_dir or paths.state_dir())
    paths.ensure_private_dir(sd)
    setup_logging(sd)
    # `kill -USR1 <agent pid>` writes every thread's stack to the agent's log (a stuck agent says where it is)
    faulthandler.register(signal.SIGUSR1, file=open(paths.log_path(sd), "a"), all_threads=True)

    async def main() -> None:
        agent = Agent(sd)
        await agent.serve_forever()

    try:
        asyncio.run(main())
    except AlreadyRunning as exc:
        print(f"gpudeck agent: {exc.message}", file=sys.stderr)
        return 3
    except AgentError as exc:  # a bad setting (e.g. GPUDECK_SIMULATE_GPUS): say it and exit, never start half-configured
        log.error("agent cannot start: %s", exc.message)
        print(f"gpudeck agent: {exc.message}", file=sys.stderr)
        return 2
    return 0
