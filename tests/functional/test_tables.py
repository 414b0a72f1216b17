"""Every table filters with '/' and sorts on a header click or '>' (one implementation, in KeyedTable); the Runs
list acts on its highlighted run (stop, tail, relaunch) through the Run screen's flows."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.text import Text
from textual.widgets import Input, Static

from gpudeck.console.ops.context import Ops
from gpudeck.console.ops.readings import history_run_count
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ConfirmDialog, ResultDialog
from gpudeck.console.tui.screens.history import HistoryScreen
from gpudeck.console.tui.screens.launch import LaunchDialog
from gpudeck.console.tui.screens.leftovers import LeftoversScreen
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import Col, FilterBar, KeyedTable, fit, sort_key
from gpudeck.console.tui.widgets.steady import SteadyText
from tests.functional.fixture_fleet import FAILED, GOOD, LIVE, STOPPED, FixtureFleet
from tests.functional.helpers import mounted, open_host, press_for, text_of, until

SIZE = (180, 50)


@pytest.fixture
def fleet(tmp_path: Path) -> FixtureFleet:
    return FixtureFleet(tmp_path / "history.db")


def bar_of(table: KeyedTable) -> FilterBar:
    return next(b for b in table.screen.query(FilterBar) if b.table is table)


async def type_filter(pilot, table: KeyedTable, text: str) -> FilterBar:  # type: ignore[no-untyped-def]
    table.focus()
    await pilot.press("slash")
    bar = await until(
        lambda: [b for b in table.screen.query(FilterBar) if b.table is table and b.query_one(Input).has_focus], what="the filter bar"
    )
    await pilot.press(*text)
    return bar[0]


def _asked(widget: SteadyText) -> list[bool]:
    """The ``layout`` of every refresh ``widget`` asks for from now on."""
    asked: list[bool] = []
    plain = widget.refresh

    def refresh(*regions, layout=False, **kw):  # type: ignore[no-untyped-def]
        asked.append(layout)
        return plain(*regions, layout=layout, **kw)

    widget.refresh = refresh  # type: ignore[method-assign]
    return asked


async def test_the_filter_count_lays_the_screen_out_again_only_when_it_grows() -> None:
    """A filter key changes the count; a Static's update asked for a layout of the whole screen each time."""
    from textual.app import App, ComposeResult

    class One(App[None]):
        CSS = "SteadyText { width: auto; }"  # as the filter bar's count

        def compose(self) -> ComposeResult:
            yield SteadyText()

    async with One().run_test() as pilot:
        count = pilot.app.query_one(SteadyText)
        asked = _asked(count)
        count.show("412 of 4097 rows match")
        count.show("41 of 4097 rows match")  # narrower: the widest width is kept, nothing laid out
        count.show("7 of 4097 rows match")
        count.show("7 of 4097 rows match")  # the same: nothing at all
        count.show("4097 of 4097 rows match  ·  sorted by STATE ▲")  # wider: one layout
        assert asked == [True, False, False, True]
        assert text_of(count) == "4097 of 4097 rows match  ·  sorted by STATE ▲"
        count.show("[bold]1[/] of 4097 rows match")  # shown as it is, never as markup
        assert text_of(count).rstrip() == "[bold]1[/] of 4097 rows match"
        assert len(text_of(count)) == len("4097 of 4097 rows match  ·  sorted by STATE ▲")
        await pilot.pause()


