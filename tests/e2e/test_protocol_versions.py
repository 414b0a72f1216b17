"""Hosts and consoles need not upgrade in lock-step: the agent accepts a Hello of its protocol version or the one
before (N-1..N) and refuses any other naming both; a client refused in N by an older agent says Hello again in N-1.
Real agents: today's, and today's made to speak an older or a newer range (its protocol module's versions changed
before anything else runs); hand-made Hello frames on a raw socket."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.errors import VersionMismatch
from gpudeck.agents.wire.protocol import OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION, Ping
from tests.agent_harness import AgentProc, teardown_agent

N = PROTOCOL_VERSION


def _hello(agent: AgentProc, version: int) -> list[dict]:
    """A hand-made Hello of ``version`` then a Ping on one connection: the replies (two, or one and the close)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(agent.state_dir / "sock" / "agent.sock"))
    s.sendall(json.dumps({"type": "hello", "request_id": "h", "version": version}).encode() + b'\n{"type":"ping","request_id":"p"}\n')
    buf = b""
    while buf.count(b"\n") < 2:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    return [json.loads(line) for line in buf.splitlines()]


def test_the_agent_accepts_n_minus_1_and_n_and_refuses_others_naming_both(agent: AgentProc) -> None:
    assert OLDEST_PROTOCOL_VERSION == N - 1
    for version in (N - 1, N):
        hello, pong = _hello(agent, version)
        assert hello["type"] == "hello_reply" and hello.get("version", N) == version, hello  # the connection speaks it
        assert pong["type"] == "pong"
    for version in (N + 1, N - 2, 999):
        err = _hello(agent, version)[0]
        assert err["type"] == "error" and err["code"] == "unsupported_version", err
        assert f"protocol version {version};" in err["message"] and f"speaks {N - 1} and {N}" in err["message"], err["message"]


class ShiftedAgent(AgentProc):
    """Today's agent speaking versions ``newest - 1 .. newest`` (as an older or newer release would)."""

    def __init__(self, home: Path, newest: int) -> None:
        code = (
            "import sys\nimport gpudeck.agents.wire.protocol as p\n"
            f"p.PROTOCOL_VERSION, p.OLDEST_PROTOCOL_VERSION = {newest}, {newest - 1}\n"
            "from gpudeck.agents.__main__ import main\n"
            "sys.exit(main(sys.argv[sys.argv.index('gpudeck.agents') + 1:]))\n"
        )
        super().__init__(home, prefix=(sys.executable, "-c", code))


@pytest.fixture
def shifted(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ShiftedAgent]:
    a = ShiftedAgent(tmp_path / "home", request.param).start()
    yield a
    teardown_agent(a)


async def _connect(a: AgentProc) -> AgentClient:
    return await AgentClient.connect_unix(state_dir=a.state_dir, autostart=False)


@pytest.mark.parametrize("shifted", [N - 1], indirect=True)
def test_a_console_talks_to_an_agent_one_version_older(shifted: ShiftedAgent) -> None:
    async def go() -> int:
        c = await _connect(shifted)
        try:
            assert c.hello is not None
            await c.request(Ping())
            return c.hello.version
        finally:
            await c.close()

    assert asyncio.run(go()) == N - 1  # refused in N, accepted in N-1


@pytest.mark.parametrize("shifted", [N + 1], indirect=True)
def test_an_agent_one_version_newer_talks_to_this_console(shifted: ShiftedAgent) -> None:
    async def go() -> int:
        c = await _connect(shifted)
        try:
            assert c.hello is not None
            return c.hello.version
        finally:
            await c.close()

    assert asyncio.run(go()) == N


@pytest.mark.parametrize("shifted", [N + 2], indirect=True)
def test_two_versions_apart_is_refused_naming_both(shifted: ShiftedAgent) -> None:
    with pytest.raises(VersionMismatch) as caught:
        asyncio.run(_connect(shifted))
    msg = caught.value.message
    assert f"speaks {N + 1} and {N + 2}" in msg and f"this gpudeck speaks {N - 1} and {N}" in msg, msg
