"""Shared fixtures: a private GPUDECK_HOME and a real agent process per test."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_harness import AgentProc, teardown_agent


@pytest.fixture(autouse=True)
def _own_gpudeck_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test its own GPUDECK_HOME (gpudeck_home below replaces it with one it keeps): nothing reads or writes the
    user's state, and the simulated GPUs of tests running at the same time stay apart (a simulated holder belongs to
    the machine its GPUDECK_HOME names; one of a test in the other xdist worker failed a pre-flight here)."""
    d = tempfile.mkdtemp(prefix="gd-", dir="/tmp")
    monkeypatch.setenv("GPUDECK_HOME", d)
    yield
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def gpudeck_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # short path: a Unix socket path must stay under 108 bytes
    d = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    monkeypatch.setenv("GPUDECK_HOME", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)  # after the fixtures built on it (the agent) are torn down: a suite left ~230 behind


@pytest.fixture
def agent(gpudeck_home: Path) -> Iterator[AgentProc]:
    a = AgentProc(gpudeck_home).start()
    yield a
    teardown_agent(a)
