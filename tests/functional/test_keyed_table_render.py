"""KeyedTable's own cell render (console/tui/compat/data_table.py, ``_render_cell``) gives exactly DataTable's segments.

The fast path builds a one-line cell's segments directly instead of through Rich's generic pipeline (a filter that
changes the rows re-renders every cell on screen). Each cell of a table with plain, styled, multi-span, wide,
cropped, markup-looking and empty cells is rendered both ways, on the cursor row, a hovered row and zebra rows.
"""

from __future__ import annotations

from typing import Any

from rich.segment import Segment
from rich.text import Text
from textual.app import App, ComposeResult
from textual.coordinate import Coordinate
from textual.widgets import DataTable

from gpudeck.console.tui.compat.data_table import FastDataTable
from gpudeck.console.tui.widgets.keyed_table import Col, KeyedTable

COLS = [Col("a", "A", 6), Col("b", "B", 12), Col("c", "C", 4), Col("d", "D", 20)]


def rows() -> dict[str, dict[str, object]]:
    styled = Text("fail", style="bold red")
    spans = Text("12,345 ")
    spans.append("▁▂▃▅▇", style="cyan")
    return {
        "r1": {"a": "plain", "b": "a [b]markup[/b] look", "c": "", "d": styled},
        "r2": {"a": "toolongforthecolumn", "b": spans, "c": "宽字符", "d": "ends in a wide 字"},
        "r3": {"a": Text("x", style="on blue"), "b": "-", "c": "1", "d": Text.assemble(("ok", "green"), " then ", ("no", "red"))},
        "r4": {"a": "é", "b": "tab\tin it", "c": "two\nlines", "d": "x" * 40},
    }


class TableApp(App[None]):
    def compose(self) -> ComposeResult:
        yield KeyedTable(COLS, id="t", markable=True)


async def filled(app: TableApp, pilot: Any) -> KeyedTable:
    """The table of ``rows()``, r2 marked."""
    table = app.query_one(KeyedTable)
    table.sync(rows())
    table.set_marked("r2", True)
    await pilot.pause()
    return table


async def test_the_fast_cell_render_gives_datatables_segments() -> None:
    app = TableApp()
    async with app.run_test(size=(80, 12)) as pilot:
        table = await filled(app, pilot)
        table.cursor_coordinate = Coordinate(1, 0)
        table.hover_coordinate = Coordinate(2, 0)
        await pilot.pause()
        assert FastDataTable._fast_cells
        checked = 0
        for row_index in range(table.row_count):
            base = table._get_row_style(row_index, table.rich_style)
            for column_index, column in enumerate(table.ordered_columns):
                for cursor, hover in ((False, False), (True, False), (False, True)):
                    table._clear_caches()
                    mine = table._render_cell(row_index, column_index, base, column.get_render_width(table), cursor, hover)
                    table._clear_caches()
                    theirs = DataTable._render_cell(table, row_index, column_index, base, column.get_render_width(table), cursor, hover)
                    assert mine == theirs, (
                        row_index,
                        column.key,
                        cursor,
                        hover,
                        [[(s.text, str(s.style)) for s in ln] for ln in mine],
                        [[(s.text, str(s.style)) for s in ln] for ln in theirs],
                    )
                    checked += 1
        assert checked == 4 * 5 * 3


