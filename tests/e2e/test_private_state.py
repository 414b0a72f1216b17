"""gpudeck's files are private whatever the umask, and its state is never reached through a link or another user's
folder; the client sends nothing to an agent socket another user owns or serves. With a real second uid (useradd,
removed after)."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.agents.wire import paths
from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.errors import PermissionDenied
from tests.agent_harness import wait_for
from tests.sshd_harness import short_tmp

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates a second user (useradd) and chowns files to it: needs root")


@pytest.fixture(scope="module")
def other_uid() -> Iterator[int]:
    name = f"gdt{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield int(subprocess.run(["id", "-u", name], check=True, capture_output=True, text=True).stdout)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = short_tmp("gd-priv-")
    monkeypatch.setenv("GPUDECK_HOME", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_state_folders_and_the_history_are_private_whatever_the_umask(home: Path) -> None:
    code = (
        "import os; os.umask(0)\n"
        "from gpudeck.console.history.replica import History\n"
        "from gpudeck.agents.wire import paths\n"
        "paths.ensure_private_dir(paths.runs_dir() / 'r-1')\n"
        "paths.ensure_private_dir(paths.socket_path().parent)\n"
        "h = History(); h.ingest; h.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "GPUDECK_HOME": str(home)}, cwd=Path(__file__).parents[2])
    sd = home / "agent"
    for d in (home, sd, sd / "runs", sd / "runs" / "r-1", sd / "sock"):
        assert _mode(d) == 0o700, (d, oct(_mode(d)))
    for f in home.glob("history.db*"):
        assert _mode(f) == 0o600, (f, oct(_mode(f)))
    assert (home / "history.db").exists()


def test_a_state_folder_that_is_a_link_is_refused_with_what_to_fix(home: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    (home / "agent").mkdir()
    (home / "agent" / "runs").symlink_to(target)
    with pytest.raises(paths.UnsafePath) as exc:
        paths.ensure_private_dir(paths.runs_dir() / "r-1")
    assert "is a symbolic link" in exc.value.message and "rm " in exc.value.message
    assert not (target / "r-1").exists() and _mode(target) == 0o755  # nothing created or chmod'ed through the link
    hist = home / "history.db"
    hist.symlink_to(tmp_path / "h.db")
    from gpudeck.console.history.replica import History, HistoryError

    with pytest.raises(HistoryError, match="symbolic link"):
        History(hist)
    assert not (tmp_path / "h.db").exists()


def test_a_folder_or_file_of_another_user_is_refused(home: Path, other_uid: int) -> None:
    runs = home / "agent" / "runs"
    runs.mkdir(parents=True)
    os.chown(runs, other_uid, -1)
    with pytest.raises(paths.UnsafePath) as exc:
        paths.ensure_private_dir(runs / "r-1")
    assert f"belongs to uid {other_uid}" in exc.value.message and "GPUDECK_HOME of your own" in exc.value.message
    theirs = home / "history.db"
    theirs.touch()
    os.chown(theirs, other_uid, -1)
    from gpudeck.console.history.replica import History, HistoryError

    with pytest.raises(HistoryError, match=f"uid {other_uid}"):
        History(theirs)


def _listener_as(uid: int, where: Path) -> subprocess.Popen:
    """A Unix socket server running as ``uid`` (it answers pongs to anything), its socket at ``where``."""
    prog = (
        "import socket, sys, os\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); open(sys.argv[1] + '.up', 'w').close()\n"
        "while True:\n"
        "    c, _ = s.accept(); data = c.recv(65536); open(sys.argv[1] + '.got', 'ab').write(data); c.close()\n"
    )
    py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # the test venv may not be readable by that user
    return subprocess.Popen(
        [py, "-c", prog, str(where)],
        preexec_fn=lambda: (os.setgid(65534), os.setuid(uid)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_the_client_sends_nothing_to_a_socket_another_user_owns_or_serves(home: Path, other_uid: int) -> None:
    spot = short_tmp("gd-other-")
    os.chown(spot, other_uid, -1)
    sock = paths.socket_path()
    paths.ensure_private_dir(sock.parent)
    proc = _listener_as(other_uid, spot / "s")
    try:
        wait_for(lambda: (spot / "s.up").exists(), timeout=30, what="the other user's listener")
        os.rename(spot / "s", sock)  # their socket where the agent's should be
        with pytest.raises(PermissionDenied, match=f"belongs to uid {other_uid}"):
            asyncio.run(AgentClient.connect_unix(autostart=False))
        os.chown(sock, 0, 0)  # owned by root now, but the process behind it is still theirs
        with pytest.raises(PermissionDenied, match=f"runs as uid {other_uid}"):
            asyncio.run(AgentClient.connect_unix(autostart=False))
        assert not (spot / "s.got").exists() or (spot / "s.got").read_bytes() == b"", "a request reached another user's process"
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(spot, ignore_errors=True)


def test_everything_a_real_agent_and_a_run_leave_in_the_state_is_private_under_umask_022(home: Path) -> None:
    """The run folder, spec.json (it holds the --env values), output.log, exit.json, the journal, the lock and the
    log: 0700 / 0600 although the agent starts with umask 022 (the folder and files used to be 0755 / 0644)."""
    from tests.agent_harness import AgentProc, teardown_agent

    old = os.umask(0o022)
    try:
        a = AgentProc(home).start()
    finally:
        os.umask(old)
    try:
        rid = a.cli_json("launch", "--env", "HF_TOKEN=not-for-others", "--", "sh", "-c", "echo hello")["id"]
        wait_for(lambda: any(r["id"] == rid and r["state"] == "succeeded" for r in a.cli_json("runs")), timeout=60, what="the run to end")
        run_dir = a.state_dir / "runs" / rid
        assert {p.name for p in run_dir.iterdir()} >= {"spec.json", "output.log", "exit.json"}
        loose = []
        for p in [a.state_dir, *a.state_dir.rglob("*")]:
            if p.is_symlink() or p.is_socket():
                continue
            want = 0o700 if p.is_dir() else 0o600
            if _mode(p) & 0o077:
                loose.append(f"{p.relative_to(home)} {oct(_mode(p))} (want {oct(want)})")
        assert not loose, loose
    finally:
        teardown_agent(a)
