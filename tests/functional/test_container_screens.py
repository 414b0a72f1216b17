"""The console names the container of a GPU process seen from the host: a real sleep placed in a real cgroup named
as Docker names it, holding SIMULATED GPU memory; the Host screen's process row leads with the container, and the
reclaim confirmation built from the marked row names it. Root and a writable cgroup v2 (else skipped, with why)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.reclaim import reclaim_body
from gpudeck.console.tui.widgets.keyed_table import KeyedTable, cell_text
from tests.agent_harness import AgentProc, simulated_agent
from tests.e2e.test_containers import A, Groups, groups, runtime_root, why_not
from tests.functional.helpers import open_host, until

SIZE = (200, 45)
pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
__all__ = ["groups", "runtime_root"]  # the e2e test's fixtures, used by name below


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch, runtime_root: Path) -> Iterator[AgentProc]:
    yield from simulated_agent(gpudeck_home, monkeypatch, "2:H200:141")


async def test_the_host_screen_and_the_reclaim_confirmation_name_the_container(sim_agent: AgentProc, groups: Groups) -> None:
    holder = groups.start(dict(sim_agent.env, GPUDECK_SIM_GPU_MEM="1:20"), groups.make(f"system.slice/docker-{A}.scope"))
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE):
        host = await open_host(app, "local")
        table = host.query_one("#proc-table", KeyedTable)
        key = f"1:{holder.pid}"
        # the holder is the placer (python) until it executes `sleep`: a snapshot taken before the agent re-read the
        # exec'd process shows the placer's command line for a tick (fresh-clone CI once caught it there)
        await until(
            lambda: key in table.keys() and "sleep 300" in cell_text((table.cells_of(key) or {}).get("cmd", "")),
            what="the row, with the command line after the exec",
        )
        assert cell_text((table.cells_of(key) or {})["cmd"]) == "[docker:trainer] sleep 300"
        table.mark_all([key])
        items = host.reclaim_items()
        assert [(it.pid, it.container) for it in items] == [(holder.pid, "docker:trainer")]
        body = reclaim_body("local", items, []).plain
        assert f"pid {holder.pid}" in body and "in container docker:trainer: stopped from the host, inside it" in body
