"""`gpudeck console` quits cleanly on SIGTERM and SIGHUP, as on `q`.

A `kill`, a service manager stopping it, or the SSH session that carries the operator's terminal going away
(SIGHUP) must not leave what a quit cleans up: the per-host SSH config folder the console writes in memory
(console/fleet/transport.py), a terminal left in the alternate screen, a history writer cut mid-transaction. The
real console in a real pseudo-terminal, following a real host behind a real sshd.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.agent_harness import stop_runs
from tests.sshd_harness import ConsoleSide, SshHost, short_tmp

pytestmark = pytest.mark.slow


@pytest.fixture
def one_host():  # type: ignore[no-untyped-def]
    c = ConsoleSide()
    c.add(SshHost("hosta", c.pub).start())
    with open(c.ssh_config, "a") as fh:  # a fleet-sized ssh config: big enough that the console writes each host's part
        for i in range(400):
            fh.write(f"Host other{i:03d}\n    HostName 127.0.0.1\n    Port 9\n\n")
    c.cli("hosts", "add", "hosta")
    yield c
    for h in c.hosts:
        stop_runs(h.agent)
    c.cleanup()


def _console(env: dict[str, str], ignore_hup: bool = False) -> tuple[int, int]:
    pid, fd = pty.fork()
    if pid == 0:
        try:
            if ignore_hup:  # as nohup starts it
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
            os.execve(sys.executable, [sys.executable, "-m", "gpudeck.console.cli.main", "console"], env)
        finally:
            os._exit(127)
    return pid, fd


def _end(pid: int, fd: int) -> None:
    """The console this test started, killed by its pid if it still runs and reaped; its terminal closed."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    os.close(fd)


def _read(fd: int, seconds: float) -> bytes:
    out = bytearray()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child is gone: EIO on the pty
                break
            if not chunk:
                break
            out += chunk
    return bytes(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_the_console_quits_cleanly_on_a_signal(one_host: ConsoleSide, sig: int) -> None:
    runtime = short_tmp("gd-xdg-")  # where the console writes its per-host SSH configs (XDG_RUNTIME_DIR first)
    env = {**one_host.env, "XDG_RUNTIME_DIR": str(runtime), "TERM": "xterm-256color"}
    pid, fd = _console(env)
    try:
        seen = bytearray()
        deadline = time.monotonic() + 90
        # up: hosta's row on the Fleet screen, and the folder its connection's config went through
        while time.monotonic() < deadline and not (b"hosta" in seen and list(runtime.glob("gpudeck-ssh-*"))):
            seen += _read(fd, 0.5)
        assert b"hosta" in seen, f"the console never showed hosta; its screen ended with {bytes(seen[-2000:])!r}"
        assert list(runtime.glob("gpudeck-ssh-*")), "the console wrote no per-host SSH config folder to clean up"
        seen += _read(fd, 2.0)  # let it settle a moment on the Fleet screen

        t0 = time.monotonic()
        os.kill(pid, sig)
        tail = bytearray()
        status = None
        while time.monotonic() - t0 < 60:
            tail += _read(fd, 0.2)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
        else:
            pytest.fail(f"the console did not exit within 60 s of signal {sig}")
        took = time.monotonic() - t0
        assert status is not None
        assert os.WIFEXITED(status), (
            f"the console died by signal {os.WTERMSIG(status) if os.WIFSIGNALED(status) else '?'} instead of quitting"
        )
        assert os.WEXITSTATUS(status) == 128 + sig
        assert b"\x1b[?1049l" in tail, "the terminal was not given back (still in the alternate screen)"
        assert not list(runtime.glob("gpudeck-ssh-*")), f"left behind: {[p.name for p in runtime.iterdir()]}"
        assert took < 30, f"quitting took {took:.1f} s"
    finally:
        _end(pid, fd)
        for p in sorted(Path(runtime).glob("**/*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        runtime.rmdir()


def test_a_console_started_under_nohup_keeps_ignoring_sighup(one_host: ConsoleSide) -> None:
    """nohup's SIG_IGN for SIGHUP is kept (the console does not take it over); SIGTERM still quits it cleanly."""
    env = {**one_host.env, "TERM": "xterm-256color"}
    pid, fd = _console(env, ignore_hup=True)
    try:
        seen = bytearray()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and b"hosta" not in seen:
            seen += _read(fd, 0.5)
        assert b"hosta" in seen, f"the console never showed hosta; its screen ended with {bytes(seen[-2000:])!r}"
        os.kill(pid, signal.SIGHUP)
        _read(fd, 3.0)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "SIGHUP, which nohup told it to ignore, ended the console"
        os.kill(pid, signal.SIGTERM)
        status = None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            _read(fd, 0.2)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGTERM
    finally:
        _end(pid, fd)
