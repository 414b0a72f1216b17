"""OutputView at scale: a million lines in batches, exact line access, search both ways."""

from __future__ import annotations

import time

from textual.app import App, ComposeResult

from gpudeck.console.tui.widgets.output_view import OutputView


class ViewApp(App):
    def compose(self) -> ComposeResult:
        yield OutputView(id="v")


async def test_million_lines_stay_exact_and_searchable() -> None:
    app = ViewApp()
    async with app.run_test(size=(100, 30)) as pilot:
        view = app.query_one(OutputView)
        n, batch = 1_000_000, 20_000
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            view.append("".join(f"step {i} loss {1 / (i + 1):.6f}\n" for i in range(start, start + batch)))
        appended = time.perf_counter() - t0
        await pilot.pause()
        assert view.line_count == n
        assert view.line(0) == "step 0 loss 1.000000"
        assert view.line(n - 1).startswith(f"step {n - 1} ")
        assert view.follow and view.scroll_offset.y == view.max_scroll_y  # following shows the end
        t0 = time.perf_counter()
        assert view.find("step 123456 ", 0) == 123456
        assert view.find("step 10 loss", n, forward=False) == 10
        assert view.find("no such text", 0) is None
        searched = time.perf_counter() - t0
        print(f"\nappend {n} lines: {appended:.2f} s ({n / appended:,.0f} lines/s); 3 searches: {searched:.2f} s")
        # a partial line is completed by the next batch
        view.append("partial ")
        view.append("line\nnext")
        assert view.line(n) == "partial line" and view.line(n + 1) == "next" and view.line_count == n + 2
        view.go_to_line(500_000)
        await pilot.pause()
        assert view.follow is False and view.scroll_offset.y <= 500_000 < view.scroll_offset.y + view.size.height


async def test_search_wraps_around_and_draws_the_current_match_apart() -> None:
    from gpudeck.console.tui.widgets.output_view import CURRENT_STYLE, MATCH_STYLE

    app = ViewApp()
    async with app.run_test(size=(60, 10)) as pilot:
        view = app.query_one(OutputView)
        view.append("".join(f"line {i}{' target' if i in (3, 40) else ''}\n" for i in range(50)))
        view.search_term = "target"
        assert view.find_wrapping("target", 40) == (3, True)  # past the last match: from the top again
        assert view.find_wrapping("target", 3, forward=False) == (40, True)  # before the first: from the bottom
        assert view.find_wrapping("target", 0) == (3, False)
        assert view.find_wrapping("nowhere", 0) is None
        view.show_match(40)
        await pilot.pause()
        y = 40 - view.scroll_offset.y
        current = view.render_line(y)
        assert current.text.startswith("▌")
        assert any(seg.text == "target" and seg.style is not None and seg.style.bgcolor == CURRENT_STYLE.bgcolor for seg in current)
        view.show_match(3)
        await pilot.pause()
        other = view.render_line(3 - view.scroll_offset.y)
        assert other.text.startswith("▌")
        view.go_to_line(40)
        await pilot.pause()
        plain = view.render_line(40 - view.scroll_offset.y)  # a match, not the current one
        assert not plain.text.startswith("▌")
        assert any(seg.text == "target" and seg.style is not None and seg.style.bgcolor == MATCH_STYLE.bgcolor for seg in plain)
