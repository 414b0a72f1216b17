"""A screen handed many hosts' changes at once takes them a slice at a time (issue 33: 1,024 hosts answering within the
same 20 ms were one flush of every row, and a key pressed meanwhile waited behind all of it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.base import LiveScreen
from gpudeck.console.tui.screens.fleet import FleetScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.functional.fixture_fleet import FixtureFleet
from tests.functional.helpers import until

SIZE = (180, 50)


async def test_a_delivery_larger_than_a_slice_comes_in_config_order_slices_in_turns_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LiveScreen, "DELIVER_SLICE", 2)
    fleet = FixtureFleet(tmp_path / "history.db")
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        table = screen.query_one("#fleet-table", KeyedTable)
        order = list(fleet.links)
        await until(lambda: sorted(table.keys()) == sorted(order), what="every host's row (delivered in slices)")
        slices: list[set[str]] = []
        own = screen.hosts_changed

        def spy(names: set[str]) -> None:
            slices.append(set(names))
            own(names)

        monkeypatch.setattr(screen, "hosts_changed", spy)
        screen.queue({"gone-host", *order}, False)  # a host no longer in the config comes first (its row dropped)
        screen.deliver()
        assert slices == [{"gone-host", order[0]}]  # one slice now, the rest queued
        await until(lambda: len(slices) == 4, what="the rest, a slice per turn")
        assert slices[1:] == [set(order[1:3]), set(order[3:5]), set(order[5:])]
        await pilot.pause()
        assert len(slices) == 4 and sorted(table.keys()) == sorted(order)


async def test_a_slice_left_when_the_screen_is_covered_waits_until_it_is_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LiveScreen, "DELIVER_SLICE", 2)
    fleet = FixtureFleet(tmp_path / "history.db")
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        fleet_screen = app.screen
        slices: list[set[str]] = []
        own = fleet_screen.hosts_changed
        monkeypatch.setattr(fleet_screen, "hosts_changed", lambda names: (slices.append(set(names)), own(names))[1])
        fleet_screen.queue(set(fleet.links), False)
        fleet_screen.deliver()
        app.action_show_runs()  # the Runs screen covers the Fleet before the rest is delivered (no await in between)
        await until(lambda: app.screen is not fleet_screen, what="the Runs screen")
        await pilot.pause()
        assert len(slices) == 1 and fleet_screen._pending_hosts
        await pilot.press("escape")  # the Fleet again: what is left arrives
        await until(lambda: not fleet_screen._pending_hosts, what="the rest delivered on resume")


async def test_while_the_filter_bar_is_open_a_changed_rows_filter_text_is_made_with_the_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first key typed finds every row's filter text made (issue 33: every host's row changes every second, and the
    first key made 1,024 of them); the filter still matches the rows' newest text."""
    from textual.app import App, ComposeResult

    from gpudeck.console.tui.widgets.keyed_table import Col

    monkeypatch.setattr(KeyedTable, "HAY_WARM_SLICE", 7)  # the warm-up in several turns

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield KeyedTable([Col("name", "NAME", 10), Col("n", "N", 6)])

    app = One()
    async with app.run_test(size=(60, 30)) as pilot:
        table = app.query_one(KeyedTable)
        table.upsert_many({f"k{i}": {"name": f"row{i}", "n": i} for i in range(40)})
        await pilot.pause()
        table.upsert("k3", {"name": "row3", "n": 99})  # no bar: its text waits for the next filter
        assert "k3" not in table._hay
        table.focus()
        await pilot.press("slash")
        await until(lambda: all(f"k{i}" in table._hay for i in range(40)), what="every row's filter text, made after the bar opened")
        table.upsert("k5", {"name": "row5", "n": 12345})  # the bar open: made with the update
        assert table._hay["k5"] == "row5 12345"
        await pilot.press("1", "2", "3", "4")
        await until(lambda: table.keys() == ["k5"], what="the row with the new text")
        await pilot.press("escape")
        await until(lambda: len(table.keys()) == 40, what="every row again")
        table.upsert("k6", {"name": "row6", "n": 7})  # the bar closed: back to making it on the next filter
        assert "k6" not in table._hay


async def test_the_event_loop_runs_between_two_slices_so_a_key_is_not_held_behind_the_whole_delivery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slicing is only worth it if other work gets the loop in between: a key arrives from the driver's thread as a
    callback on the loop, and the App handles it in its own task. A slice queued as the next message of the screen's
    own queue runs at once (the pump takes a ready message without yielding), so every slice ran back to back."""
    import asyncio

    monkeypatch.setattr(LiveScreen, "DELIVER_SLICE", 2)
    fleet = FixtureFleet(tmp_path / "history.db")
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE):
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        order = list(fleet.links)
        await until(lambda: len(screen.query_one("#fleet-table", KeyedTable).keys()) == len(order), what="every host's row")
        seen: list[str] = []
        own = screen.hosts_changed

        def spy(names: set[str]) -> None:
            seen.append("slice")
            if len(seen) == 1:  # as a key from the input thread would: a callback for the loop, after this slice
                asyncio.get_running_loop().call_soon(seen.append, "loop")
            own(names)

        monkeypatch.setattr(screen, "hosts_changed", spy)
        screen.queue(set(order), False)
        screen.deliver()
        await until(lambda: seen.count("slice") == 3, what="every slice")
        assert seen.index("loop") == 1, f"the loop's other work waited behind the slices: {seen}"
