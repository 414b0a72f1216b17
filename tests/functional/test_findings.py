"""Findings of issue 30 on the console's screens, each driven through the app (Pilot) against the fixture fleet:
GPUs marked in the Launch dialog are named, its buttons stay in view under a long pre-flight, a stopped run shows no
live-run alert, the table filter shows what is typed, columns fold on resize, ..."""

from __future__ import annotations

from pathlib import Path

import msgspec
from textual.geometry import Region
from textual.widget import Widget
from textual.widgets import Button, Input, SelectionList, Static

from gpudeck.agents.wire.protocol import Alert, LaunchSpec, PreflightCheck, PreflightResult, RunInfo
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.diff import DiffScreen
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import FilterBar, KeyedTable
from tests.functional.fixture_fleet import GOOD, LIVE, STOPPED, T0, FixtureFleet, fixture_preflight, fixture_runs
from tests.functional.helpers import mounted, open_launch, press_for, text_of, until

SIZE = (160, 50)


class LongPreflightFleet(FixtureFleet):
    """Pre-flight answers with 40 more checks than the fixture's (a multi-GPU host with many holders)."""

    async def preflight(self, host: str, spec: LaunchSpec) -> PreflightResult:
        res = fixture_preflight(spec)
        more = [PreflightCheck(name=f"extra_{i}", ok=True, message=f"check {i} passed (fixture)") for i in range(40)]
        return msgspec.structs.replace(res, checks=[*res.checks, *more])


async def test_gpus_marked_in_the_launch_dialog_are_named_under_the_list() -> None:
    app = GpudeckApp(Ops.console(FixtureFleet()))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_launch(pilot)
        hint = dialog.query_one("#gpu-hint", Static)
        assert "none marked" in text_of(hint)
        picker = dialog.query_one("#gpus", SelectionList)
        picker.select(1)
        picker.select(3)
        await pilot.pause()
        said = text_of(hint)
        assert "none marked" not in said and "GPU 1, 3" in said and "CUDA_VISIBLE_DEVICES=1,3" in said
        picker.deselect_all()
        await pilot.pause()
        assert "none marked" in text_of(hint)


async def test_a_long_preflight_scrolls_inside_the_launch_dialog_and_its_buttons_stay_in_view() -> None:
    app = GpudeckApp(Ops.console(LongPreflightFleet()))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_launch(pilot, args="sleep 1")
        await pilot.press("ctrl+s")
        button = dialog.query_one("#launch", Button)
        await until(lambda: "force" in str(button.label), what="the pre-flight verdict")
        await pilot.pause()
        box = dialog.query_one("#launch-dialog").region
        for b in dialog.query(Button):
            if b.display:
                assert box.contains_region(b.region), f"{b.id} at {b.region} is outside the dialog {box}"
                assert b.region.bottom <= SIZE[1]
        await pilot.press("ctrl+s")  # the confirm is reachable by key, as it is on screen
        await until(lambda: app.ops.fleet.launched, what="the forced launch")  # type: ignore[attr-defined]


class StoppedWithAlertFleet(FixtureFleet):
    """The fixture's stopped run still carries a gpu_idle alert the agent raised while it ran (never cleared)."""

    def _stopped(self) -> RunInfo:
        run = next(r for r in fixture_runs() if r.id == STOPPED)
        idle = Alert(kind="gpu_idle", message="GPU 0 of the run at 0% for 5 min (fixture)", ts=T0 - 8100)
        return msgspec.structs.replace(run, alerts=[idle])

    async def runs(self, host: str, limit: int = 1000) -> list[RunInfo]:
        return [self._stopped() if r.id == STOPPED else r for r in await super().runs(host, limit)]

    async def run(self, host: str, run_id: str) -> RunInfo:
        return self._stopped() if run_id == STOPPED else await super().run(host, run_id)


async def test_a_stopped_run_shows_no_gpu_idle_warning() -> None:
    app = GpudeckApp(Ops.console(StoppedWithAlertFleet()))
    async with app.run_test(size=SIZE) as pilot:
        runs = await press_for(pilot, "r", RunsScreen)
        table = runs.query_one("#runs-table", KeyedTable)
        await until(lambda: STOPPED in table.keys(), what="the stopped run")
        why = str(table.get_cell(STOPPED, "why"))
        assert "stopped by operator" in why and "gpu idle" not in why and "⚠" not in why
        app.open_run("gpu1", STOPPED)
        screen = await until(lambda: mounted(app, RunScreen), what="the run screen")
        header = screen.query_one("#run-header", Static)
        await until(lambda: "stopped" in text_of(header), what="the run header")
        assert "⚠" not in text_of(header) and "1 alert(s) while it ran" in text_of(header)


def drawn_text(widget: Widget) -> str:
    """What ``widget`` draws, its lines joined."""
    lines = widget.render_lines(Region(0, 0, widget.size.width, widget.size.height))
    return "\n".join("".join(seg.text for seg in strip) for strip in lines)


async def test_the_filter_text_shows_while_it_is_typed() -> None:
    app = GpudeckApp(Ops.console(FixtureFleet()))
    async with app.run_test(size=SIZE) as pilot:
        table = await until(lambda: app.screen.query_one("#fleet-table", KeyedTable), what="the Fleet table")
        await until(lambda: "gpu1" in table.keys(), what="the fleet's rows")
        table.focus()
        await pilot.press("slash", "g", "p", "u", "1")
        await until(lambda: table.filter_text == "gpu1", what="the filter in force")
        await pilot.pause()
        box = app.screen.query_one(FilterBar).query_one(Input)
        assert box.size.height == 1 and "gpu1" in drawn_text(box)


async def test_columns_fold_and_come_back_when_the_terminal_is_resized() -> None:
    app = GpudeckApp(Ops.console(FixtureFleet()))
    async with app.run_test(size=(200, 50)) as pilot:
        table = await until(lambda: app.screen.query_one("#fleet-table", KeyedTable), what="the Fleet table")
        await until(lambda: "gpu1" in table.keys(), what="the fleet's rows")
        wide = [str(k.value) for k in table.columns]
        assert "agent" in wide and "gpus" in wide
        table.move_cursor_to_key("sim1")
        await pilot.resize_terminal(100, 50)
        await until(lambda: "agent" not in [str(k.value) for k in table.columns], what="the columns to fold at 100")
        await pilot.pause()
        assert "gpu1" in table.keys() and table.cursor_key == "sim1"
        assert str(table.get_cell("gpu1", "state")) == "up"
        assert sum(c.get_render_width(table) for c in table.columns.values()) <= 100
        await pilot.resize_terminal(200, 50)
        await until(lambda: [str(k.value) for k in table.columns] == wide, what="every column back at 200")


async def test_the_diff_header_counts_every_row_the_table_marks(tmp_path: Path) -> None:
    fleet = FixtureFleet(tmp_path / "history.db")
    assert fleet.history is not None
    a, b = fleet.history.find(GOOD), fleet.history.find(LIVE)
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        await app.push_screen(DiffScreen(a, b))
        screen = await until(lambda: mounted(app, DiffScreen), what="the diff screen")
        await pilot.pause()
        table = screen.query_one("#diff-table", KeyedTable)
        marked = [k for k in table.keys() if str(table.get_cell(k, "mark")).strip()]
        outcome = [k for k in marked if k.startswith("outcome:")]
        said = text_of(screen.query_one("#diff-summary", Static))
        assert outcome, "the fixture's runs differ in outcome (the case that was miscounted)"
        assert said.startswith(
            f"{len(marked)} difference(s) ({len(marked) - len(outcome)} in configuration and environment, {len(outcome)} in outcome)"
        ), said
