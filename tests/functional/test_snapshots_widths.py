"""The wide tables at 100 and 200 columns (the least important columns fold first), filtered and sorted.

Same pinned clock and fixture data as test_snapshots.py; update with ``--snapshot-update`` and look at the report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudeck.console.app import GpudeckApp
from gpudeck.console.screens.history import HistoryScreen
from gpudeck.console.screens.leftovers import LeftoversScreen
from gpudeck.console.screens.runs import RunsScreen
from gpudeck.console.widgets.keyed_table import KeyedTable
from tests.functional.fixture_fleet import GOOD, FixtureFleet
from tests.functional.helpers import mounted, open_host, press_for, until
from tests.functional.test_snapshots import fixed_clock, settle  # noqa: F401  (fixed_clock: an autouse fixture)


@pytest.fixture
def app(tmp_path: Path) -> GpudeckApp:
    return GpudeckApp(FixtureFleet(tmp_path / "history.db"))


WIDTHS = [pytest.param((100, 32), id="100"), pytest.param((200, 40), id="200")]


@pytest.mark.parametrize("size", WIDTHS)
def test_fleet_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app, terminal_size=size, run_before=settle)


@pytest.mark.parametrize("size", WIDTHS)
def test_fleet_filtered_and_sorted(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def filtered(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("slash", *"gpu", "enter", "greater_than_sign", "greater_than_sign")  # filter, then sort by STATE
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=filtered)


@pytest.mark.parametrize("size", WIDTHS)
def test_runs_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def open_runs(pilot) -> None:  # type: ignore[no-untyped-def]
        screen = await press_for(pilot, "r", RunsScreen)
        await until(lambda: GOOD in screen.query_one("#runs-table", KeyedTable).keys(), what="the history's runs")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=open_runs)


@pytest.mark.parametrize("size", WIDTHS)
def test_history_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def open_history(pilot) -> None:  # type: ignore[no-untyped-def]
        screen = await press_for(pilot, "h", HistoryScreen)
        await until(lambda: screen.query_one("#history-table", KeyedTable).row_count >= 3, what="the history")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=open_history)


@pytest.mark.parametrize("size", WIDTHS)
def test_host_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def host(pilot) -> None:  # type: ignore[no-untyped-def]
        await open_host(pilot.app)
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=host)


@pytest.mark.parametrize("size", WIDTHS)
def test_leftovers_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def leftovers(pilot) -> None:  # type: ignore[no-untyped-def]
        pilot.app.push_screen(LeftoversScreen("gpu1"))
        screen = await until(lambda: mounted(pilot.app, LeftoversScreen), what="the leftovers screen")
        await until(lambda: screen.query_one("#leftovers-table", KeyedTable).row_count == 3, what="the leftovers")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=leftovers)
