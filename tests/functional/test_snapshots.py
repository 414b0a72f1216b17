"""Screen snapshots with fixture data (pytest-textual-snapshot): what an operator sees on every screen, pinned.

The clock is pinned (UTC, 'now' = T0 + 300 s) and every figure comes from
tests/functional/fixture_fleet.py, so a picture changes only when a screen
does. Update them with ``pytest tests/functional/test_snapshots.py --snapshot-update``
and look at the report before committing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import SelectionList

from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ChoiceDialog, ConfirmDialog
from gpudeck.console.tui.screens.diff import DiffScreen
from gpudeck.console.tui.screens.history import HistoryScreen
from gpudeck.console.tui.screens.leftovers import LeftoversScreen
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.functional.fixture_fleet import FAILED, GOOD, LIVE, FixtureFleet
from tests.functional.helpers import mounted, open_host, open_launch, press_for, until

SIZE = (150, 36)
WIDE = (180, 40)
TALL = (150, 50)
PINNED_PYTHON = "/opt/venv/bin/python3"  # the default is this checkout's python, whose path differs per machine


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """UTC, and 'now' for the console's relative times ('5m00s ago') fixed at T0 + 300 s."""
    import time
    import types

    from tests.functional.fixture_fleet import T0

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.setattr("gpudeck.console.core.fmt.time", types.SimpleNamespace(time=lambda: T0 + 300.0))


@pytest.fixture
def app(tmp_path: Path) -> GpudeckApp:
    return GpudeckApp(Ops.console(FixtureFleet(tmp_path / "history.db")))


async def settle(pilot) -> None:  # type: ignore[no-untyped-def]
    """Let workers answer and animations (tab underlines) end; stop cursors blinking (a focused Input's cursor
    is then always drawn: a slow machine otherwise catches it in either phase)."""
    from textual.widgets import Input

    await pilot.pause(0.3)
    await pilot.wait_for_scheduled_animations()
    for field in pilot.app.screen.query(Input):
        field.cursor_blink = False
    await pilot.pause()


# ----------------------------------------------------------------------------- fleet


def test_fleet_screen(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app, terminal_size=SIZE, run_before=settle)


