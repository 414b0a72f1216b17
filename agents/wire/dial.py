"""Provides ``gpudeck agent dial``: bridges stdin/stdout to the agent's socket, starting the agent if needed.

This is the command the console runs over SSH (an exec channel; it also works
as a forced command: ``restrict,command="gpudeck agent dial"`` in
``authorized_keys``). Bytes are copied both ways unchanged; the agent does all
parsing, so the bridge has nothing to get wrong.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

from gpudeck.agents.wire import paths


def connect(state_dir: Path, autostart: bool = True) -> socket.socket:
    """A connected Unix socket to the agent, started (detached) if none answers."""
    path = paths.socket_path(state_dir)
    proc = None
    deadline = 0.0
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return s
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            s.close()
            if not autostart:
                raise SystemExit(f"gpudeck agent dial: no agent answers on {path}: start one with `gpudeck agent serve`") from exc
            if proc is None:
                # the client's module (asyncio, msgspec) only when the agent must be started: every SSH connect runs this bridge
                from gpudeck.agents.wire.client import AGENT_START_TIMEOUT_S, spawn_agent

                proc = spawn_agent(state_dir)
                deadline = time.monotonic() + AGENT_START_TIMEOUT_S
            rc = proc.poll()
            if rc is not None and rc != 3:
                raise SystemExit(f"gpudeck agent dial: the agent exited at start (code {rc}): see {paths.log_path(state_dir)}") from exc
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"gpudeck agent dial: the agent did not answer within {AGENT_START_TIMEOUT_S:.0f} s: see {paths.log_path(state_dir)}"
                ) from exc
            time.sleep(0.05)


def _pump_in(sock: socket.socket, fd: int) -> None:
    try:
        while True:
            data = os.read(fd, 1 << 16)
            if not data:
                break
            sock.sendall(data)
    except OSError:
        pass
    finally:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def dial(state_dir: Path | None = None) -> int:
    """Bridge until the agent closes the connection (or stdin ends and the agent has answered)."""
    sd = Path(state_dir or paths.state_dir())
    sock = connect(sd)
    threading.Thread(target=_pump_in, args=(sock, sys.stdin.fileno()), daemon=True).start()
    out = sys.stdout.fileno()
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                break
            view = memoryview(data)
            while view:
                n = os.write(out, view)
                view = view[n:]
    except (BrokenPipeError, ConnectionResetError):
        return 1
    finally:
        sock.close()
    return 0
