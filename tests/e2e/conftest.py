"""Provides the end-to-end tests' shared fixtures: two real sshd hosts of one fleet."""

from __future__ import annotations

import pytest

from tests.agent_harness import stop_runs
from tests.sshd_harness import ConsoleSide, SshHost


@pytest.fixture
def two_hosts():  # type: ignore[no-untyped-def]
    """hosta and hostb: each a real sshd with its own agent, both in the console's config; their runs stopped at teardown."""
    c = ConsoleSide()
    try:
        for name in ("hosta", "hostb"):
            c.add(SshHost(name, c.pub).start())
        c.cli("hosts", "add", "hosta", "hostb")
        yield c
    finally:
        for h in c.hosts:
            stop_runs(h.agent)
        c.cleanup()
