"""The agent socket against the worst clients: ones that send and never read, hold a thousand idle connections,
leave half a frame, or all of it at once while the agent is told to stop. Real agent processes, real Unix sockets,
real file-descriptor limits (RLIMIT_NOFILE lowered for the agent). Figures are printed, never asserted as speeds.

The bound (README, Reliability): per connection the StreamReader's 128 KiB, the framer's partial line (1 MiB), at most
8 requests in flight with their replies and 16 streams, and 1 MiB of replies waiting unread; at most 256 connections
(fewer under a low RLIMIT_NOFILE: 64 fds stay reserved for supervision, 32 more of headroom).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import psutil
import pytest

from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Launch, LaunchSpec, Ping
from tests.agent_harness import AgentProc, run_state, teardown_agent, wait_for

pytestmark = pytest.mark.slow
PY = sys.executable
MiB = 1 << 20


class LimitedAgent(AgentProc):
    """An agent started with RLIMIT_NOFILE lowered (soft and hard, so it cannot raise it back)."""

    def __init__(self, home: Path, nofile: int) -> None:
        super().__init__(home)
        self.nofile = nofile

    def _limit(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def start(self) -> LimitedAgent:
        real = subprocess.Popen

        def popen(*a, **k):  # type: ignore[no-untyped-def]
            k["preexec_fn"] = self._limit
            return real(*a, **k)

        with mock.patch.object(subprocess, "Popen", popen):
            super().start()
        return self


@pytest.fixture(autouse=True)
def _many_fds() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < min(hard, 8192):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))


def _sock_path(a: AgentProc) -> str:
    return str(a.state_dir / "sock" / "agent.sock")


def _connect(a: AgentProc) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(_sock_path(a))
    return s


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


async def _ping(a: AgentProc, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    c = await a.client()
    try:
        await c.request(Ping(), timeout=timeout)
    finally:
        await c.close()
    return time.monotonic() - t0


async def _client_given_a_place(a: AgentProc, limit: float = 60.0) -> AgentClient:
    """A client connected once the agent has a place for it: at the cap, every try before the longest idle connection
    has been silent IDLE_EVICT_S is refused as busy at Hello (nothing sent yet), so it is tried again. Waiting for
    that instead of sleeping past IDLE_EVICT_S: the connections opened first are idle that long already when a slow
    loop of connects ends. ``limit`` is a hang guard only."""
    deadline = time.monotonic() + limit
    while True:
        try:
            return await a.client()
        except AgentError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


async def _ping_given_a_place(a: AgentProc) -> float:
    """Seconds of a Ping on a client that has found a place (see _client_given_a_place)."""
    c = await _client_given_a_place(a)
    try:
        t0 = time.monotonic()
        await c.request(Ping(), timeout=30)
        return time.monotonic() - t0
    finally:
        await c.close()


def _read_frames(s: socket.socket, timeout: float = 10.0) -> tuple[list[dict], bool]:
    """Frames the agent sends until it closes (or ``timeout``); (frames, closed)."""
    s.settimeout(timeout)
    buf = b""
    closed = False
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                break
            buf += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return [json.loads(line) for line in buf.splitlines() if line.strip()], closed


def _output_run(a: AgentProc) -> str:
    """A finished run with 4 MiB of output: every ReadOutput of it is a 256 KiB reply."""
    rid = a.cli_json("launch", "--name", "loud", "--", PY, "-c", "import sys; sys.stdout.write('y' * (4 << 20))")["id"]
    wait_for(lambda: run_state(a, rid) == "succeeded", timeout=60, what="the loud run")
    return rid


def _flood(s: socket.socket, rid: str, seconds: float) -> int:
    """Send ReadOutput requests without ever reading; bytes the agent took before the socket stopped taking more."""
    s.setblocking(False)
    line = json.dumps({"type": "read_output", "request_id": "x", "run_id": rid, "offset": 0, "max_bytes": 256 * 1024}).encode() + b"\n"
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            sent += s.send(line * 64)
        except BlockingIOError:
            time.sleep(0.05)
        except OSError:  # closed by the agent (busy, or evicted)
            break
    return sent


def _flood_all(hogs: list[socket.socket], rid: str, seconds: float) -> list[int]:
    """_flood on every socket at once, each for ``seconds`` (one after the other took len(hogs) times as long)."""
    with ThreadPoolExecutor(max_workers=len(hogs)) as pool:
        return list(pool.map(lambda s: _flood(s, rid, seconds), hogs))


def test_a_client_that_sends_and_never_reads_stalls_only_itself_and_the_agent_stays_small(agent: AgentProc) -> None:
    rid = _output_run(agent)
    base = _rss(agent.pid)
    hogs = [_connect(agent) for _ in range(4)]
    sent = _flood_all(hogs, rid, 4.0)
    peak = _rss(agent.pid)
    more = _flood_all(hogs, rid, 2.0)  # still stalled: the agent does not read them any more
    peak = max(peak, _rss(agent.pid))
    ping_s = asyncio.run(_ping(agent))
    print(
        f"\n4 clients sending ReadOutput (256 KiB replies) and never reading: took {[n // 1024 for n in sent]} KiB, "
        f"then {[n // 1024 for n in more]} KiB more; agent RSS {base / MiB:.0f} -> {peak / MiB:.0f} MiB; a fresh ping {ping_s * 1000:.0f} ms"
    )
    assert all(n < 16 * MiB for n in sent), "the agent stops reading a connection whose replies are not read"
    assert peak - base < 400 * MiB  # 4 x (16 streams x 256 KiB + 1 MiB unread + 1 MiB framer) is ~24 MiB; far from the GBs of before
    for s in hogs:
        s.close()
    assert asyncio.run(_ping(agent)) < 30


def test_connections_past_the_cap_get_a_typed_busy_error_and_idle_ones_make_room(gpudeck_home: Path) -> None:
    a = LimitedAgent(gpudeck_home, nofile=192).start()  # cap = 160 - 64 reserved - 32 headroom - the agent's own fds
    held: list[socket.socket] = []
    try:
        extra = []
        for _ in range(200):
            s = _connect(a)
            held.append(s)
        time.sleep(1.0)
        for s in held:
            frames, closed = _read_frames(s, timeout=0.05)
            if closed:
                extra.append(frames)
        print(f"\n200 connections on an agent with RLIMIT_NOFILE 192: {200 - len(extra)} served, {len(extra)} got busy and were closed")
        assert extra and all(f and f[0]["type"] == "error" and f[0]["code"] == "busy" for f in extra), extra[:3]
        assert "connections at most" in extra[0][0]["message"]
        # the served ones are idle: past IDLE_EVICT_S a fresh client takes the place of the longest idle one
        ping_s = asyncio.run(_ping_given_a_place(a))
        print(f"a fresh client's ping with the cap taken by idle connections: {ping_s * 1000:.0f} ms")
    finally:
        for s in held:
            s.close()
        teardown_agent(a)


def test_a_thousand_idle_connections_under_a_low_nofile_leave_ping_launch_and_tick_working(gpudeck_home: Path) -> None:
    a = LimitedAgent(gpudeck_home, nofile=256).start()
    held: list[socket.socket] = []
    try:
        for _ in range(1000):
            try:
                held.append(_connect(a))
            except OSError as exc:  # the backlog is full while the agent works through it: that is the kernel's "busy"
                print(f"connect refused by the kernel: {exc}")
                time.sleep(0.01)
        fds = psutil.Process(a.pid).num_fds()
        print(f"\n1000 idle connections, agent RLIMIT_NOFILE 256: the agent holds {fds} fds")
        assert fds <= 256 - 32, "the reserve for supervision is kept"
        # once the served connections are idle past IDLE_EVICT_S a fresh client takes one's place
        ping_s = asyncio.run(_ping_given_a_place(a))

        async def launch() -> str:
            c = await _client_given_a_place(a)
            try:
                r = await c.request(Launch(spec=LaunchSpec(argv=[PY, "-c", "import time; time.sleep(0.5)"], name="through")), timeout=60)
                return r.run.id  # type: ignore[union-attr]
            finally:
                await c.close()

        rid = asyncio.run(launch())
        # the tick sees it start and end (it opens /proc files, the run's files and the journal: no EMFILE)
        wait_for(lambda: asyncio.run(_state(a, rid)) == "succeeded", timeout=60, interval=1.0, what="the tick to see the run end")
        log = (a.state_dir / "agent.log").read_text()
        print(
            f"fresh ping {ping_s * 1000:.0f} ms; run {rid} launched and seen ending by the tick; fds now {psutil.Process(a.pid).num_fds()}"
        )
        assert "Too many open files" not in log and "supervision tick failed" not in log, log[-2000:]
    finally:
        for s in held:
            s.close()
        teardown_agent(a)


async def _state(a: AgentProc, rid: str) -> str | None:
    from gpudeck.agents.wire.protocol import GetRun

    c = await _client_given_a_place(a)  # every place may be taken by a fresh idle connection until one can be evicted
    try:
        r = await c.request(GetRun(run_id=rid), timeout=30)
        return r.run.state  # type: ignore[union-attr]
    finally:
        await c.close()


def test_sigterm_is_answered_within_a_second_whatever_the_clients_do_and_memory_stays_bounded(agent: AgentProc) -> None:
    rid = _output_run(agent)
    base = _rss(agent.pid)
    held: list[socket.socket] = []
    # the worst mix: readers that never read with requests in flight; connections up to the cap, each with 1 MiB of
    # a frame and no newline; and more connections than the cap
    hogs = [_connect(agent) for _ in range(4)]
    _flood_all(hogs, rid, 2.0)
    for i in range(300):
        try:
            s = _connect(agent)
        except OSError:
            continue
        held.append(s)
        if i < 120:
            s.settimeout(5.0)
            try:  # all of it: the agent reads it into that connection's framer
                s.sendall(b'{"type": "ping", "request_id": "' + b"a" * (MiB - 40))
            except OSError:  # refused as busy past the cap
                pass
    time.sleep(2.0)
    peak = _rss(agent.pid)
    proc = psutil.Process(agent.pid)
    print(f"\nworst clients: agent RSS {base / MiB:.0f} -> {peak / MiB:.0f} MiB (peak {peak / MiB:.0f} MiB) with {proc.num_fds()} fds")
    assert peak - base < 1024 * MiB
    t0 = time.monotonic()
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.proc is not None
    rc = agent.proc.wait(30)  # a hang guard only
    took = time.monotonic() - t0
    print(f"SIGTERM to exit with {len(held)} connections (120 half-sent 1 MiB frames) and 4 stalled readers: {took:.3f} s, rc {rc}")
    assert rc == 0
    for s in held + hogs:
        s.close()
    agent.start()  # and a new agent comes up on the same state
    assert asyncio.run(_ping(agent)) < 30
