"""Provides the metrics endpoint's HTTP server: one thread however many connections, and a bounded pool for the app.

prometheus_client's threading WSGI server started a thread per connection, and a connection that never finished
its request held its thread for ever (950 half-open connections: 957 threads). Here one asyncio loop in one thread
reads every request head (at most :data:`MAX_HEAD` bytes, within :data:`HEAD_TIMEOUT_S`, else the connection is
closed), at most :data:`MAX_CONNECTIONS` connections are open at once (past that, the one that has waited longest
for its head is closed: a scraper that sends its request at once is always served), and the WSGI app runs in a pool
of :data:`APP_THREADS` threads. One request per connection (``Connection: close``); a body is not read.
"""

from __future__ import annotations

import asyncio
import io
import socket
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

MAX_CONNECTIONS = 128
BACKLOG = 1024  # connections the kernel holds until the loop accepts them (no thread, no buffer of ours)
HEAD_TIMEOUT_S = 10.0  # a request head not complete by then: the connection is closed
MAX_HEAD = 16 * 1024  # bytes of request line and headers
WRITE_TIMEOUT_S = 30.0  # a reader that does not take the answer within this is dropped
APP_THREADS = 2  # the app answers from a cache: two threads keep a live (name[]) render from holding up a cached answer

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class WsgiServer:
    """Serves a WSGI app on one address from one asyncio thread (see the module)."""

    def __init__(self, app: WsgiApp) -> None:
        self.app = app
        self._pool = ThreadPoolExecutor(APP_THREADS, thread_name_prefix="metrics-app")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._open: OrderedDict[asyncio.StreamWriter, bool] = OrderedDict()  # writer -> still waiting for its head
        self.address: tuple[str, int] = ("", 0)

    def start(self, addr: str, port: int) -> int:
        """Bind ``addr:port`` (0: any free port; OSError when it cannot) and serve from a thread of its own; the port bound."""
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.create_server((addr, port), family=family, backlog=BACKLOG)
        self.address = (addr, int(sock.getsockname()[1]))
        self._thread = threading.Thread(target=self._run, args=(sock,), name="metrics-serve", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        return self.address[1]

    def shutdown(self) -> None:
        """Stop serving: open connections are closed, the thread ends."""
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, sock: socket.socket) -> None:
        asyncio.run(self._main(sock))

    async def _main(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        server = await asyncio.start_server(self._serve, sock=sock, limit=MAX_HEAD)
        self._ready.set()
        async with server:
            await self._stopped.wait()
            for w in list(self._open):
                w.close()

    def open_connections(self) -> int:
        """Connections open now (tests, the bound)."""
        return len(self._open)

    def _make_room(self) -> None:
        while len(self._open) >= MAX_CONNECTIONS:
            waiting = next((w for w, head_pending in self._open.items() if head_pending), None)
            victim = waiting if waiting is not None else next(iter(self._open))
            self._open.pop(victim)
            victim.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._make_room()
        self._open[writer] = True
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
                return
            if writer not in self._open:
                return  # closed to make room while its head came
            self._open[writer] = False
            environ = self._environ(head)
            if environ is None:
                status, headers, body = "400 Bad Request", [("Content-Type", "text/plain")], b"bad request\n"
            else:
                loop = asyncio.get_running_loop()
                status, headers, body = await loop.run_in_executor(self._pool, self._call, environ)
                if environ["REQUEST_METHOD"] == "HEAD":
                    body = b""
            out = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers if k.lower() not in ("content-length", "connection"))]
            out += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
            writer.write("\r\n".join(out).encode("latin-1") + body)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self._open.pop(writer, None)
            writer.close()

    def _environ(self, head: bytes) -> dict[str, Any] | None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return None
        method, target, version = parts
        path, _, query = target.partition("?")
        addr, port = self.address
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method,
            "PATH_INFO": unquote(path, encoding="latin-1"),
            "QUERY_STRING": query,
            "SERVER_NAME": addr,
            "SERVER_PORT": str(port),
            "SERVER_PROTOCOL": version,
            "SCRIPT_NAME": "",
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(b""),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                continue
            key = name.strip().upper().replace("-", "_")
            environ[key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"] = value.strip()
        return environ

    def _call(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        answer: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            answer["status"], answer["headers"] = status, headers

        try:
            body = b"".join(self.app(environ, start_response))
            return answer["status"], answer["headers"], body
        except Exception as exc:  # the app's failure is this request's 500, never the server's end
            print(f"gpudeck watch: metrics request failed ({type(exc).__name__}: {exc})", file=sys.stderr)
            return "500 Internal Server Error", [("Content-Type", "text/plain")], b"internal error\n"
