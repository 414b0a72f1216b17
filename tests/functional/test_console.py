"""The console driven with Pilot against a real agent: launch, watch output, stop, see the cause in Runs and History;
pre-flight, leftovers, reclaim, claims and the environment fingerprint as the agent answers them (SIMULATED GPUs)."""

from __future__ import annotations

import sys

import pytest
from textual.widgets import Input, Static

from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.replica import History
from gpudeck.console.ops import Caller, IntentError, plan_launch, relaunch_intent
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ConfirmDialog, ResultDialog
from gpudeck.console.tui.screens.history import HistoryScreen
from gpudeck.console.tui.screens.launch import LaunchDialog, LaunchForm, form_from, intent_from_form
from gpudeck.console.tui.screens.leftovers import LeftoversScreen
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from gpudeck.console.tui.widgets.output_view import OutputView
from gpudeck.console.tui.widgets.steady import SteadyText
from tests.agent_harness import AgentProc
from tests.functional.conftest import Holder
from tests.functional.helpers import mounted, open_host, open_launch, press_for, text_of, until

PROG = "import time; [print('line', i, flush=True) or time.sleep(0.02) for i in range(100000)]"
SIZE = (160, 45)


def _form_spec(**fields: str):  # type: ignore[no-untyped-def]
    return plan_launch(intent_from_form(LaunchForm(host="gpu1", **fields)), Caller("op", "/", {})).spec


def test_the_form_requires_an_explicit_start_for_trainers() -> None:
    with pytest.raises(IntentError, match="no default"):
        _form_spec(kind="fsdp", args="--max-steps 10")
    spec = _form_spec(kind="fsdp", args="--max-steps 10", name="x", gpus="0", start="resume", resume_step="200", python="/usr/bin/python3")
    assert spec.argv == ["/usr/bin/python3", "-m", "gpudeck.trainers.fsdp_lm", "--max-steps", "10", "--resume", "200"]
    assert spec.start == "resume 200" and spec.gpus == [0] and spec.python == "/usr/bin/python3"
    assert _form_spec(kind="dflash", start="fresh").argv[-1] == "--fresh"
    with pytest.raises(IntentError, match="command"):
        _form_spec(kind="command")


def test_relaunch_prefill_never_carries_the_old_start() -> None:
    from gpudeck.agents.wire.protocol import LaunchSpec

    spec = LaunchSpec(
        argv=[
            "/venv/bin/python",
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "gpudeck.trainers.fsdp_lm",
            "--model-config",
            "llama-1b",
            "--resume",
            "400",
            "--out",
            "/ckpt",
        ],
        kind="fsdp",
        gpus=[0, 1],
        name="big",
        start="resume 400",
    )
    form = form_from(relaunch_intent(spec, "r-old", "gpu1", None))
    assert form == {
        "kind": "fsdp",
        "args": "--model-config llama-1b --out /ckpt",
        "name": "big",
        "gpus": "0,1",
        "ranks": "",
        "hosts": "",
        "python": "/venv/bin/python",
        "need_gib": "",
    }
    assert form_from(relaunch_intent(LaunchSpec(argv=["sleep", "1"]), "r-old", "gpu1", None))["args"] == "sleep 1"


async def _local_up(app: GpudeckApp) -> None:
    table = app.screen.query_one("#fleet-table", KeyedTable)
    await until(lambda: "local" in table.keys() and str(table.get_cell("local", "state")).startswith("up"), what="the local host to be up")


async def _open_cli_run(app: GpudeckApp, agent: AgentProc, name: str) -> RunScreen:
    """A one-minute run launched with the CLI, opened on its Run screen."""
    await _local_up(app)
    rid = agent.cli("launch", "--name", name, "--", sys.executable, "-c", "import time; time.sleep(60)").stdout.strip()
    app.open_run("local", rid)
    return await until(lambda: mounted(app, RunScreen), what="the run screen")


async def _launch_command(app: GpudeckApp, pilot, argv: str, name: str) -> RunScreen:  # type: ignore[no-untyped-def]
    dialog = await open_launch(pilot, args=argv, name=name)
    await pilot.press("ctrl+s")  # pre-flight first: its verdict (or why it could not run) shows before anything starts
    await until(
        lambda: "pre-flight" in text_of(dialog.query_one("#preflight", Static)) and not dialog.query_one("#launch-progress").running,
        what="the pre-flight verdict",
    )
    assert isinstance(app.screen, LaunchDialog), "nothing starts before the confirm"
    await pilot.press("ctrl+s")
    return await until(lambda: mounted(app, RunScreen), timeout=30, what=f"the run screen (on {app.screen})")