def test_fleet_screen_light_theme(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def light(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("ctrl+t")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=light)


# ----------------------------------------------------------------------------- host, reclaim, leftovers


def test_host_screen_with_leftovers_marked(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def mark_leftovers(pilot) -> None:  # type: ignore[no-untyped-def]
        await open_host(pilot.app)
        await pilot.press("a")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=mark_leftovers)


def test_reclaim_confirm_dialog(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def confirm(pilot) -> None:  # type: ignore[no-untyped-def]
        await open_host(pilot.app)
        await pilot.press("a", "x")
        await until(lambda: mounted(pilot.app, ConfirmDialog), what="the confirmation")
        await settle(pilot)

    assert snap_compare(app, terminal_size=TALL, run_before=confirm)


def test_leftovers_screen(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def leftovers(pilot) -> None:  # type: ignore[no-untyped-def]
        pilot.app.push_screen(LeftoversScreen("gpu1"))
        screen = await until(lambda: mounted(pilot.app, LeftoversScreen), what="the leftovers screen")
        await until(lambda: screen.query_one("#leftovers-table", KeyedTable).row_count == 3, what="the leftovers")
        await settle(pilot)

    assert snap_compare(app, terminal_size=WIDE, run_before=leftovers)


# ----------------------------------------------------------------------------- runs and run


def test_runs_screen(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def open_runs(pilot) -> None:  # type: ignore[no-untyped-def]
        screen = await press_for(pilot, "r", RunsScreen)
        await until(lambda: GOOD in screen.query_one("#runs-table", KeyedTable).keys(), what="the history's runs")
        await settle(pilot)

    assert snap_compare(app, terminal_size=WIDE, run_before=open_runs)


def _open_run(run_id: str, tab: str | None = None, ready=None):  # type: ignore[no-untyped-def]
    async def go(pilot) -> None:  # type: ignore[no-untyped-def]
        pilot.app.open_run("gpu1", run_id)
        screen = await until(
            lambda: (s := mounted(pilot.app, RunScreen)) is not None and s.run is not None and s.record is not None and s,
            what="the run and its record",
        )
        await until(lambda: screen.query_one("#claims-table", KeyedTable).row_count == 5, what="the claims")
        if tab:
            await pilot.press(tab)
        await settle(pilot)
        await pilot.pause(0.3)

    return go


def test_run_screen_output(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app, terminal_size=SIZE, run_before=_open_run(FAILED))


def test_run_screen_spec(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app, terminal_size=SIZE, run_before=_open_run(LIVE, "2"))


def test_run_screen_environment(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app, terminal_size=SIZE, run_before=_open_run(LIVE, "3"))


def test_run_screen_claims_and_alerts(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app, terminal_size=SIZE, run_before=_open_run(LIVE, "4"))


def test_rollback_diff_dialog(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def rollback(pilot) -> None:  # type: ignore[no-untyped-def]
        await _open_run(LIVE)(pilot)
        await pilot.press("b")
        await until(lambda: pilot.app.screen.__class__.__name__ == "RunPicker" and pilot.app.screen.is_mounted, what="the picker")
        await pilot.press("enter")
        await until(lambda: mounted(pilot.app, ChoiceDialog), what="the diff dialog")
        await settle(pilot)

    assert snap_compare(app, terminal_size=TALL, run_before=rollback)


# ----------------------------------------------------------------------------- launch


def test_launch_dialog(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def launch_form(pilot) -> None:  # type: ignore[no-untyped-def]
        await open_launch(pilot, python=PINNED_PYTHON)
        await settle(pilot)

    assert snap_compare(app, terminal_size=TALL, run_before=launch_form)


async def preflight_llama(pilot):  # type: ignore[no-untyped-def]
    """The launch form filled for llama-1b on GPU 1, then ctrl+s (pre-flight); returns the dialog."""
    dialog = await open_launch(
        pilot, python=PINNED_PYTHON, kind="fsdp", args="--model-config llama-1b --lr 3e-4", name="llama-1b", start="fresh"
    )
    dialog.query_one("#gpus", SelectionList).select(1)
    await pilot.pause()
    await pilot.press("ctrl+s")
    return dialog


def test_launch_dialog_with_the_preflight_result(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def preflight(pilot) -> None:  # type: ignore[no-untyped-def]
        dialog = await preflight_llama(pilot)
        # the verdict drawn and the dialog's progress line stopped (the fleet answering is not yet the dialog showing it)
        await until(
            lambda: "FAILED" in str(dialog.query_one("#preflight").render()) and not dialog.query_one("#launch-progress").running,
            what="the pre-flight verdict",
        )
        await settle(pilot)

    assert snap_compare(app, terminal_size=TALL, run_before=preflight)


# ----------------------------------------------------------------------------- history and diff


async def open_history(pilot) -> KeyedTable:  # type: ignore[no-untyped-def]
    """h, then wait for the four recorded runs; returns the table."""
    screen = await press_for(pilot, "h", HistoryScreen)
    table = screen.query_one("#history-table", KeyedTable)
    await until(lambda: table.row_count == 4, what="the recorded runs")
    return table


def test_history_screen(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def history(pilot) -> None:  # type: ignore[no-untyped-def]
        await open_history(pilot)
        await pilot.press("space")  # one run marked for a diff
        await settle(pilot)

    assert snap_compare(app, terminal_size=WIDE, run_before=history)


def test_diff_screen(snap_compare, app) -> None:  # type: ignore[no-untyped-def]
    async def diff(pilot) -> None:  # type: ignore[no-untyped-def]
        table = await open_history(pilot)
        table.mark_all([f"gpu1/{LIVE}", f"gpu1/{GOOD}"])
        await pilot.press("d")
        await until(lambda: mounted(pilot.app, DiffScreen), what="the diff screen")
        await settle(pilot)

    assert snap_compare(app, terminal_size=WIDE, run_before=diff)
