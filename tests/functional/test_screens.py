"""The console's screens driven with Pilot over fixture data: what they show, what they ask the fleet to do, and how much they redraw."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Input, OptionList, Select, SelectionList, Static

from gpudeck.agents.wire.errors import BadRequest
from gpudeck.agents.wire.protocol import Gpu, LaunchSpec, Snapshot
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import FLUSH_S, GpudeckApp
from gpudeck.console.tui.commands import GpudeckCommands
from gpudeck.console.tui.screens.dialogs import ChoiceDialog, ConfirmDialog, ResultDialog
from gpudeck.console.tui.screens.diff import DiffScreen
from gpudeck.console.tui.screens.history import HistoryScreen
from gpudeck.console.tui.screens.launch import LaunchDialog
from gpudeck.console.tui.screens.leftovers import LeftoversScreen
from gpudeck.console.tui.screens.picker import RunPicker
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from gpudeck.console.tui.widgets.steady import SteadyText
from tests.functional.fixture_fleet import FAILED, GOOD, LIVE, STOPPED, T0, FixtureFleet, fixture_link
from tests.functional.helpers import mounted, open_host, open_launch, press_for, text_of, until

SIZE = (180, 50)


@pytest.fixture
def fleet(tmp_path: Path) -> FixtureFleet:
    return FixtureFleet(tmp_path / "history.db")


# ----------------------------------------------------------------------------- fleet


class BigFleet(FixtureFleet):
    """256 up hosts with two simulated GPUs each (fixture), no history."""

    def __init__(self, n: int = 256) -> None:
        super().__init__(None)
        self.links = {}
        for i in range(n):
            gpus = [
                Gpu(index=g, uuid=f"GPU-SIM-{i}-{g}", name="SIMULATED H200", memory_used=0, memory_total=141 * 2**30, util_gpu=0)
                for g in range(2)
            ]
            self.links[f"h{i:03d}"] = fixture_link(
                f"h{i:03d}", "up", snapshot=Snapshot(host=f"h{i:03d}", ts=T0, epoch="e", gpus=gpus, simulated=True)
            )


async def test_fleet_of_256_hosts_updates_only_the_rows_that_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = BigFleet()
    app = GpudeckApp(Ops.console(fleet))
    cleared: list[bool] = []
    monkeypatch.setattr(KeyedTable, "clear", lambda self, columns=False: cleared.append(True))
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet-table", KeyedTable)
        assert table.row_count == 256
        await pilot.pause()
        before = table.render_line(1 + 7).text  # painted (and cached) before the change
        assert "0.0/282.0" in before
        written = table.cells_written
        # three hosts get a new snapshot (memory used on GPU 0); the others send the same figures again
        for name in ("h007", "h100", "h255"):
            link = fleet.links[name]
            snap = link.status.snapshot
            assert snap is not None
            snap.gpus[0].memory_used = 70 * 2**30
            snap.gpus[0].util_gpu = 90
        for link in fleet.links.values():
            link._notify()
        flushes = app.flushes
        await until(lambda: app.flushes > flushes, what="a flush")
        await pilot.pause()
        changed = table.cells_written - written
        # h007 is on screen: its memory and util cells are redrawn; h100 and h255 are below the fold and wait
        assert changed == 2, f"{changed} cells written for 3 changed hosts, one of them on screen"
        assert "70.0/282.0" in str(table.get_cell("h007", "memory"))
        assert (
            "70.0/282.0" in table.render_line(1 + 7).text and "0.0/282.0" in table.render_line(1 + 8).text
        )  # what is painted, not only stored
        assert "70.0/282.0" in str(table.cells_of("h100")["memory"]) and "0.0/282.0" in str(table.get_cell("h100", "memory"))
        table.move_cursor_to_key("h100")  # scrolling there writes what waited
        await pilot.pause()
        await until(lambda: "70.0/282.0" in str(table.get_cell("h100", "memory")), what="h100's cells once in view")
        row = next(y for y in range(table.size.height) if table.render_line(y).text.lstrip().startswith("h100"))
        assert "70.0/282.0" in table.render_line(row).text
        assert table.cells_written - written == 4
        assert table.row_count == 256 and not cleared
        summary = text_of(app.screen.query_one("#fleet-summary", SteadyText))
        assert "256 host(s)" in summary and "256 up" in summary and "210.0/72192.0 GiB" in summary


async def test_fleet_shows_link_states_with_their_messages_and_the_simulated_marker(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE):
        table = app.screen.query_one("#fleet-table", KeyedTable)
        assert str(table.get_cell("gpu2", "state")).startswith("unreachable ")
        assert str(table.get_cell("gpu2", "alerts")).startswith("since ") and "connect timed out" in str(table.get_cell("gpu2", "alerts"))
        assert str(table.get_cell("gpu3", "state")).startswith("host key refused")
        assert "known_hosts" in str(table.get_cell("gpu3", "alerts"))
        assert "install the same gpudeck" in str(table.get_cell("gpu4", "alerts"))
        assert "SIMULATED" in str(table.get_cell("sim1", "host")) and "SIMULATED" not in str(table.get_cell("gpu1", "host"))
        assert "rank exited" in str(table.get_cell("gpu1", "alerts"))


# ----------------------------------------------------------------------------- host and reclaim


async def test_reclaim_marked_leftovers_confirms_per_gpu_then_shows_the_verified_result(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        await open_host(app)
        await pilot.press("a")
        table = app.screen.query_one("#proc-table", KeyedTable)
        assert table.marks == {"1:3301", "1:999", "2:123456"}
        dialog = await press_for(pilot, "x", ConfirmDialog)
        body = text_of(dialog.query_one("#confirm-body", Static))
        assert "Reclaim 3 process(es) on gpu1" in body
        assert "GPU 1" in body and "frees 24.0 GiB" in body and "GPU 2" in body and "frees 5.0 GiB" in body
        assert "29.0 GiB should come back" in body and "live run" not in body
        result = await press_for(pilot, "y", ResultDialog)
        assert "24.0 GiB freed" in text_of(result.query_one("#result-body", Static))
        assert fleet.reclaimed == [("gpu1", [999, 3301, 123456], False)]


async def test_reclaiming_a_live_run_member_says_it_breaks_the_run(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        await open_host(app)
        await pilot.press("space")  # the first row: pid 4412, rank 0 of the live run
        dialog = await press_for(pilot, "x", ConfirmDialog)
        assert "belong(s) to live run r-7f3a9c21" in text_of(dialog.query_one("#confirm-body", Static))
        await pilot.press("escape")  # cancelled: nothing is reclaimed
        await pilot.pause()
        assert fleet.reclaimed == []


async def test_leftovers_screen_lists_and_reclaims(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        await open_host(app)
        screen = await press_for(pilot, "L", LeftoversScreen)
        table = screen.query_one("#leftovers-table", KeyedTable)
        await until(lambda: table.row_count == 3, what="three leftovers")
        assert str(table.get_cell("3301", "kind")) == "orphan" and "failed" in str(table.get_cell("3301", "run_state"))
        await pilot.press("a", "x")
        await until(lambda: mounted(app, ConfirmDialog), what="the reclaim confirmation")
        await pilot.press("y")
        await until(lambda: mounted(app, ResultDialog), what="the reclaim result")
        assert fleet.reclaimed == [("gpu1", [999, 3301, 123456], False)]


class OldAgentFleet(FixtureFleet):
    """Agents of an older gpudeck that do not answer Preflight, ListLeftovers and VerifyRun (they reply with an error)."""

    async def leftovers(self, host: str, include_live: bool = False):  # type: ignore[no-untyped-def]
        raise BadRequest("unsupported request ListLeftovers")

    async def preflight(self, host: str, spec: LaunchSpec):  # type: ignore[no-untyped-def]
        raise BadRequest("unsupported request Preflight")

    async def verify(self, host: str, run_id: str):  # type: ignore[no-untyped-def]
        raise BadRequest("unsupported request VerifyRun")


async def test_requests_the_agent_cannot_answer_show_its_message(tmp_path: Path) -> None:
    fleet = OldAgentFleet(tmp_path / "h.db")
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        app.push_screen(LeftoversScreen("gpu1"))
        screen = await until(lambda: mounted(app, LeftoversScreen), what="the leftovers screen")
        progress = screen.query_one("#leftovers-progress", Static)
        await until(lambda: "unsupported request ListLeftovers" in text_of(progress), what="the agent's error")
        await pilot.press("escape")
        app.open_run("gpu1", LIVE)
        run = await until(lambda: mounted(app, RunScreen), what="the run screen")
        await until(lambda: "unsupported request VerifyRun" in text_of(run.query_one("#claims-note", Static)), what="the verify error")
        await pilot.press("escape")
        dialog = await open_launch(pilot, args="sleep 5")
        await pilot.press("ctrl+s")
        await until(
            lambda: "pre-flight could not run on gpu1" in text_of(dialog.query_one("#preflight", Static)), what="the pre-flight error"
        )
        assert "unsupported request Preflight" in text_of(dialog.query_one("#preflight", Static))
        await pilot.press("ctrl+s")  # the agent checks at launch anyway: launching is allowed, and said so
        await until(lambda: mounted(app, RunScreen), what="the new run")
        assert len(fleet.launched) == 1


# ----------------------------------------------------------------------------- launch


async def test_launch_shows_preflight_before_the_final_confirm_and_forces_only_past_holders(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_launch(pilot, args="python train.py")
        dialog.query_one("#gpus", SelectionList).select(1)
        await pilot.press("ctrl+s")
        panel = dialog.query_one("#preflight", Static)
        await until(lambda: "FAILED" in text_of(panel), what="the pre-flight verdict")
        assert "gpu_holders" in text_of(panel) and "pid 3301" in text_of(panel)
        assert fleet.launched == [] and fleet.preflighted[0][1].gpus == [1]
        assert "force" in str(dialog.query_one("#launch").label)
        # an edit after pre-flight asks for pre-flight again, it never launches what was not checked
        dialog.query_one("#args", Input).value = "python train.py --lr 1e-4"
        await pilot.pause()
        await pilot.press("ctrl+s")
        await until(lambda: len(fleet.preflighted) == 2, what="a second pre-flight")
        assert fleet.launched == []
        await pilot.press("ctrl+s")
        run = await until(lambda: mounted(app, RunScreen), what="the new run's screen")
        host, spec = fleet.launched[0]
        assert host == "gpu1" and spec.force is True and spec.argv == ["python", "train.py", "--lr", "1e-4"] and spec.gpus == [1]
        assert run.run_id == "r-newrun01"


async def test_a_trainer_launch_needs_an_explicit_start(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_launch(pilot, kind="fsdp", args="--model-config tiny")
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "no default" in text_of(dialog.query_one("#launch-error", Static)) and fleet.preflighted == []
        dialog.query_one("#start", Select).value = "resume"
        dialog.query_one("#resume-step", Input).value = "200"
        await pilot.press("ctrl+s")
        await until(lambda: fleet.preflighted, what="pre-flight")
        spec = fleet.preflighted[0][1]
        assert spec.start == "resume 200" and spec.argv[-2:] == ["--resume", "200"]


# ----------------------------------------------------------------------------- runs, run, rollback


async def test_runs_screen_merges_live_runs_and_the_history(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        runs = await press_for(pilot, "r", RunsScreen)
        table = runs.query_one("#runs-table", KeyedTable)
        await until(lambda: GOOD in table.keys(), what="the history's runs")
        assert str(table.get_cell(LIVE, "state")) == "running" and "rank exited" in str(table.get_cell(LIVE, "why"))
        assert "CUDA out of memory" in str(table.get_cell(FAILED, "why"))
        assert table.keys()[0] == LIVE and table.keys()[-1] == GOOD  # newest first


async def test_run_screen_shows_claims_against_observations_and_alerts(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        app.open_run("gpu1", LIVE)
        run = await until(lambda: mounted(app, RunScreen), what="the run screen")
        claims = run.query_one("#claims-table", KeyedTable)
        await until(lambda: claims.row_count == 5, what="the claims")
        assert str(claims.get_cell("0:params", "ok")) == "✗" and str(claims.get_cell("0:params", "observed")) == "771.0M"
        assert "params, world size, GPUs" in text_of(run.query_one("#claims-note", Static))
        alerts = run.query_one("#alerts-table", KeyedTable)
        await until(lambda: alerts.row_count == 3, what="the alerts (run's and verify's)")
        await pilot.press("3")
        assert "2.7.0+cu128" in text_of(run.query_one("#run-env", Static))
        assert run.query_one("#env-packages", KeyedTable).row_count == 6


class QuietFleet(FixtureFleet):
    """Runs that have printed nothing yet (sleep 600)."""

    async def output(self, host, run_id, offset=0, follow=True):  # type: ignore[no-untyped-def]
        import asyncio

        await asyncio.sleep(3600)
        yield  # pragma: no cover


async def test_a_run_without_output_says_so_and_a_plain_command_has_no_fingerprint_to_show(tmp_path: Path) -> None:
    app = GpudeckApp(Ops.console(QuietFleet(tmp_path / "h.db")))
    async with app.run_test(size=SIZE) as pilot:
        app.open_run("gpu1", STOPPED)  # `sleep 1000`: a plain command
        run = await until(lambda: (s := mounted(app, RunScreen)) is not None and s.run is not None and s, what="the run")
        await until(lambda: "no output yet" in text_of(run.query_one("#run-status", Static)), timeout=5, what="the no-output note")
        await pilot.press("3")
        assert "a plain command: no python environment to fingerprint" in text_of(run.query_one("#run-env", Static))


async def test_rollback_shows_the_diff_then_relaunches_in_the_good_environment_with_an_explicit_start(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        app.open_run("gpu1", LIVE)
        await until(lambda: (s := mounted(app, RunScreen)) is not None and s.run is not None, what="the run")
        picker = await press_for(pilot, "b", RunPicker)
        assert picker.query_one("#picker-table", KeyedTable).keys() == [f"gpu1/{GOOD}"]
        choice = await press_for(pilot, "enter", ChoiceDialog)
        body = choice.body
        from rich.console import Console

        console = Console(width=160, record=True)
        console.print(body)
        shown = console.export_text()
        assert "torch" in shown and "2.6.0+cu124" in shown and "environment changes that matter" in shown
        dialog = await press_for(pilot, "e", LaunchDialog)
        await pilot.pause()
        assert dialog.query_one("#python", Input).value == "/opt/venv/bin/python3"
        assert dialog.query_one("#args", Input).value == "--model-config llama-1b --lr 3e-4"  # this run's config, the old start dropped
        assert dialog.query_one("#start", Select).value == Select.NULL
        assert dialog.query_one("#gpus", SelectionList).selected == [0]
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert "no default" in text_of(dialog.query_one("#launch-error", Static))


# ----------------------------------------------------------------------------- history and diff


async def test_history_filters_with_the_query_language_and_diffs_two_runs(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        screen = await press_for(pilot, "h", HistoryScreen)
        table = screen.query_one("#history-table", KeyedTable)
        await until(lambda: table.row_count == 4, what="four recorded runs")
        await pilot.press("slash")
        await until(lambda: screen.query_one("#history-filter", Input).has_focus, what="the filter box")
        await pilot.press(*"state:failed", "enter")
        await until(lambda: table.keys() == [f"gpu1/{FAILED}"], what="the filter to apply")
        screen.query_one("#history-filter", Input).value = "colour:red"
        await pilot.press("slash", "enter")
        await until(lambda: "unknown filter 'colour'" in text_of(screen.query_one("#history-note", Static)), what="the query error")
        screen.query_one("#history-filter", Input).value = "kind:fsdp"
        await pilot.press("slash", "enter")
        await until(lambda: table.row_count == 2, what="the fsdp runs")
        table.focus()
        await pilot.press("space", "space", "d")
        diff = await until(lambda: mounted(app, DiffScreen), what="the diff screen")
        rows = diff.query_one("#diff-table", KeyedTable)
        assert rows.keys()[:4] == ["environment:torch", "environment:torch_cuda", "environment:driver", "environment:nccl"]
        assert [str(rows.get_cell(k, "key")) for k in rows.keys()[:4]] == ["torch", "torch CUDA build", "driver", "NCCL"]
        assert "environment changes that matter: torch, torch CUDA build, driver, NCCL" in text_of(diff.query_one("#diff-summary", Static))
        assert "config:kind" in rows.keys() and "config:--lr" in rows.keys()
        await pilot.press("d")  # only the differences
        assert "config:kind" not in rows.keys() and "config:--lr" in rows.keys()


# ----------------------------------------------------------------------------- palette, help, theme


async def test_the_palette_offers_every_action_of_the_screen_and_every_host(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_host(app)
        names = [name for name, _, _ in GpudeckCommands(screen)._commands()]
        for want in ("Reclaim marked", "Leftovers", "Mark leftovers", "Runs", "History", "Launch", "Theme: light", "Open host gpu3"):
            assert want in names, want
        from textual.command import CommandPalette

        await pilot.press("escape")
        app.open_run("gpu1", LIVE)  # its search key is '/', which the palette must not read as markup ('[/]' ends the app)
        await until(lambda: mounted(app, RunScreen), what="the run screen")
        palette = await press_for(pilot, "ctrl+p", CommandPalette)
        await pilot.pause(0.5)
        assert app.is_running and any("Search" in str(o.prompt) for o in palette.query_one(OptionList).options)
        await pilot.press(*"sear")
        await pilot.pause(0.5)
        assert app.is_running


async def test_help_toggles_and_the_theme_switches(fleet: FixtureFleet) -> None:
    from textual.widgets import HelpPanel

    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert app.screen.query(HelpPanel)
        await pilot.press("question_mark")
        await pilot.pause()
        assert not app.screen.query(HelpPanel)
        assert app.theme == "textual-dark"
        await pilot.press("ctrl+t")
        assert app.theme == "textual-light"


async def test_closing_a_screen_at_once_does_not_end_the_app(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(3):
            app.open_host("gpu1")
            app.pop_screen()  # before its header drew the title
            app.open_run("gpu1", LIVE)
            app.pop_screen()
        await pilot.pause(0.3)
        assert app.is_running and isinstance(app.screen, type(app.screen_stack[1]))


async def test_the_console_freezes_its_start_up_heap_once_the_fleet_has_answered(
    fleet: FixtureFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Then it leaves the middle and full collections to itself, and runs a due one only when keys stop coming; a
    young one it starts whenever none ran for gcpolicy.YOUNG_EVERY_S, keys or not.

    The collector's calls are recorded, not made: this test process's own collector is left as it was."""
    import gc
    import time

    from gpudeck.console.core import gcpolicy

    frozen: list[bool] = []
    thresholds: list[tuple[int, ...]] = []
    collected: list[int] = []
    counts = [(0, 0, 0)]
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr(gc, "set_threshold", lambda *t: thresholds.append(t))
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    monkeypatch.setattr(gc, "get_count", lambda: counts[0])
    fleet.links["gpu5"].status.state = "unreachable"  # every host has answered one way or another
    app = GpudeckApp(Ops.console(fleet), freeze_gc=True)
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: frozen, what="gc.freeze")
        await pilot.pause(0.6)
        assert frozen == [True]  # once
        assert thresholds == [(gcpolicy.YOUNG_AT, gcpolicy.NEVER, gcpolicy.NEVER)]
        collected.clear()  # the one before the freeze
        before = time.monotonic()
        await pilot.press("down")
        assert app._input_at >= before  # a key press is input
        # no collection has run since (the recorded ones are not made): young ones are started, keys or not
        await until(lambda: 0 in collected, what="a young collection after YOUNG_EVERY_S without one")
        counts[0] = (0, gcpolicy.MIDDLE_AFTER, 0)  # a middle collection is due
        app._input_at = time.monotonic() + 3600  # keys keep coming (no wall-clock race on a busy machine)
        collected.clear()
        await pilot.pause(3 * FLUSH_S)
        assert 1 not in collected and 2 not in collected  # the middle one waits
        collected.clear()
        app._input_at = 0.0  # they stopped
        await until(lambda: 1 in collected, what="the middle collection once keys stopped")
        assert 2 not in collected
    async with GpudeckApp(Ops.console(FixtureFleet())).run_test(size=SIZE) as pilot:  # tests and embedders: never
        await pilot.pause(0.6)
        assert frozen == [True]


