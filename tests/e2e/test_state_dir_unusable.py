"""A state folder the agent cannot write (a read-only filesystem, a full disk): `agent serve` says so on one line and
exits 2, never a traceback. Real mounts (tmpfs mounted or remounted read-only: root cannot write through those, where
mode bits would not stop it), real agent processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_harness import AgentProc

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tmpfs")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "mnt"
    point.mkdir()
    yield point
    subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _mount(point: Path, opts: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], check=True)


def _serve(home: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUDECK_HOME": str(home), "GPUDECK_SIMULATE_GPUS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "gpudeck.agents", "serve", *extra], env=env, capture_output=True, text=True, timeout=120)


def _one_line(r: subprocess.CompletedProcess[str], *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "Errno" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_a_read_only_filesystem_is_one_line_and_exit_2(mnt: Path) -> None:
    _mount(mnt, "ro,size=1m")
    with pytest.raises(OSError):  # root included: the mount, not a mode bit, refuses
        (mnt / "probe").write_text("x")
    line = _one_line(_serve(mnt), "read-only filesystem", "GPUDECK_HOME or --state-dir")  # GPUDECK_HOME's agent/ folder
    assert str(mnt / "agent") in line
    _one_line(_serve(Path("/nonexistent-home"), "--state-dir", str(mnt / "st")), "read-only filesystem", str(mnt / "st"))


def test_an_agents_own_folder_remounted_read_only_is_one_line_and_exit_2(mnt: Path) -> None:
    _mount(mnt, "size=8m")
    agent = AgentProc(mnt).start()  # a real agent made the folder, its journal and its socket
    assert agent.proc is not None
    os.kill(agent.proc.pid, signal.SIGTERM)
    assert agent.proc.wait(timeout=60) == 0
    assert (agent.state_dir / "journal.db").exists()
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    _one_line(_serve(mnt), "read-only filesystem", str(agent.state_dir))


def test_a_full_disk_is_one_line_and_exit_2(mnt: Path) -> None:
    _mount(mnt, "size=256k")
    (mnt / "agent").mkdir(mode=0o700)
    with open(mnt / "fill", "wb") as fh, pytest.raises(OSError):
        while True:
            fh.write(b"\0" * 65536)
            fh.flush()
    _one_line(_serve(mnt), "full", "df -h")
