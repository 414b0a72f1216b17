"""Shared fixtures: a private GPUDECK_HOME and a real agent process per test."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_harness import AgentProc, kill_tagged


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
    # stop every run this test left, through the agent, then the agent itself
    try:
        runs = a.cli_json("runs")
        for r in runs:
            if r["state"] in ("starting", "running", "stopping"):
                a.cli("stop", r["id"], "--grace", "1", check=False)
            kill_tagged(r["id"])
    except Exception:
        pass
    a.stop()
    a.stop_autostarted()
