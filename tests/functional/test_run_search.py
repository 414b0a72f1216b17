"""The Run screen's output search: n / N wrap around the ends, and the match it is on is drawn apart."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import Input

from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.widgets.output_view import OutputView
from tests.functional.fixture_fleet import LIVE, FixtureFleet
from tests.functional.helpers import mounted, until


async def test_search_wraps_with_n_and_shift_n_and_marks_the_current_match(tmp_path: Path) -> None:
    app = GpudeckApp(FixtureFleet(tmp_path / "history.db"))
    async with app.run_test(size=(150, 40)) as pilot:
        app.open_run("gpu1", LIVE)
        screen = await until(lambda: mounted(app, RunScreen), what="the run screen")
        view = screen.query_one("#run-log", OutputView)
        await until(lambda: view.line_count >= 40, what="the output")
        await pilot.press("g", "slash")
        await until(lambda: screen.query_one("#run-search", Input).has_focus, what="the search box")
        await pilot.press(*"step    3", "enter")  # lines 30..39 ('step {i:5d}')
        await until(lambda: screen._match_line == 30, what="the first match")
        assert view.current_match == 30
        await pilot.press("N")  # before the first: wraps to the last
        await until(lambda: screen._match_line == 39, what="the search to wrap to the bottom")
        assert view.current_match == 39
        await pilot.press("n")  # after the last: wraps to the first
        await until(lambda: screen._match_line == 30, what="the search to wrap to the top")
