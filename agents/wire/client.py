"""Provides the agent client: requests and streams over one connection, local or over SSH.

The client works on any byte stream pair with ``read(n)`` (a coroutine) and
``write(data)``/``drain()``: an asyncio Unix connection to the local agent, or
the stdin/stdout of ``gpudeck agent dial`` run over SSH.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec

from gpudeck.agents.wire import paths
from gpudeck.agents.wire.errors import AgentError, AgentUnavailable, PermissionDenied, VersionMismatch, from_wire
from gpudeck.agents.wire.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Error,
    FrameReader,
    Hello,
    HelloReply,
    Reply,
    StreamEnd,
    decode_reply,
    encode,
    speaks,
    versions_spoken,
)

AGENT_START_TIMEOUT_S = 20.0
log = logging.getLogger(__name__)
_ids = itertools.count(1)


def new_request_id(prefix: str = "q") -> str:
    """A request id unique within this process (and, with the pid and time, across processes)."""
    return f"{prefix}-{os.getpid()}-{int(time.time() * 1000) % 10**9}-{next(_ids)}"


class AgentClient:
    """Multiplexes requests and streams by request_id over one connection."""

    def __init__(self, reader: Any, writer: Any) -> None:
        """``reader``: an object with ``read(n)`` (a coroutine), pumped by a task; or None when the transport pushes
        bytes itself through :meth:`feed` / :meth:`feed_eof` (the SSH session does: no task wake-up per message)."""
        self._reader = reader
        self._writer = writer
        self._waiters: dict[str, asyncio.Queue] = {}
        # streams delivered by callback from the reader itself: no queue, no task switch per item
        self._handlers: dict[str, Callable[[Reply | None], None]] = {}
        self._frames = FrameReader(max_frame=64 << 20)
        self._wlock = asyncio.Lock()
        self.closed = asyncio.Event()
        self.close_reason = ""
        self.hello: HelloReply | None = None
        self.refusal: AgentError | None = None  # why the agent refused this connection (connection_limit), when it did
        self._kept: list[asyncio.Task] = []
        self._pump_task: asyncio.Future | None = asyncio.ensure_future(self._pump()) if reader is not None else None

    def keep(self, task: asyncio.Task) -> None:
        """Hold a helper task of the transport (e.g. an SSH stderr reader) and cancel it on close."""
        self._kept.append(task)

    @classmethod
    async def connect_unix(
        cls, sock: Path | None = None, *, autostart: bool = True, state_dir: Path | None = None, alias: str = ""
    ) -> AgentClient:
        """Connect to the local agent, starting it when ``autostart`` and none answers."""
        sd = Path(state_dir or paths.state_dir())
        path = Path(sock or paths.socket_path(sd))
        check_socket(path)
        try:
            proto, writer = await _dial(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if not autostart:
                raise AgentUnavailable(f"no agent answers on {path}: start one with `gpudeck agent serve`") from exc
            proto, writer = await _start_and_connect(sd, path)
        try:
            check_peer(writer.get_extra_info("socket"), path)
        except PermissionDenied:
            writer.close()
            raise
        client = cls(None, writer)
        proto.attach(client)
        await client.say_hello(alias=alias)
        return client

    async def say_hello(self, client_name: str = "gpudeck", alias: str = "") -> HelloReply:
        """Exchange Hello in PROTOCOL_VERSION, or in the one before when the agent (an older one) refuses that;
        raises VersionMismatch, naming both sides' versions, when the two share none."""
        try:
            reply = await self.request(Hello(client=client_name, host_alias=alias))
        except VersionMismatch as newest:
            if not speaks(PROTOCOL_VERSION - 1):
                raise
            try:
                reply = await self.request(Hello(client=client_name, host_alias=alias, version=PROTOCOL_VERSION - 1))
            except VersionMismatch:
                raise VersionMismatch(f"{newest.message} (this gpudeck speaks {versions_spoken()}: neither was accepted)") from None
        assert isinstance(reply, HelloReply)
        if not speaks(reply.version):
            raise VersionMismatch(
                f"the agent on {reply.host} (gpudeck {reply.agent_version}) answered in protocol version {reply.version}; "
                f"this gpudeck speaks {versions_spoken()}: upgrade the older of the two (`gpudeck --version` on each end)"
            )
        self.hello = reply
        return reply

    def feed(self, data: bytes) -> None:
        """Bytes from the agent: every complete frame is decoded and handed to its waiter or stream handler."""
        for frame in self._frames.feed(data):
            if frame is None:
                continue
            try:
                msg = decode_reply(frame)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                continue  # a line we cannot read (a newer agent's message, garbage) is skipped
            if isinstance(msg, Error) and not msg.request_id:  # about the connection: the agent closes it next
                if msg.code == "busy":
                    self.close_reason = f"the agent is busy: {msg.message}"
                else:
                    self.refusal = from_wire(msg.code, msg.message)  # raised by what waits on the connection
                    self.close_reason = msg.message
            handler = self._handlers.get(msg.request_id)
            if handler is not None:
                if isinstance(msg, (StreamEnd, Error)):
                    self._handlers.pop(msg.request_id, None)
                try:
                    handler(msg)
                except Exception:  # a consumer's bug must not take the connection (and every other request) down
                    log.exception("stream handler for %s failed", msg.request_id)
                continue
            q = self._waiters.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)

    def feed_eof(self, reason: str) -> None:
        """The connection ended: every waiter and stream learns it (once)."""
        if self.closed.is_set():
            return
        self.close_reason = self.close_reason or reason
        self.closed.set()
        for q in self._waiters.values():
            q.put_nowait(None)
        handlers, self._handlers = self._handlers, {}
        for handler in handlers.values():
            handler(None)

    async def _pump(self) -> None:
        reason = "the agent closed the connection"
        try:
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    break
                self.feed(data.encode() if isinstance(data, str) else data)
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
            reason = f"connection lost: {exc}"
        except asyncio.CancelledError:
            reason = "closed"
            raise
        finally:
            self.feed_eof(reason)

    async def _send(self, msg: msgspec.Struct) -> None:
        if self.closed.is_set():
            raise AgentUnavailable(f"the agent connection is closed ({self.close_reason})")
        try:
            async with self._wlock:
                self._writer.write(encode(msg))
                await self._writer.drain()
        except (ConnectionError, BrokenPipeError) as exc:
            # the agent closed the connection: it may have said why first (a refusal), which the reader still has
            try:
                async with asyncio.timeout(1.0):
                    await self.closed.wait()
            except TimeoutError:
                pass
            if self.refusal is not None:
                raise self.refusal from None
            raise AgentUnavailable(f"the agent connection closed ({self.close_reason or exc})") from None

    async def request(self, msg: Any, timeout: float | None = None) -> Reply:
        """Send one request and return its reply; an Error reply raises the typed error."""
        if not msg.request_id:
            msg.request_id = new_request_id()
        q: asyncio.Queue = asyncio.Queue()
        self._waiters[msg.request_id] = q
        try:
            await self._send(msg)
            async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel that races the reply
                reply = await q.get()
        finally:
            self._waiters.pop(msg.request_id, None)
        if reply is None:
            if self.refusal is not None:
                raise self.refusal
            raise AgentUnavailable(f"the agent connection closed before it answered ({self.close_reason})")
        if isinstance(reply, Error):
            raise from_wire(reply.code, reply.message)
        return reply

    async def stream(self, msg: Any) -> AsyncIterator[Reply]:
        """Send a streaming request; yield its items until StreamEnd. Breaking out cancels it."""
        if not msg.request_id:
            msg.request_id = new_request_id("s")
        q: asyncio.Queue = asyncio.Queue()
        self._waiters[msg.request_id] = q
        finished = False
        try:
            await self._send(msg)
            while True:
                item = await q.get()
                if item is None:
                    raise AgentUnavailable(f"the agent connection closed during the stream ({self.close_reason})")
                if isinstance(item, Error):
                    finished = True
                    raise from_wire(item.code, item.message)
                if isinstance(item, StreamEnd):
                    finished = True
                    return
                yield item
        finally:
            if not finished and not self.closed.is_set():
                try:
                    await self._send(Cancel(request_id=new_request_id("c"), target=msg.request_id))
                except Exception:
                    pass
            self._waiters.pop(msg.request_id, None)

    async def watch(self, msg: Any, on_item: Callable[[Reply | None], None]) -> str:
        """Start a stream whose items go straight to ``on_item`` from the reader (StreamEnd/Error end it; None: the
        connection closed). For high-rate streams (snapshots of hundreds of hosts). Returns the request id."""
        if not msg.request_id:
            msg.request_id = new_request_id("w")
        self._handlers[msg.request_id] = on_item
        try:
            await self._send(msg)
        except BaseException:
            self._handlers.pop(msg.request_id, None)
            raise
        return msg.request_id

    async def unwatch(self, request_id: str) -> None:
        """End a stream started with :meth:`watch`."""
        if self._handlers.pop(request_id, None) is not None and not self.closed.is_set():
            try:
                await self._send(Cancel(request_id=new_request_id("c"), target=request_id))
            except Exception:
                pass

    async def close(self) -> None:
        """Close the connection."""
        try:
            if hasattr(self._writer, "write_eof") and not self.closed.is_set():
                self._writer.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            pass
        self._writer.close()
        for t in self._kept:
            t.cancel()
        if self._pump_task is None:
            self.feed_eof("closed")
            return
        self._pump_task.cancel()
        try:
            await self._pump_task
        except (asyncio.CancelledError, Exception):
            pass


