"""A far side that takes the SSH login and then never opens the session (issue 33): a real sshd whose processes for
the connection are stopped (SIGSTOP) between the login and the channel open.

Stopping them from outside between asyncssh's login and its channel open (one loop turn apart) cannot be timed, so the
test logs in with asyncssh itself, stops that connection's sshd processes, then runs the step ``connect_ssh`` runs next,
:func:`~gpudeck.console.fleet.transport.open_agent_session`, with a limit of a few seconds instead of the production one.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator

import asyncssh
import psutil
import pytest

from gpudeck.console.fleet.transport import SESSION_TIMEOUT_S, SshError, connect_ssh, open_agent_session
from tests.sshd_harness import ConsoleSide, SshHost

pytestmark = pytest.mark.slow

LIMIT_S = 2.0  # the test's limit; the bound asserted on it is 10x, for a busy 2-core machine


@pytest.fixture
def wedged() -> Iterator[tuple[ConsoleSide, SshHost]]:
    c = ConsoleSide()
    try:
        h = SshHost("wedged", c.pub).start()
        c.add(h)
        yield c, h
    finally:
        c.cleanup()


@contextlib.asynccontextmanager
async def _logged_in_then_stopped(c: ConsoleSide, host: SshHost) -> AsyncIterator[asyncssh.SSHClientConnection]:
    """An asyncssh connection to ``host`` past its login, with that connection's sshd processes stopped; resumed after,
    when they must find their connection gone and end."""
    assert host.proc is not None
    # keepalives off: without a limit the channel open would wait for good (with gpudeck's 10 s x 3 it ends after ~40 s
    # as "SSH connection closed", saying nothing of what hung)
    conn = await asyncssh.connect(
        host.name, config=[str(c.ssh_config)], known_hosts=str(c.known_hosts), keepalive_interval=0, connect_timeout=60
    )
    stopped: list[psutil.Process] = []
    try:
        # the listener's descendants are this one connection's sshd processes (it serves nothing else); the listener
        # itself keeps running
        kids = psutil.Process(host.proc.pid).children(recursive=True)
        assert kids, "no sshd process serves the connection that just logged in"
        for p in kids:
            p.send_signal(signal.SIGSTOP)
            stopped.append(p)
        yield conn
    finally:
        for p in stopped:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass  # its parent, resumed first, already ended it
        conn.close()
    _gone, alive = psutil.wait_procs(stopped, timeout=15)
    assert not alive, [p.pid for p in alive]


async def test_a_far_side_that_logs_in_and_never_opens_the_session_is_an_error_within_the_limit(
    wedged: tuple[ConsoleSide, SshHost],
) -> None:
    c, host = wedged
    async with _logged_in_then_stopped(c, host) as conn:
        t0 = time.monotonic()
        with pytest.raises(SshError) as err:
            await open_agent_session(conn, "wedged", "gpudeck agent dial", {}, timeout_s=LIMIT_S)
        took = time.monotonic() - t0
        assert err.value.message == (
            "wedged: the SSH login worked, but the far side did not open a session within 2 s: check sshd on wedged "
            "(overloaded? at its MaxSessions? a hung or stopped sshd-session process: `ps -o pid,stat,args -C sshd,sshd-session` there)"
        )
        assert "\n" not in str(err.value) and "Traceback" not in str(err.value)
        assert LIMIT_S * 0.9 <= took < LIMIT_S * 10, took  # it waited for the limit, and no longer than a generous bound of it
        # the connection was closed with the error, though the far side is still stopped
        await asyncio.wait_for(conn.wait_closed(), 10)
    # the host itself is fine: a whole connect, through the same session open under the production limit, reaches its agent
    assert SESSION_TIMEOUT_S > LIMIT_S
    link = await connect_ssh("wedged", "gpudeck agent dial", c.ssh_options())
    try:
        assert link.client.hello is not None
    finally:
        await link.close()


async def test_a_session_open_cancelled_while_the_far_side_hangs_closes_the_connection(wedged: tuple[ConsoleSide, SshHost]) -> None:
    """A link closed (the console quitting, the CLI done) while its session open waits does not leave the login open."""
    c, host = wedged
    async with _logged_in_then_stopped(c, host) as conn:
        opening = asyncio.ensure_future(open_agent_session(conn, "wedged", "gpudeck agent dial", {}, timeout_s=600))
        await asyncio.sleep(0.5)
        assert not opening.done()
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        await asyncio.wait_for(conn.wait_closed(), 10)