@pytest.mark.parametrize(
    "fields,cli",
    [
        (dict(kind="fsdp", args="--model-config tiny"), ["--kind", "fsdp", "--", "--model-config", "tiny"]),
        (
            dict(kind="dflash", args="--target t", start="resume", resume_step="abc"),
            ["--kind", "dflash", "--resume", "abc", "--", "--target", "t"],
        ),
        (
            dict(kind="fsdp", args="--out o", start="fresh", ranks="0"),
            ["--kind", "fsdp", "--fresh", "--nproc-per-node", "0", "--", "--out", "o"],
        ),
        (dict(args="python 'train.py"), None),
        (
            dict(kind="fsdp", hosts="gpu1,gpu1", start="fresh", args="--out o"),
            ["--hosts", "gpu1,gpu1", "--kind", "fsdp", "--fresh", "--", "--out", "o"],
        ),
        (
            dict(kind="fsdp", hosts="gpu1,bad host", start="fresh", args="--out o"),
            ["--hosts", "gpu1,bad host", "--kind", "fsdp", "--fresh", "--", "--out", "o"],
        ),
    ],
    ids=["no start", "resume step", "ranks", "a quote", "a host twice", "a bad host name"],
)
async def test_the_dialog_says_what_the_cli_says_for_the_same_mistake(fleet: FixtureFleet, fields: dict, cli: list[str] | None) -> None:
    import subprocess
    import sys

    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_launch(pilot, **fields)
        await pilot.press("ctrl+s")
        await pilot.pause()
        shown = text_of(dialog.query_one("#launch-error", Static))
        assert shown and fleet.preflighted == []
    if cli is None:
        assert shown.startswith("arguments: ")
        return
    cp = subprocess.run(
        [sys.executable, "-m", "gpudeck.console.cli.main", "preflight", "--host", "gpu1", *cli], capture_output=True, text=True, timeout=60
    )
    assert cp.returncode == 2 and cp.stderr.strip() == f"gpudeck: {shown}", (cp.stderr, shown)