async def test_a_screen_wide_steady_text_lays_out_only_when_its_line_count_may_change() -> None:
    """The Fleet's summary and the Runs note change with every delivery; a layout each time cost a screen reflow."""
    from textual.app import App, ComposeResult

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield SteadyText("Fleet")

    async with One().run_test(size=(60, 10)) as pilot:
        note = pilot.app.query_one(SteadyText)
        await pilot.pause()
        asked = _asked(note)
        note.show("Fleet: 4 host(s)  4 up")
        note.show(Text("Fleet: 4 host(s)  3 up", style="bold"))  # same size, new look: a repaint
        note.show(Text("Fleet: 4 host(s)  3 up", style="bold"))  # the same look: nothing
        note.show(Text("Fleet: 4 host(s)  3 up", style="red"))  # only the style differs: a repaint (Text's == ignores it)
        note.show("Fleet: 4 host(s)\nnotifications failing: 1")  # a second line: a layout
        note.show("x" * 100)  # wider than the 58 columns it has: may wrap, a layout
        note.show("y" * 100)  # still too wide: a layout again (the wrap decides its height)
        note.show("short")  # back from a wrapped one: a layout
        assert asked == [False, False, False, True, True, True, True]
        assert text_of(note) == "short"
        note.show("bell\x07 and [red]markup[/]")
        # no control character reaches the screen; markup is shown as it is
        assert "\x07" not in text_of(note) and text_of(note).endswith(" and [red]markup[/]")
        await pilot.pause()


