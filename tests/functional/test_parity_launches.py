"""Parity against a real agent: reclaim-and-launch (`gpudeck launch --reclaim-holders` and the Launch dialog's "Reclaim
these and launch") and relaunch (`gpudeck relaunch RUN` and the Run screen's R) reach the same result, each through
the one entry point of console/ops.

The spies wrap the ``Ops`` methods both front-ends call and record each call with the front-end that made it: a
front-end that stopped going through them (planned the holders, reclaimed or launched another way) leaves its entry
out and the test fails, as it does when the two launch different specs. The CLI runs in this process through its
real entry point (``GPUDECK_HOME`` points it at the same agent); the console is driven with Pilot.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
from contextlib import redirect_stdout
from typing import Any

import msgspec
import pytest
from textual.widgets import Button, SelectionList, Static

from gpudeck.agents.wire.protocol import to_builtins
from gpudeck.console.cli.main import main as cli_main
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.context import Ops
from gpudeck.console.ops.holders import HolderPlan, ReclaimLaunch
from gpudeck.console.ops.launch import LaunchPlan, LaunchResult
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ConfirmDialog
from gpudeck.console.tui.screens.launch import LaunchDialog
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.agent_harness import AgentProc, wait_for
from tests.functional.conftest import SPAWN, Holder
from tests.functional.helpers import mounted, open_launch, text_of, until

SIZE = (160, 50)
# what differs between two launches of the same ask by design: the request id (one per ask)
VOLATILE = ("request_id",)


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli_main(list(args))
    return rc, out.getvalue()


def _spec(plan: LaunchPlan) -> dict[str, Any]:
    d = to_builtins(plan.spec)
    return {k: v for k, v in d.items() if k not in VOLATILE}


def _held_by(a: AgentProc, pid: int) -> None:
    wait_for(
        lambda: any(p["pid"] == pid for p in a.cli_json("status", "--host", "local")["gpus"][1]["processes"]),
        20,
        what=f"pid {pid} on GPU 1",
    )


async def test_reclaim_and_launch_reclaims_the_same_holder_and_launches_the_same_spec_in_both(
    sim_agent: AgentProc, foreign_holder: Holder, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str, Any]] = []
    real_plan, real_reclaim = Ops.plan_holders, Ops.reclaim_and_launch

    async def plan_spy(self: Ops, plan: LaunchPlan, outcomes: list[Any]) -> HolderPlan:
        held = await real_plan(self, plan, outcomes)
        seen.append((who, "plan_holders", held.pids()))
        return held

    async def reclaim_spy(self: Ops, plan: LaunchPlan, held: HolderPlan, *a: Any, **kw: Any) -> ReclaimLaunch:
        done = await real_reclaim(self, plan, held, *a, **kw)
        seen.append((who, "reclaim_and_launch", (held.pids(), _spec(plan), done.refused, done.result is not None)))
        return done

    monkeypatch.setattr(Ops, "plan_holders", plan_spy)
    monkeypatch.setattr(Ops, "reclaim_and_launch", reclaim_spy)
    _held_by(sim_agent, foreign_holder.pid)
    who = "cli"
    ask = ["--gpus", "1", "--need-gib", "100", "--name", "reclaimed", "--", "sleep", "30"]
    rc, out = await asyncio.to_thread(_cli, "launch", "--reclaim-holders", "--json", *ask)
    assert rc == 0, out
    cli_run = json.loads(out)
    assert not foreign_holder.alive()
    sim_agent.cli("stop", cli_run["id"], "--grace", "1")

    # the console meets the same refusal: a new holder of GPU 1, outside gpudeck
    again = subprocess.run(
        [sys.executable, "-c", SPAWN], env={**os.environ, "GPUDECK_SIM_GPU_MEM": "1:20"}, capture_output=True, text=True, check=True
    )
    holder = Holder(int(again.stdout.strip()))
    try:
        _held_by(sim_agent, holder.pid)
        who = "screen"
        app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
        async with app.run_test(size=SIZE) as pilot:
            table = app.screen.query_one("#fleet-table", KeyedTable)
            await until(lambda: "local" in table.keys() and str(table.get_cell("local", "state")).startswith("up"), what="local up")
            link = app.ops.links["local"]
            await until(
                lambda: link.status.snapshot is not None and any(p.pid == holder.pid for p in link.status.snapshot.gpus[1].processes),
                timeout=20,
                what="the holder in the snapshot",
            )
            dialog: LaunchDialog = await open_launch(pilot, args="sleep 30", name="reclaimed", need_gib="100")
            dialog.query_one("#gpus", SelectionList).select(1)
            await pilot.press("ctrl+s")
            button = dialog.query_one("#launch", Button)
            await until(lambda: "Reclaim these and launch" in str(button.label), timeout=30, what=f"the reclaim offer ({button.label})")
            await pilot.press("ctrl+s")
            await until(lambda: mounted(app, ConfirmDialog), what="the one confirmation")
            await pilot.press("y")
            screen = await until(lambda: mounted(app, RunScreen), timeout=60, what="the run screen")
            screen_run = screen.run_id
        assert not holder.alive()
    finally:
        try:
            os.kill(holder.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sim_agent.cli("stop", screen_run, "--grace", "1")

    cli_seen = [(what, got) for w, what, got in seen if w == "cli"]
    screen_seen = [(what, got) for w, what, got in seen if w == "screen"]
    assert [what for what, _ in cli_seen] == [what for what, _ in screen_seen] == ["plan_holders", "reclaim_and_launch"]
    (_, cli_pids), (_, (cli_reclaimed, cli_spec, cli_refused, cli_launched)) = cli_seen
    (_, screen_pids), (_, (screen_reclaimed, screen_spec, screen_refused, screen_launched)) = screen_seen
    assert cli_pids == {"local": [foreign_holder.pid]} and screen_pids == {"local": [holder.pid]}  # what pre-flight named
    assert cli_reclaimed == cli_pids and screen_reclaimed == screen_pids
    assert cli_refused is None and screen_refused is None and cli_launched and screen_launched
    assert cli_spec == screen_spec  # the same ask gives the same spec, byte for byte
    runs = {r["id"]: r for r in sim_agent.cli_json("runs")}
    assert runs[cli_run["id"]]["spec"]["gpus"] == runs[screen_run]["spec"]["gpus"] == [1]


async def test_relaunch_launches_the_same_spec_from_the_cli_and_the_run_screen(
    sim_agent: AgentProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = sim_agent
    rid = a.cli("launch", "--name", "again", "--", sys.executable, "-c", "pass").stdout.strip()
    wait_for(lambda: next(r for r in a.cli_json("runs") if r["id"] == rid)["state"] == "succeeded", 60, what=rid)
    launched: list[tuple[str, dict[str, Any], LaunchResult]] = []
    real = Ops.launch

    async def spy(self: Ops, plan: LaunchPlan, request_id: str = "") -> LaunchResult:
        result = await real(self, plan, request_id)
        launched.append((who, _spec(plan), result))
        return result

    monkeypatch.setattr(Ops, "launch", spy)
    who = "cli"
    rc, out = await asyncio.to_thread(_cli, "relaunch", rid, "--json")
    assert rc == 0, out
    cli_run = json.loads(out)
    who = "screen"
    app = GpudeckApp(Ops.console(Fleet(state_dir=a.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        app.open_run("local", rid)
        await until(lambda: (s := mounted(app, RunScreen)) is not None and s.run is not None, what="the run")
        await pilot.press("R")
        dialog = await until(lambda: mounted(app, LaunchDialog), what="the relaunch form")
        await pilot.press("ctrl+s")  # pre-flight
        await until(
            lambda: "pre-flight" in text_of(dialog.query_one("#preflight", Static)) and not dialog.query_one("#launch-progress").running,
            what="the pre-flight verdict",
        )
        await pilot.press("ctrl+s")
        new = await until(
            lambda: (s := mounted(app, RunScreen)) is not None and s.run_id != rid and s or None, timeout=30, what="the new run"
        )
        screen_id = new.run_id
    assert [w for w, _s, _r in launched] == ["cli", "screen"]
    (_, cli_spec, cli_result), (_, screen_spec, screen_result) = launched
    assert cli_result.run_id == cli_run["id"] and screen_result.run_id == screen_id
    assert cli_spec == screen_spec, {
        k: (cli_spec.get(k), screen_spec.get(k)) for k in {*cli_spec, *screen_spec} if cli_spec.get(k) != screen_spec.get(k)
    }
    runs = {r["id"]: r for r in a.cli_json("runs")}
    assert runs[cli_run["id"]]["parent"] == runs[screen_id]["parent"] == rid
    assert msgspec.json.encode(runs[cli_run["id"]]["spec"]["argv"]) == msgspec.json.encode(runs[screen_id]["spec"]["argv"])
