"""The console driven with Pilot against a real agent: launch, watch output, stop, see the cause."""

from __future__ import annotations

import asyncio
import sys

from textual.widgets import DataTable, Input, Static

from console.app import GpudeckApp
from console.fleet import Fleet
from console.screens.dialogs import ConfirmDialog, ResultDialog
from console.screens.launch import LaunchDialog, build_spec
from console.screens.run import RunScreen
from console.screens.runs import RunsScreen
from console.widgets.output_view import OutputView
from tests.agent_harness import AgentProc

PROG = "import time; [print('line', i, flush=True) or time.sleep(0.02) for i in range(100000)]"


async def until(pred, timeout: float = 15.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        v = pred()
        if v:
            return v
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_build_spec_requires_an_explicit_start_for_trainers() -> None:
    import pytest

    with pytest.raises(ValueError, match="no default"):
        build_spec("fsdp", "--max-steps 10", "", "", "", "", sys.executable)
    spec = build_spec("fsdp", "--max-steps 10", "x", "0,1", "resume", "200", "/usr/bin/python3")
    assert spec.argv == ["/usr/bin/python3", "-m", "trainers.fsdp_lm", "--max-steps", "10", "--resume", "200"]
    assert spec.start == "resume 200" and spec.gpus == [0, 1]
    assert build_spec("dflash", "", "", "", "fresh", "", "py").argv[-1] == "--fresh"
    with pytest.raises(ValueError, match="command"):
        build_spec("command", "", "", "", "", "", "py")


async def test_launch_watch_stop_from_the_console(agent: AgentProc) -> None:
    app = GpudeckApp(Fleet(state_dir=agent.state_dir, interval_s=0.2))
    async with app.run_test(size=(140, 40)) as pilot:
        table = app.screen.query_one("#fleet-table", DataTable)
        await until(lambda: "local" in table.rows and str(table.get_cell("local", "state")) == "up", what="the local host to be up")

        await pilot.press("l")
        await until(lambda: isinstance(app.screen, LaunchDialog), what="the launch dialog")
        app.screen.query_one("#args", Input).value = f"{sys.executable} -u -c \"{PROG}\""
        app.screen.query_one("#name", Input).value = "console-run"
        await pilot.press("ctrl+s")
        screen = await until(lambda: isinstance(app.screen, RunScreen) and app.screen, what=f"the run screen (on {app.screen})")
        view = screen.query_one("#run-log", OutputView)
        await until(lambda: view.line_count > 20, what="output in the view")
        assert view.line(0) == "line 0"

        # search: '/' then a term jumps to the line and highlights it; following stops
        await pilot.press("g")  # to the top: reading, not following
        await pilot.press("slash")
        await pilot.press(*"line 7", "enter")
        await until(lambda: screen._match_line == 7, what="the search to find line 7")
        assert view.follow is False and view.search_term == "line 7"

        await pilot.press("s")
        await until(lambda: isinstance(app.screen, ConfirmDialog), what="the stop confirmation")
        await pilot.press("y")
        result = await until(lambda: isinstance(app.screen, ResultDialog) and app.screen, timeout=30, what="the stop result")
        body = str(result.query_one("#result-body", Static).render())
        assert "stopped" in body and "SIGTERM" in body
        await pilot.press("escape")

        await pilot.press("r")
        runs = await until(lambda: isinstance(app.screen, RunsScreen) and app.screen, what="the runs screen")
        rt = runs.query_one("#runs-table", DataTable)
        rid = screen.run_id
        await until(lambda: rid in rt.rows and str(rt.get_cell(rid, "state")) == "stopped", what="the stopped run in Runs")
        assert "stopped by operator" in str(rt.get_cell(rid, "cause"))


async def test_launch_dialog_refuses_a_trainer_without_a_start(agent: AgentProc) -> None:
    app = GpudeckApp(Fleet(state_dir=agent.state_dir, interval_s=0.2))
    async with app.run_test(size=(140, 48)) as pilot:
        await pilot.press("l")
        dialog = await until(lambda: isinstance(app.screen, LaunchDialog) and app.screen, what="the launch dialog")
        from textual.widgets import Select

        dialog.query_one("#kind", Select).value = "fsdp"
        dialog.query_one("#args", Input).value = "--model-config tiny"
        dialog.submit()
        await pilot.pause()
        assert isinstance(app.screen, LaunchDialog)
        assert "no default" in str(dialog.query_one("#launch-error", Static).render())


def test_relaunch_prefill_never_carries_the_old_start() -> None:
    from agents.protocol import LaunchSpec
    from console.screens.launch import prefill_from

    spec = LaunchSpec(argv=["/venv/bin/python", "-m", "trainers.fsdp_lm", "--model-config", "llama-1b", "--resume", "400", "--out", "/ckpt"], kind="fsdp", gpus=[0, 1], name="big")
    form = prefill_from(spec)
    assert form == {"kind": "fsdp", "args": "--model-config llama-1b --out /ckpt", "name": "big", "gpus": "0,1", "python": "/venv/bin/python"}
    assert prefill_from(LaunchSpec(argv=["sleep", "1"]))["args"] == "sleep 1"