async def test_launch_watch_stop_from_the_console_and_find_the_cause_in_history(agent: AgentProc, history: History) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=agent.state_dir, interval_s=0.2, history=history)))
    async with app.run_test(size=SIZE) as pilot:
        await _local_up(app)
        screen = await _launch_command(app, pilot, f'{sys.executable} -u -c "{PROG}"', "console-run")
        view = screen.query_one("#run-log", OutputView)
        await until(lambda: view.line_count > 20, what="output in the view")
        assert view.line(0) == "line 0"

        # search: '/' then a term jumps to the line and highlights it; following stops
        await pilot.press("g")  # to the top: reading, not following
        await pilot.press("slash")
        await until(lambda: screen.query_one("#run-search", Input).has_focus, what="the search box")
        await pilot.press(*"line 7", "enter")
        await until(lambda: screen._match_line == 7, what="the search to find line 7")
        assert view.follow is False and view.search_term == "line 7"

        await pilot.press("s")
        await until(lambda: mounted(app, ConfirmDialog), what="the stop confirmation")
        await pilot.press("y")
        result = await until(lambda: mounted(app, ResultDialog), timeout=30, what="the stop result")
        body = text_of(result.query_one("#result-body", Static))
        assert "stopped" in body and "SIGTERM" in body
        await pilot.press("escape")

        rid = screen.run_id
        runs = await press_for(pilot, "r", RunsScreen)
        rt = runs.query_one("#runs-table", KeyedTable)
        await until(lambda: rid in rt.keys() and str(rt.get_cell(rid, "state")) == "stopped", what="the stopped run in Runs")
        assert "stopped by operator" in str(rt.get_cell(rid, "why"))

        hist = await press_for(pilot, "h", HistoryScreen)
        await pilot.press("slash")
        await until(lambda: hist.query_one("#history-filter", Input).has_focus, what="the filter box")
        await pilot.press(*"state:stopped", "enter")
        ht = hist.query_one("#history-table", KeyedTable)
        await until(lambda: f"local/{rid}" in ht.keys(), what="the run in the history")
        assert "stopped by operator" in str(ht.get_cell(f"local/{rid}", "why"))
        await pilot.press("enter")  # opens the recorded run
        reopened = await until(lambda: mounted(app, RunScreen), what="the run from the history")
        assert reopened.run_id == rid


async def test_launch_dialog_refuses_a_trainer_without_a_start(agent: AgentProc) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_launch(pilot, kind="fsdp", args="--model-config tiny")
        await pilot.pause()
        dialog.submit()
        await pilot.pause()
        assert isinstance(app.screen, LaunchDialog)
        assert "no default" in text_of(dialog.query_one("#launch-error", Static))


async def test_simulated_gpus_are_labelled_and_a_foreign_holder_is_attributed(sim_agent: AgentProc, foreign_holder: Holder) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE):
        await _local_up(app)
        table = app.screen.query_one("#fleet-table", KeyedTable)
        await until(lambda: "SIMULATED" in str(table.get_cell("local", "host")), what="the SIMULATED marker")
        host = await open_host(app, "local")
        procs = host.query_one("#proc-table", KeyedTable)
        key = f"1:{foreign_holder.pid}"
        await until(lambda: key in procs.keys(), what="the foreign holder on GPU 1")
        assert str(procs.get_cell(key, "holder")) == "FOREIGN" and procs.get_cell(key, "gib") == "20.0"
        assert "SIMULATED" in text_of(host.query_one("#host-title", Static))


async def test_reclaim_a_foreign_holder_from_the_host_screen(sim_agent: AgentProc, foreign_holder: Holder) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        await _local_up(app)
        host = await open_host(app, "local")
        procs = host.query_one("#proc-table", KeyedTable)
        await until(lambda: f"1:{foreign_holder.pid}" in procs.keys(), what="the foreign holder")
        await pilot.press("a", "x")
        confirm = await until(lambda: mounted(app, ConfirmDialog), what="the reclaim confirmation")
        assert "frees 20.0 GiB" in text_of(confirm.query_one("#confirm-body", Static))
        await pilot.press("y")
        result = await until(lambda: mounted(app, ResultDialog), timeout=40, what="the reclaim result")
        body = text_of(result.query_one("#result-body", Static))
        assert text_of(result.query_one(".dialog-title", Static)) == "Reclaimed on local", body
        assert str(foreign_holder.pid) in body and "20.0 GiB freed" in body and "SURVIVED" not in body
        assert not foreign_holder.alive()


