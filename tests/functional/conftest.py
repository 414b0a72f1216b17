"""Fixtures for the console's functional tests: a real agent on simulated GPUs, a real history, a foreign GPU holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from gpudeck.console.history.replica import History
from tests.agent_harness import AgentProc, simulated_agent


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    """A real agent whose host has two SIMULATED H200s (memory is what processes declare)."""
    yield from simulated_agent(gpudeck_home, monkeypatch, "2:H200")


@pytest.fixture
def history(tmp_path: Path) -> Iterator[History]:
    h = History(tmp_path / "history.db")
    yield h
    h.close()


@dataclass(frozen=True)
class Holder:
    """A process that is not this test's child (so it is reaped when it ends, like a real one)."""

    pid: int

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


SPAWN = "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)"


@pytest.fixture
def foreign_holder() -> Iterator[Holder]:
    """A process outside gpudeck holding 20 GiB on simulated GPU 1 (a notebook left open); killed by pid afterwards.

    It is started through an intermediate that exits at once, so it is nobody's child here: when it is
    stopped it is reaped and its simulated memory released, instead of lingering as this test's zombie.
    """
    env = {**os.environ, "GPUDECK_SIM_GPU_MEM": "1:20"}
    out = subprocess.run([sys.executable, "-c", SPAWN], env=env, capture_output=True, text=True, check=True, timeout=30)
    h = Holder(int(out.stdout.strip()))
    yield h
    try:
        os.kill(h.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