async def test_upsert_many_and_the_filter_show_what_upsert_one_by_one_shows() -> None:
    """The bulk add (a large history's first read) and the filter's one-pass re-add give the rows, order, cursor and
    count that the row-by-row path gives, and a row that changed while no filter was in force is found by its new text."""
    many = {f"k{i:04d}": {"a": f"n{i % 7}", "b": f"x{i}", "c": "", "d": "new" if i % 3 else "old"} for i in range(300)}

    class Two(App[None]):
        def compose(self) -> ComposeResult:
            yield KeyedTable(COLS, id="one", order=lambda c: str(c.get("d")), order_columns=("d",))
            yield KeyedTable(COLS, id="bulk", order=lambda c: str(c.get("d")), order_columns=("d",))

    app = Two()
    async with app.run_test(size=(80, 30)) as pilot:
        one, bulk = app.query_one("#one", KeyedTable), app.query_one("#bulk", KeyedTable)
        for k, cells in many.items():
            one.upsert(k, cells)
        one.apply_order()
        bulk.upsert_many(many)
        await pilot.pause()
        assert bulk.keys() == one.keys() and bulk.row_count == 300 and bulk.keys()[0] == "k0001"  # "new" sorts first
        for table in (one, bulk):
            table.upsert("k0003", {**many["k0003"], "b": "renamed"})  # no filter in force
            table.set_filter("n3 renamed")
        await pilot.pause()
        assert bulk.keys() == one.keys() == ["k0003"] and "1 of 300 rows match" in bulk.describe()
        for table in (one, bulk):
            table.set_filter("n3")
        await pilot.pause()
        assert bulk.keys() == one.keys() and len(bulk.keys()) == len([c for c in many.values() if c["a"] == "n3"])
        for table in (one, bulk):
            table.set_filter("")
        await pilot.pause()
        assert bulk.keys() == one.keys() and bulk.row_count == 300 and bulk.cursor_key is not None


async def test_the_footer_is_rebuilt_once_for_bindings_that_change_together() -> None:
    """Textual's Footer remounts every key on each bindings signal; DeckFooter once for signals before its rebuild."""
    from textual.binding import Binding

    from gpudeck.console.tui.widgets.footer import DeckFooter

    class FooterApp(App[None]):
        BINDINGS = [Binding("x", "bell", "Ring")]

        def compose(self) -> ComposeResult:
            yield DeckFooter()

    app = FooterApp()
    async with app.run_test(size=(80, 5)) as pilot:
        footer = app.query_one(DeckFooter)
        await pilot.pause()
        before = footer.rebuilds
        for _ in range(5):
            app.screen.refresh_bindings()
        await pilot.pause()
        await pilot.pause()
        assert footer.rebuilds == before + 1
        assert "Ring" in str(app.export_screenshot())


async def test_the_fast_row_render_gives_datatables_lines_and_survives_a_filter() -> None:
    """KeyedTable's row path (``_render_line_in_row``: cell segments kept per row and column, the row's styles and
    each cell's meta put over them) gives DataTable's own lines, on the cursor row, a hovered row and zebra rows, and
    again after a filter moved every row to a new index (the kept segments carry no index: the meta is put on anew)."""
    from textual.strip import Strip

    app = TableApp()
    async with app.run_test(size=(80, 12)) as pilot:
        table = await filled(app, pilot)

        def lines() -> list[list[tuple[str, object]]]:
            table._clear_caches()
            table._pseudo_class_state = table.get_pseudo_class_state()
            out = []
            for y in range(table.header_height + table.row_count):
                strip: Strip = table._render_line(y, 0, table.size.width, table.rich_style)
                out.append([(s.text, s.style) for s in Segment.simplify(list(strip))])
            return out

        def both() -> tuple[list[list[tuple[str, object]]], list[list[tuple[str, object]]]]:
            mine = lines()
            FastDataTable._fast_rows = FastDataTable._fast_cells = False
            try:
                theirs = lines()
            finally:
                FastDataTable._fast_rows = FastDataTable._fast_cells = True
            return mine, theirs

        checked = 0
        for cursor, hover in ((1, 2), (0, 3), (3, 0)):
            table.cursor_coordinate = Coordinate(cursor, 0)
            table.hover_coordinate = Coordinate(hover, 0)
            await pilot.pause()
            mine, theirs = both()
            for a, b in zip(mine, theirs):
                assert a == b, (cursor, hover, [(t, str(s)) for t, s in a], [(t, str(s)) for t, s in b])
            assert any("row" in (style.meta if style else {}) for _t, style in mine[1])  # the click target is there
            checked += 1
        table.set_filter("x")  # r4 ("x" * 40) and r3 ("x"): both move up
        await pilot.pause()
        assert table.row_count == 2
        mine, theirs = both()
        assert mine == theirs
        metas = {style.meta.get("row") for line in mine[1:] for _t, style in line if style and style.meta}
        assert metas == {0, 1}
        assert FastDataTable._fast_rows and checked == 3