async def test_fleet_filters_on_slash_shows_the_count_and_escape_brings_every_row_back(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet-table", KeyedTable)
        everyone = table.keys()
        assert len(everyone) == 6
        bar = await type_filter(pilot, table, "unreach")
        await until(lambda: table.keys() == ["gpu2"], what="only the unreachable host")
        assert "1 of 6 rows match" in text_of(bar.query_one(SteadyText))
        await pilot.press("enter")  # back to the table; the filter stays in force and on show
        assert table.has_focus and table.keys() == ["gpu2"] and bar.display
        await pilot.press("escape")  # clears it
        await until(lambda: table.keys() == everyone, what="every host again")
        assert not table.filter_text and not bar.display
        await pilot.press("escape")  # nothing to clear: the screen's escape (the Fleet is the first screen: it stays)
        assert table.keys() == everyone


async def test_a_filtered_out_row_keeps_its_updates_and_a_new_row_that_does_not_match_stays_hidden() -> None:
    from textual.app import App, ComposeResult

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield KeyedTable([Col("name", "NAME", 10), Col("n", "N", 4)])

    async with One().run_test() as pilot:
        table = pilot.app.query_one(KeyedTable)
        table.upsert("a", {"name": "alpha", "n": "1"})
        table.upsert("b", {"name": "beta", "n": "2"})
        table.set_filter("alp")
        assert table.keys() == ["a"] and table.total_rows == 2
        table.upsert("b", {"name": "beta", "n": "9"})  # hidden: updated in the model only
        table.upsert("c", {"name": "gamma", "n": "3"})  # new, not matching
        table.upsert("a", {"name": "zeta", "n": "1"})  # no longer matches: leaves the view
        await pilot.pause()
        assert table.keys() == []
        table.set_filter("")
        await pilot.pause()
        assert table.keys() == ["a", "b", "c"] and str(table.get_cell("b", "n")) == "9"


async def test_fleet_sorts_on_a_header_click_and_on_the_sort_key_and_shows_it(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet-table", KeyedTable)
        await pilot.click("#fleet-table", offset=(3, 0))  # the HOST header
        await pilot.pause()
        assert table.sort_column == "host" and not table.sort_reverse
        assert table.keys() == sorted(table.keys())
        assert "▲" in str(table.columns[table.cols[0].key].label)  # type: ignore[index]
        await pilot.click("#fleet-table", offset=(3, 0))  # again: the other way round
        await pilot.pause()
        assert table.sort_reverse and table.keys() == sorted(table.keys(), reverse=True)
        assert "sorted by HOST ▼" in table.describe()
        table.focus()
        await pilot.press("greater_than_sign")  # the next column
        await pilot.pause()
        assert table.sort_column == "state" and "sorted by STATE" in table.describe()
        assert "▲" not in str(table.columns["host"].label) and "▼" not in str(table.columns["host"].label)  # type: ignore[index]


async def test_host_processes_and_leftovers_filter_too(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        host = await open_host(app)
        procs = host.query_one("#proc-table", KeyedTable)
        await until(lambda: procs.row_count >= 3, what="the processes")
        await type_filter(pilot, procs, "4412")
        await until(lambda: procs.keys() and all("4412" in k for k in procs.keys()), what="pid 4412's rows only")
        await pilot.press("escape")
        await until(lambda: len(procs.keys()) >= 3, what="every process again")
        screen = await press_for(pilot, "L", LeftoversScreen)
        table = screen.query_one("#leftovers-table", KeyedTable)
        await until(lambda: table.row_count > 1, what="the leftovers")
        n = table.row_count
        await type_filter(pilot, table, "foreign")
        await until(lambda: 0 < table.row_count < n, what="the foreign leftovers only")
        await pilot.press("escape", "escape")  # clear, then back to the host
        await until(lambda: mounted(app, type(host)), what="the host screen again")


async def test_history_sorts_by_a_column_and_its_query_box_keeps_slash(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        hist = await press_for(pilot, "h", HistoryScreen)
        table = hist.query_one("#history-table", KeyedTable)
        await until(lambda: table.row_count >= 3, what="the history")
        assert table.keys()[0].endswith(LIVE)  # newest first
        table.focus()
        await pilot.press("greater_than_sign")  # RUN
        await pilot.pause()
        ids = [k.split("/", 1)[1] for k in table.keys()]
        assert ids == sorted(ids)
        assert "sorted by RUN ▲" in text_of(hist.query_one("#history-note", Static))
        await pilot.press("slash")
        await until(lambda: hist.query_one("#history-filter", Input).has_focus, what="the history's query box")


async def test_runs_lists_live_runs_first_then_the_newest_with_the_cursor_on_the_first(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        runs = await press_for(pilot, "r", RunsScreen)
        table = runs.query_one("#runs-table", KeyedTable)
        await until(lambda: GOOD in table.keys(), what="the history's runs")
        await pilot.pause()
        keys = table.keys()
        assert keys[0] == LIVE and keys.index(FAILED) < keys.index(STOPPED) < keys.index(GOOD)
        assert table.cursor_key == LIVE
        await type_filter(pilot, table, "drafter")
        await until(lambda: table.keys() == [FAILED], what="the filtered run")
        assert "1 of" in text_of(runs.query_one("#runs-note", SteadyText))


async def test_runs_stop_from_the_list_lists_the_processes_and_stops_through_the_run_screens_flow(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        runs = await press_for(pilot, "r", RunsScreen)
        table = runs.query_one("#runs-table", KeyedTable)
        await until(lambda: table.cursor_key == LIVE, what="the live run highlighted")
        dialog = await press_for(pilot, "s", ConfirmDialog)
        body = text_of(dialog.query_one("#confirm-body", Static))
        assert f"Stop run {LIVE} on gpu1" in body
        assert "PID" in body and "USER" in body and "RANK" in body and "COMMAND" in body and "4412" in body
        result = await press_for(pilot, "y", ResultDialog)
        assert "4412" in text_of(result.query_one("#result-body", Static))
        await pilot.press("escape")
        await until(lambda: mounted(app, RunsScreen), what="the Runs screen again")


def test_stop_confirmation_names_the_user_of_every_member_not_only_those_on_a_gpu() -> None:
    """The USER column read only the GPU processes: a member holding no GPU memory (a CPU worker, a run on simulated
    GPUs) showed '-'. The snapshot's process rows name every live member's user."""
    import msgspec

    from gpudeck.agents.wire.protocol import Member, ProcInfo
    from gpudeck.console.tui.screens.run import stop_confirm_text
    from tests.functional.fixture_fleet import fixture_snapshot

    snap = fixture_snapshot()
    run = snap.runs[0]
    run = msgspec.structs.replace(
        run,
        members=[
            Member(pid=4400, create_time=1.0, role="shim"),
            *run.members,  # 4412: on GPU 0, user ada
            Member(pid=4413, create_time=2.0, role="worker", rank=1, cmdline=["python", "worker.py"]),
        ],
    )
    snap = msgspec.structs.replace(snap, processes=[ProcInfo(pid=4413, user="grace", create_time=2.0, run_id=run.id)])
    lines = stop_confirm_text(run, "gpu1", snap).plain.splitlines()
    row = {ln.split()[0]: ln.split()[1] for ln in lines if ln.strip()[:4].isdigit()}
    assert row == {"4412": "ada", "4413": "grace"}  # the shim is not listed; no member reads '-'


async def test_runs_tail_and_relaunch_from_the_list(fleet: FixtureFleet) -> None:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        runs = await press_for(pilot, "r", RunsScreen)
        table = runs.query_one("#runs-table", KeyedTable)
        await until(lambda: table.cursor_key == LIVE, what="the live run highlighted")
        run = await press_for(pilot, "t", RunScreen)
        assert run.run_id == LIVE and run.query_one("#run-log").follow
        await pilot.press("escape")
        await until(lambda: mounted(app, RunsScreen), what="the Runs screen again")
        table.move_cursor_to_key(FAILED)
        dialog = await press_for(pilot, "R", LaunchDialog)
        assert dialog._parent_run == FAILED  # the form is filled from the highlighted run (ops.relaunch_intent)


def test_sort_keys_order_numbers_as_numbers_and_blanks_last() -> None:
    cells = ["10", "9", "-", "1,200", "abc"]
    assert sorted(cells, key=sort_key) == ["9", "10", "1,200", "abc", "-"]


def test_fit_folds_the_least_important_columns_first() -> None:
    cols = [Col("a", "A", 40), Col("b", "B", 30, fold=1), Col("c", "C", 20, fold=2), Col("d", "D", None)]
    assert [c.key for c in fit(cols, 200)] == ["a", "b", "c", "d"]
    assert [c.key for c in fit(cols, 110)] == ["a", "b", "d"]
    assert [c.key for c in fit(cols, 80)] == ["a", "d"]


async def test_runs_says_on_screen_when_the_history_holds_more_than_it_lists(fleet: FixtureFleet, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Runs screen reads the newest HISTORY_LIMIT runs (100,000); past that it says how many the history holds
    and where the older ones are, instead of silently listing a part (here the limit is made 2)."""
    from gpudeck.console.tui.screens import runs as runs_module

    assert fleet.history is not None
    total = history_run_count(fleet.history.path)
    assert total > 2
    monkeypatch.setattr(runs_module, "HISTORY_LIMIT", 2)
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        runs = await press_for(pilot, "r", RunsScreen)
        note = runs.query_one("#runs-note", SteadyText)
        table = runs.query_one("#runs-table", KeyedTable)
        await until(lambda: f"the history holds {total:,} runs: the newest " in text_of(note), what="the note")
        shown = table.total_rows  # the 2 read, and any live run the snapshots add
        assert 2 <= shown < total and f"the newest {shown:,} are listed here" in text_of(note)
        assert "until:DATE" in text_of(note)


async def test_the_fleets_shared_cells_are_the_same_after_the_screen_drew_them(fleet: FixtureFleet) -> None:
    """cells.py's ``memo`` hands the same Text to every row with the same look, and to the next second's rebuild: the
    table must draw them (and the cursor's and the filter's styles over them) without changing them."""
    from gpudeck.console.tui.screens.fleet import host_cells

    cells = {name: host_cells(link.status)[0] for name, link in fleet.links.items()}
    shared = {id(c): c for row in cells.values() for c in row.values() if isinstance(c, Text)}
    assert len(shared) >= 10  # names, states, bars, alerts of the fixture's hosts
    before = {k: (c.plain, list(c.spans), c.style, c.no_wrap, c.overflow, c.end) for k, c in shared.items()}
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=(180, 50)) as pilot:
        await pilot.pause(0.5)
        await pilot.press("down", "down", "slash", "g")  # the cursor's and the filter's styles over them
        await pilot.pause(0.3)
    after = {k: (c.plain, list(c.spans), c.style, c.no_wrap, c.overflow, c.end) for k, c in shared.items()}
    assert after == before
    again = {name: host_cells(link.status)[0] for name, link in fleet.links.items()}
    for name, row in cells.items():  # a rebuild hands the same objects back
        for key, cell in row.items():
            if isinstance(cell, Text):
                assert again[name][key] is cell, (name, key)