def check_socket(path: Path) -> None:
    """Refuse an agent socket that is a link, not a socket, or not owned by this user (or root), before connecting."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # nothing there yet: the agent is started, or the connection says so
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISSOCK(st.st_mode):
        raise PermissionDenied(
            f"{path} is not a Unix socket (a link or a file put there?): nothing was sent; remove it and run `gpudeck agent serve`"
        )
    if st.st_uid not in (me, 0):
        raise PermissionDenied(
            f"the agent socket {path} belongs to uid {st.st_uid}, not to you (uid {me}): nothing was sent to it (another user's "
            f"process would see every request); remove it, or use a GPUDECK_HOME of your own"
        )
    paths.check_path(path.parent)


def check_peer(sock: socket.socket | None, path: Path) -> None:
    """Refuse the connection when the process answering on it runs as another user (not this one, not root)."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid not in (os.geteuid(), 0):
        raise PermissionDenied(
            f"the process answering on {path} runs as uid {uid}, not as you (uid {os.geteuid()}): nothing was sent to it"
        )


def spawn_agent(state_dir: Path) -> subprocess.Popen:
    """Start ``python -m gpudeck.agents serve`` detached, in its own session, logging to agent.log."""
    paths.ensure_private_dir(state_dir)
    log = open(paths.private_file(paths.log_path(state_dir)), "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "gpudeck.agents", "serve", "--state-dir", str(state_dir)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=str(state_dir),
            start_new_session=True,
            close_fds=True,
        )
    finally:
        log.close()


