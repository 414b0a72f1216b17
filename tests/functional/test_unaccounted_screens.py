"""The console shows memory no visible process explains, from a real agent whose SIMULATED GPU 0 holds 7.6 GiB that
no process accounts for: the Host screen names it under its tables, the Leftovers screen names it (no row: nothing
there can signal it), and the Fleet screen raises it as an alert."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.widgets import Static

from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.leftovers import LeftoversScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.agent_harness import AgentProc, simulated_agent
from tests.functional.helpers import mounted, open_host, text_of, until

SIZE = (160, 45)


@pytest.fixture
def hidden_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    yield from simulated_agent(gpudeck_home, monkeypatch, "2:H200:141;unaccounted=0:7.6")


async def test_the_host_leftovers_and_fleet_screens_name_unaccounted_memory(hidden_agent: AgentProc) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=hidden_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE):
        table = app.screen.query_one("#fleet-table", KeyedTable)
        await until(lambda: "local" in table.keys() and str(table.get_cell("local", "state")).startswith("up"), what="local up")
        await until(lambda: "7.6 GiB unaccounted on GPU 0" in str(table.get_cell("local", "alerts")), what="the fleet alert")
        # the stream is compact after its first snapshot: the PID namespace, sent once, is refilled like the GPUs' names
        link = app.ops.fleet.links["local"]
        await until(lambda: (snap := link.status.snapshot) is not None and snap.compact, what="a compact snapshot")
        snap = link.status.snapshot
        assert snap is not None and snap.namespace is not None and snap.namespace.pid_namespace in ("host", "isolated")
        host = await open_host(app, "local")
        note = host.query_one("#host-note", Static)
        await until(lambda: "GPU 0: 7.6 GiB UNACCOUNTED, held by no process visible to this agent" in text_of(note), what="the host note")
        assert "outside this agent's PID namespace or by the driver" in text_of(note)
        app.push_screen(LeftoversScreen("local"))
        screen = await until(lambda: mounted(app, LeftoversScreen), what="the leftovers screen")
        lnote = screen.query_one("#leftovers-note", Static)
        await until(lambda: "UNACCOUNTED" in text_of(lnote), timeout=20, what="the leftovers note")
        assert "no leftover process on local" in text_of(lnote) and "nothing left over" not in text_of(lnote)
        assert screen.query_one("#leftovers-table", KeyedTable).keys() == []
