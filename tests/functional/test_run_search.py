"""The Run screen's output search: n / N wrap around the ends, and the match it is on is drawn apart."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import Input

from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.widgets.output_view import OutputView, match_spans
from tests.functional.fixture_fleet import LIVE, FixtureFleet
from tests.functional.helpers import mounted, until


async def search_box(pilot) -> tuple[RunScreen, OutputView]:  # type: ignore[no-untyped-def]
    """Open the live run's screen, wait for its output, go to the top and open the search box."""
    pilot.app.open_run("gpu1", LIVE)
    screen = await until(lambda: mounted(pilot.app, RunScreen), what="the run screen")
    view = screen.query_one("#run-log", OutputView)
    await until(lambda: view.line_count >= 40, what="the output")
    await pilot.press("g", "slash")
    await until(lambda: screen.query_one("#run-search", Input).has_focus, what="the search box")
    return screen, view


async def test_search_wraps_with_n_and_shift_n_and_marks_the_current_match(tmp_path: Path) -> None:
    app = GpudeckApp(Ops.console(FixtureFleet(tmp_path / "history.db")))
    async with app.run_test(size=(150, 40)) as pilot:
        screen, view = await search_box(pilot)
        await pilot.press(*"step    3", "enter")  # lines 30..39 ('step {i:5d}')
        await until(lambda: screen._match_line == 30, what="the first match")
        assert view.current_match == 30
        await pilot.press("N")  # before the first: wraps to the last
        await until(lambda: screen._match_line == 39, what="the search to wrap to the bottom")
        assert view.current_match == 39
        await pilot.press("n")  # after the last: wraps to the first
        await until(lambda: screen._match_line == 30, what="the search to wrap to the top")


async def test_the_current_match_keeps_its_first_character_and_every_match_is_highlighted(tmp_path: Path) -> None:
    app = GpudeckApp(Ops.console(FixtureFleet(tmp_path / "history.db")))
    async with app.run_test(size=(150, 40)) as pilot:
        screen, view = await search_box(pilot)
        await pilot.press(*"step", "enter")  # every line starts with it ('step {i:5d} loss ...')
        await until(lambda: view.current_match is not None, what="the first match")
        await pilot.pause()
        top = view.scroll_offset.y
        current = list(view.render_line(view.current_match - top))
        texts = [seg.text for seg in current]
        assert texts[0] == "▌" and "".join(texts[1:]).startswith(view.line(view.current_match).rstrip()[:10])
        assert current[1].text == "step" and current[1].style is not None and current[1].style.bgcolor is not None
        other = list(view.render_line(0 if view.current_match != top else 1))
        assert other[0].text == "step" and other[0].style is not None and other[0].style.bgcolor is not None


def test_a_match_cut_by_the_window_edge_is_highlighted_where_it_shows() -> None:
    text = "abc STEP def step"
    assert match_spans(text, "step", 0, len(text)) == [(4, 8), (13, 17)]
    assert match_spans(text, "step", 6, 15) == [(0, 2), (7, 9)]  # 'EP' at the left edge, 'st' at the right
    assert match_spans(text, "", 0, 10) == [] and match_spans(text, None, 0, 10) == []