async def test_leftovers_from_the_real_agent(sim_agent: AgentProc, foreign_holder: Holder) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE):
        await _local_up(app)
        app.push_screen(LeftoversScreen("local"))
        screen = await until(lambda: mounted(app, LeftoversScreen), what="the leftovers screen")
        table = screen.query_one("#leftovers-table", KeyedTable)
        await until(
            lambda: str(foreign_holder.pid) in table.keys(),
            timeout=20,
            what=f"the foreign holder listed ({text_of(screen.query_one('#leftovers-progress', Static))})",
        )
        assert str(table.get_cell(str(foreign_holder.pid), "kind")) == "foreign"


async def test_preflight_verdict_from_the_real_agent(sim_agent: AgentProc) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        await _local_up(app)
        dialog = await open_launch(pilot, args="sleep 5")
        await pilot.press("ctrl+s")
        panel = dialog.query_one("#preflight", Static)
        await until(lambda: "pre-flight on" in text_of(panel), timeout=30, what=f"the agent's verdict ({text_of(panel)})")
        assert "gpus_exist" in text_of(panel) and "could not run" not in text_of(panel)


async def test_verify_claims_from_the_real_agent(sim_agent: AgentProc) -> None:
    app = GpudeckApp(Ops.console(Fleet(state_dir=sim_agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE):
        run = await _open_cli_run(app, sim_agent, "claims-1b")
        claims = run.query_one("#claims-table", KeyedTable)
        await until(lambda: claims.row_count > 0, timeout=20, what=f"claims rows ({text_of(run.query_one('#claims-note', Static))})")


async def test_the_environment_fingerprint_taken_at_launch_is_shown(agent: AgentProc) -> None:
    import platform

    app = GpudeckApp(Ops.console(Fleet(state_dir=agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        run = await _open_cli_run(app, agent, "fp")
        await pilot.press("3")
        env = run.query_one("#run-env", Static)
        await until(lambda: platform.python_version() in text_of(env), timeout=20, what=f"the fingerprint ({text_of(env)[:200]})")
        assert run.query_one("#env-packages", KeyedTable).row_count > 10


async def test_triage_from_the_run_screen_is_the_cli_s_operation(agent: AgentProc) -> None:
    """T on the Run screen gathers the run's triage through ops.triage (as `gpudeck triage`), shown as text; the run lives on."""
    app = GpudeckApp(Ops.console(Fleet(state_dir=agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE) as pilot:
        run = await _open_cli_run(app, agent, "[bold]triage-me[/]")
        await until(lambda: run.run is not None and run.run.state == "running", what="the run to be running")
        await pilot.press("T")
        box = run.query_one("#triage-text", Static)
        await until(lambda: "likely culprit" in text_of(box), timeout=120, what=f"the triage ({text_of(box)!r})")
        assert f"triage of {run.run_id}" in text_of(box) and "stacks by" in text_of(box)
        assert run.query_one("#run-tabs").active == "tab-claims"
        assert agent.cli_json("show", run.run_id)["state"] == "running"


async def test_the_fleet_says_when_gpudeck_watch_fails_to_notify(agent: AgentProc) -> None:
    """Targets gpudeck watch keeps failing (its outbox next to the history) are named on the Fleet screen, secrets hidden:
    a token given as the user, a header, a token in the path (every other form: tests/unit/test_notify.py)."""
    from gpudeck.console.watch import outbox as ob
    from gpudeck.console.watch.service import outbox_path
    from tests.notify_urls import CLOSED, SECRET, leaks

    box = ob.Outbox(outbox_path())
    urls = [f"ntfy://{SECRET}@{CLOSED}/alerts", f"json://{CLOSED}/hook?+Authorization=Bearer%20{SECRET}", f"json://{CLOSED}/h/{SECRET}"]
    box.enqueue([ob.Item("local", "e", 1, u, 0, "failed", "r-00000001", "t", "b", "failure", False, 1000.0) for u in urls], 1, 1000.0)
    for _ in range(ob.FAILING_AFTER):
        for it in box.due(now=1e12):
            box.failed(it, f"503 Service Unavailable from {it.target}", now=1000.0)
    box.close()
    app = GpudeckApp(Ops.console(Fleet(state_dir=agent.state_dir, interval_s=0.2)))
    async with app.run_test(size=SIZE):
        await _local_up(app)
        summary = app.screen.query_one("#fleet-summary", SteadyText)
        await until(lambda: "notifications failing" in text_of(summary), what=f"the failing target ({text_of(summary)!r})")
        assert text_of(summary).count("127.0.0.1:9") == 3 and not leaks(text_of(summary)), text_of(summary)
