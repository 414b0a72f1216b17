"""Shared fixtures: a private GPUDECK_HOME and a real agent process per test."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_harness import AgentProc, teardown_agent


@pytest.fixture
def gpudeck_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # short path: a Unix socket path must stay under 108 bytes
    d = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    monkeypatch.setenv("GPUDECK_HOME", str(d))
    yield d


@pytest.fixture
def agent(gpudeck_home: Path) -> Iterator[AgentProc]:
    a = AgentProc(gpudeck_home).start()
    yield a
    teardown_agent(a)
