"""The console shows the GPU ledger (issue 32) from a real agent on SIMULATED GPUs: on the Host screen `w` shows who held
the highlighted process's GPU over the last 24 h as a timeline; on the Run screen `w` shows the GPUs the run held over
its life. Both read the history the console keeps in sync, through Ops.ledger (the same answer as `gpudeck ledger`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.widgets import Static

from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.replica import History
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ResultDialog
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.agent_harness import AgentProc, kill_pids, simulated_agent
from tests.functional.helpers import mounted, open_host, press_for, text_of, until

SIZE = (200, 50)
HOLDER = str(Path(__file__).parent.parent / "e2e" / "progs" / "sim_gpu_holder.py")


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    yield from simulated_agent(gpudeck_home, monkeypatch, "2:H200:141")


async def test_the_host_and_run_screens_show_the_gpu_ledger(sim_agent: AgentProc, gpudeck_home: Path) -> None:
    a = sim_agent
    holder = subprocess.Popen([sys.executable, HOLDER], env={**a.env, "GPUDECK_SIM_GPU_MEM": "1:12"}, stdout=subprocess.DEVNULL)
    rid = a.cli_json("launch", "--gpus", "0", "--force", "--env", "GPUDECK_SIM_GPU_MEM=0:30", "--", sys.executable, HOLDER)["id"]
    history = History(gpudeck_home / "history.db")
    try:
        app = GpudeckApp(Ops.console(Fleet(state_dir=a.state_dir, interval_s=0.2, history=history)))
        async with app.run_test(size=SIZE) as pilot:
            host = await open_host(app, "local")
            table = host.query_one("#proc-table", KeyedTable)
            await until(lambda: any(str(table.get_cell(k, "pid")) == str(holder.pid) for k in table.keys()), what="the holder row")
            key = next(k for k in table.keys() if str(table.get_cell(k, "pid")) == str(holder.pid))
            table.move_cursor_to_key(key)
            await until(lambda: table.cursor_key == key, what="the cursor on the holder")

            async def dialog_text(what: str) -> str:
                dialog = await press_for(pilot, "w", ResultDialog)
                body = dialog.query_one("#result-body", Static)
                text = await until(lambda: what in text_of(body) and text_of(body), timeout=30, what=what)
                await pilot.press("escape")
                return text

            # the history fills as the console syncs: asked again until the holder's start is in it
            text = ""
            for _ in range(40):
                text = await dialog_text("GPU ledger of local GPU 1")
                if f"pid {holder.pid}" in text:
                    break
                await pilot.pause(0.5)
            assert f"pid {holder.pid}" in text and "FOREIGN" in text and "still held" in text and "#" in text, text

            app.open_run("local", rid)
            await until(lambda: mounted(app, RunScreen), what="the run screen")
            for _ in range(40):
                text = await dialog_text(f"run {rid}")
                if "GPU(s) held over its life" in text:
                    break
                await pilot.pause(0.5)
            assert f"run {rid} on local: 1 GPU(s) held over its life" in text and "30.0" in text, text
    finally:
        kill_pids([holder.pid])
        holder.wait(10)
        history.close()
