"""Reclaim-and-launch against a real agent on SIMULATED GPUs with a real foreign holder process: the CLI's
``gpudeck launch --reclaim-holders`` (each step printed, another user's holder refused before anything is stopped),
and the Launch dialog's "Reclaim these and launch", driven with Pilot against a real agent on SIMULATED GPUs with a real
foreign holder process: pre-flight refuses, the first action names the pid (user, GiB, age), asks once, reclaims it
with the verified GiB freed, pre-flights again and launches; --force stays the second choice; need-gib is a field."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys

from textual.widgets import Button, Input, SelectionList, Static

from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ConfirmDialog
from gpudeck.console.tui.screens.launch import LaunchDialog
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.agent_harness import AgentProc, wait_for
from tests.functional.conftest import Holder
from tests.functional.helpers import mounted, open_launch, text_of, until

SIZE = (160, 50)


async def _dialog_on_gpu1(app: GpudeckApp, pilot, holder: Holder, **fields: str) -> LaunchDialog:  # type: ignore[no-untyped-def]
    table = app.screen.query_one("#fleet-table", KeyedTable)
    await until(lambda: "local" in table.keys() and str(table.get_cell("local", "state")).startswith("up"), what="local up")
    link = app.ops.fleet.links["local"]
    await until(
        lambda: link.status.snapshot is not None and any(p.pid == holder.pid for p in link.status.snapshot.gpus[1].processes),
        timeout=20,
        what="the holder in the snapshot",
    )
    dialog: LaunchDialog = await open_launch(pilot, **fields)
    dialog.query_one("#gpus", SelectionList).select(1)
    return dialog


async def test_reclaim_these_and_launch_is_the_first_action_and_force_the_second(sim_agent: AgentProc, foreign_holder: Holder) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await _dialog_on_gpu1(app, pilot, foreign_holder, args="sleep 30", name="reclaimed", need_gib="100")
        await pilot.press("ctrl+s")
        button = dialog.query_one("#launch", Button)
        await until(lambda: "Reclaim these and launch" in str(button.label), timeout=30, what=f"the reclaim offer ({button.label})")
        panel = text_of(dialog.query_one("#preflight", Static))
        assert f"local:{foreign_holder.pid}" in panel and f"user {getpass.getuser()}" in panel and "GPU 1: 20.0 GiB" in panel
        assert "age " in panel and "foreign" in panel
        assert dialog.query_one("#force", Button).display, "--force stays as the second choice"
        assert foreign_holder.alive(), "nothing is stopped before the confirmation"
        await pilot.press("ctrl+s")
        confirm = await until(lambda: mounted(app, ConfirmDialog), what="the one confirmation")
        body = text_of(confirm.query_one("#confirm-body", Static))
        assert f"local:{foreign_holder.pid}" in body and "20.0 GiB" in body
        await pilot.press("y")
        run = await until(lambda: mounted(app, RunScreen), timeout=60, what="the run screen")
        assert not foreign_holder.alive()
        runs = sim_agent.cli_json("runs")
        started = next(r for r in runs if r.get("name") == "reclaimed")
        assert started["state"] in ("starting", "running") and started["spec"]["need_gib"] == 100
        assert run is not None
        sim_agent.cli("stop", started["id"], "--grace", "1")


async def test_a_refused_holder_is_named_and_only_force_is_offered(sim_agent: AgentProc, foreign_holder: Holder, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("LOGNAME", "someone-else")  # the console's operator is not the holder's user
    monkeypatch.setenv("USER", "someone-else")
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await _dialog_on_gpu1(app, pilot, foreign_holder, args="sleep 30")
        await pilot.press("ctrl+s")
        button = dialog.query_one("#launch", Button)
        await until(lambda: "--force" in str(button.label), timeout=30, what=f"the force offer ({button.label})")
        panel = text_of(dialog.query_one("#preflight", Static))
        assert "REFUSED" in panel and "not offered" in panel and f"local:{foreign_holder.pid}" in panel
        assert not dialog.query_one("#force", Button).display  # the one choice left is the main button
        assert foreign_holder.alive()


async def test_need_gib_is_checked_as_a_field(sim_agent: AgentProc) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_launch(pilot, args="sleep 1", need_gib="lots")
        await pilot.press("ctrl+s")
        error = dialog.query_one("#launch-error", Static)
        await until(lambda: "need GiB" in text_of(error), what="the field's error")
        assert "'lots' is not a number" in text_of(error)
        dialog.query_one("#need-gib", Input).value = "500"
        await pilot.press("ctrl+s")
        panel = dialog.query_one("#preflight", Static)
        await until(lambda: "gpu_memory" in text_of(panel), timeout=30, what="the pre-flight verdict")
        assert "500.0 GiB" in text_of(panel) and "given with --need-gib" in text_of(panel)


# ----------------------------------------------------------------------------- the CLI


def _held(a: AgentProc, pid: int) -> None:
    wait_for(
        lambda: any(p["pid"] == pid for p in a.cli_json("status", "--host", "local")["gpus"][1]["processes"]),
        20,
        what="the holder on GPU 1",
    )


def test_reclaim_holders_names_reclaims_verifies_preflights_again_and_launches(sim_agent: AgentProc, foreign_holder: Holder) -> None:
    a = sim_agent
    _held(a, foreign_holder.pid)
    cp = a.cli("launch", "--reclaim-holders", "--grace", "2", "--gpus", "1", "--name", "after", "--", "sleep", "30", check=False)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    err = cp.stderr
    rid = cp.stdout.strip()
    # each step, in order: the refusal, the list (pid, user, GiB, age), the verified reclaim, pre-flight again, launch
    order = [
        "pre-flight on local",
        "1 process(es) to reclaim",
        f"local:{foreign_holder.pid}",
        "reclaiming 1 process",
        "GPU 1: 20.0 GiB freed",
    ]
    order += ["pre-flight again on local", "pre-flight passed; launching"]
    at = [err.find(s) for s in order]
    assert all(i >= 0 for i in at) and at == sorted(at), err
    line = next(x for x in err.splitlines() if f"local:{foreign_holder.pid}" in x)
    assert f"user {os.environ.get('USER') or ''}".strip() in line and "GPU 1: 20.0 GiB" in line and "age " in line and "foreign" in line
    assert not foreign_holder.alive()
    run = next(r for r in a.cli_json("runs") if r["id"] == rid)
    assert run["state"] in ("starting", "running") and run.get("name") == "after"
    a.cli("stop", rid, "--grace", "1")


def test_a_holder_of_another_user_is_refused_and_nothing_is_stopped(sim_agent: AgentProc, foreign_holder: Holder) -> None:
    a = sim_agent
    _held(a, foreign_holder.pid)
    # the launch is asked for by another operator (getpass reads LOGNAME/USER): the holder is not theirs
    env = {**a.env, "LOGNAME": "someone-else", "USER": "someone-else"}
    cp = subprocess.run(
        [sys.executable, "-m", "gpudeck.console.cli.main", "launch", "--reclaim-holders", "--gpus", "1", "--", "sleep", "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert f"local:{foreign_holder.pid}" in cp.stderr and "REFUSED" in cp.stderr and "not to you (someone-else)" in cp.stderr
    assert "reclaim-and-launch stopped" in cp.stderr and "--force" in cp.stderr
    assert "reclaiming" not in cp.stderr and foreign_holder.alive()
    assert not [r for r in a.cli_json("runs") if r["state"] in ("starting", "running")]


def test_reclaim_holders_and_force_are_one_choice(sim_agent: AgentProc) -> None:
    cp = sim_agent.cli("launch", "--reclaim-holders", "--force", "--", "sleep", "1", check=False)
    assert cp.returncode == 2 and "choose one" in cp.stderr
    assert json.loads(sim_agent.cli("runs", "--json").stdout) == []