class _Pushed(asyncio.StreamReaderProtocol):
    """A Unix connection to the agent whose bytes go from the transport straight to :meth:`AgentClient.feed`, as the
    SSH session's do: no pump task, so one wake-up of the event loop less per reply (bench/agent_snapshot.py). What
    arrives before the client is attached (a refusal can come at once) is kept for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.reader = asyncio.StreamReader(limit=1 << 20, loop=loop)  # unused: the StreamWriter wants one
        super().__init__(self.reader, loop=loop)
        self._client: AgentClient | None = None
        self._early: list[bytes] = []
        self._ended: str | None = None

    def attach(self, client: AgentClient) -> None:
        """From now on, bytes and the end of the connection go to ``client`` (with what came before)."""
        self._client = client
        for data in self._early:
            client.feed(data)
        self._early = []
        if self._ended is not None:
            client.feed_eof(self._ended)

    def data_received(self, data: bytes) -> None:
        if self._client is None:
            self._early.append(data)
        else:
            self._client.feed(data)

    def eof_received(self) -> bool:
        self._end("the agent closed the connection")
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._end(f"connection lost: {exc}" if exc else "the agent closed the connection")

    def _end(self, reason: str) -> None:
        if self._client is None:
            self._ended = self._ended or reason
        else:
            self._client.feed_eof(reason)


async def _dial(path: Path) -> tuple[_Pushed, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_unix_connection(lambda: _Pushed(loop), str(path))
    return proto, asyncio.StreamWriter(transport, proto, proto.reader, loop)


async def _start_and_connect(state_dir: Path, path: Path) -> tuple[_Pushed, asyncio.StreamWriter]:
    proc = spawn_agent(state_dir)
    deadline = time.monotonic() + AGENT_START_TIMEOUT_S
    delay = 0.02
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return await _dial(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            last = exc
        rc = proc.poll()
        if rc is not None and rc != 3:  # 3: another agent won the race; keep trying to connect
            raise AgentUnavailable(f"the agent exited at start (code {rc}): see {paths.log_path(state_dir)}")
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.2)
    raise AgentUnavailable(f"the agent did not open {path} within {AGENT_START_TIMEOUT_S:.0f} s ({last}): see {paths.log_path(state_dir)}")
