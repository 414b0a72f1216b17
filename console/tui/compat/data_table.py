"""Provides FastDataTable: Textual's DataTable with the private parts gpudeck's live tables lean on, in one place.

Every reach into DataTable's private names (its row and cell tables, its render caches, four of its private
methods) is here, behind public methods that KeyedTable (console/tui/widgets/keyed_table.py) calls: replace the rows
shown in one go (:meth:`FastDataTable.replace_rows`), put the rows in a new order (:meth:`reorder_rows`), write a
fixed-width cell in place (:meth:`write_in_place`), and the faster cell and row renders. Each path checks that the
internals are there and falls back to DataTable's own public behaviour when they are not (a Textual whose internals
moved): slower, never wrong. README.md here lists every name; tests/unit/test_textual_compat.py fails when one moves.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.coordinate import Coordinate
from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import DataTable

try:  # DataTable's private helpers (Textual 8.2); without them the public paths are used
    from textual._two_way_dict import TwoWayDict
    from textual.widgets._data_table import Row, RowKey
except ImportError:  # pragma: no cover - a Textual that moved them
    TwoWayDict = Row = RowKey = None  # type: ignore[assignment,misc]


class FastDataTable(DataTable):
    """A DataTable whose rows can be replaced and reordered in one go and whose fixed-width cells are written in place.

    The public methods here are the whole of what a subclass needs; none of DataTable's private names is used
    outside this module."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._inner: dict[Any, dict[Any, tuple[object, int, list[Segment], dict[Any, list[Segment]]]]] = {}
        super().__init__(*args, **kwargs)
        # row key -> (its cells, DataTable's RowKey, row dict, Row, its y offset entry), kept between replace_rows
        self._packed: dict[str, tuple[list[object], Any, dict[Any, object], Any, tuple[Any, int]]] = {}
        self._full: tuple[list[Any], dict[Any, Any], dict[Any, Any], dict[Any, int], list[Any], list[Any]] | None = None
        self._stale: set[tuple[str, str]] = set()  # cells written in place whose renders must be dropped
        self._stale_lines: set[int] = set()
        self._pass: dict[Any, Style] | None = None  # styles read once per render_lines (DataTable reads them per line)

    # ------------------------------------------------------------------ rows

    def replace_rows(self, keys: list[str], cells_of: Callable[[str], list[object]], total: int) -> bool:
        """Show exactly ``keys`` (in this order, each row's cells from ``cells_of``) instead of the rows shown now;
        ``total``: how many rows the caller's model holds (every one shown: the tables are kept for the next time).
        False when DataTable's internals are not there: the caller clears and adds rows instead.

        DataTable's clear() walks every old row and add_row costs a reactive update and more per new row; here its
        tables are replaced in one go, with each row's RowKey, cells and Row kept between calls, and the row order
        DataTable would compute on the next paint given to it."""
        if TwoWayDict is None:
            return False
        try:
            columns = [c.key for c in self.ordered_columns]
            self._clear_caches()
        except AttributeError:
            return False
        packed = self._packed
        plist = []
        for key in keys:
            cells = cells_of(key)
            p = packed.get(key)
            if p is None or p[0] is not cells:  # new, or its cells changed since
                rk = RowKey(key)
                p = packed[key] = (cells, rk, dict(zip(columns, cells)), Row(rk, 1, None, False), (rk, 0))
            plist.append(p)
        full = self._full
        if full is not None and len(full[0]) == len(plist) and all(map(operator.is_, full[0], plist)):
            # every row again, none changed since (a filter erased): copies of the last full tables, no key hashed again
            _, data0, rows0, forward0, order0, offsets = full
            data, rows, forward = dict(data0), dict(rows0), dict(forward0)
        else:
            data = {p[1]: p[2] for p in plist}
            rows = {p[1]: p[3] for p in plist}
            forward = {p[1]: i for i, p in enumerate(plist)}
            order0 = list(rows.values())
            offsets = [p[4] for p in plist]  # kept: a filter allocates no object per row (a young collection would walk them)
            if len(plist) == total and len(plist) >= 1000:
                self._full = (plist, dict(data), dict(rows), dict(forward), order0, offsets)
        self._data = data
        self.rows = rows
        self._row_locations = TwoWayDict(forward)
        if any(column.auto_width for column in self.columns.values()):  # else nothing would measure them (_update_dimensions)
            self._new_rows.update(rows)
        self._require_update_dimensions = True
        self._update_count += 1
        self._ordered_row_cache[(len(rows), self._update_count)] = order0  # what ordered_rows would build
        self._offset_cache[self._update_count] = offsets  # and _y_offsets (every row 1 line high)
        self.cursor_coordinate = Coordinate(0, 0)  # as clear() leaves it (the caller puts it back on its row)
        self.scroll_x = self.scroll_y = self.scroll_target_x = self.scroll_target_y = 0
        self.check_idle()
        self.refresh()
        return True

    def reorder_rows(self, keys: list[str]) -> bool:
        """Put the rows shown in the order of ``keys`` (the same rows) without re-adding them; False when DataTable's
        internals are not there (the caller shows the rows again, in order)."""
        if TwoWayDict is None or not hasattr(self, "_row_locations") or not hasattr(self, "_update_count"):
            return False
        self._row_locations = TwoWayDict({RowKey(k): i for i, k in enumerate(keys)})
        self._update_count += 1
        self.refresh()
        return True

    def forget_row(self, key: str) -> None:
        """Drop what is kept of row ``key`` for replace_rows and the row render (the row is gone for good)."""
        self._packed.pop(key, None)
        self._inner.pop(key, None)
        self._full = None

    def forget_rows(self) -> None:
        """Drop what is kept of every row (the table is emptied)."""
        self._packed.clear()
        self._inner.clear()
        self._full = None

    def forget_stale(self) -> None:
        """Cells written in place need no targeted drop any more (every row is shown again)."""
        self._stale.clear()
        self._stale_lines.clear()

    def columns_changed(self) -> None:
        """A column's label or width changed: measure the table again on the next paint."""
        self._require_update_dimensions = True

    def _update_dimensions(self, new_rows: Iterable[Any]) -> None:
        # DataTable measures every cell of every new row (for auto-width columns and labels): 10,000 rows re-added
        # by a filter cost seconds. Here every column has a fixed width (fit) and rows have no labels and height 1,
        # so nothing a measure finds is used: only the virtual size is computed.
        if all(not column.auto_width for column in self.columns.values()):
            new_rows = ()
        super()._update_dimensions(new_rows)

    # DataTable.update_cell bumps one counter that is part of every render cache key, so one changed
    # cell re-renders every visible row (~40 rows x 7 cells, 50-100 ms on a loaded 2-core machine). For
    # fixed-width cells the table here writes the value in place, refreshes that row's region only, and
    # before the next paint drops exactly the cache entries of the cells that changed. This leans on
    # DataTable's private caches (Textual 8.2); if they are not there, update_cell is used instead.
    _targeted = True

    def write_in_place(self, key: str, column: str, value: object) -> None:
        """Write one fixed-width cell: in place, with only its row redrawn, where DataTable's internals allow; else
        through ``update_cell`` (which redraws every visible row)."""
        if not FastDataTable._targeted:
            self.update_cell(key, column, value)
            return
        try:
            self._data[key][column] = value  # type: ignore[index]  # RowKey/ColumnKey hash and compare as their str
            index = self._row_locations.get(key)  # type: ignore[arg-type]
        except (AttributeError, KeyError, TypeError):
            FastDataTable._targeted = False
            self.update_cell(key, column, value)
            return
        self._stale.add((key, column))
        if index is not None:
            self._stale_lines.add(index)
            self.refresh_row(index)

    def _drop_stale_renders(self) -> None:
        stale, lines = self._stale, self._stale_lines
        self._stale, self._stale_lines = set(), set()
        rows = {k for k, _ in stale}
        header = self.header_height if self.show_header else 0
        try:
            cells = self._cell_render_cache
            for k in [k for k in cells.keys() if (k[0].value, k[1].value) in stale]:
                cells.discard(k)
            row_renders = self._row_render_cache
            for rk in [rk for rk in row_renders.keys() if rk[0].value in rows]:
                row_renders.discard(rk)
            renderables = self._row_renderable_cache
            for lk in [lk for lk in renderables.keys() if lk[1] in lines]:
                renderables.discard(lk)
            line_cache = self._line_cache
            ys = {i + header for i in lines}
            for yk in [yk for yk in line_cache.keys() if yk[0] in ys]:
                line_cache.discard(yk)
        except AttributeError:
            FastDataTable._targeted = False
            self._update_count += 1  # the safe way: every cache misses once

    # DataTable renders every cell through Rich's generic pipeline (Styled(Padding(cell)) -> render_lines: measure,
    # wrap, split, crop, pad), about half a millisecond a cell: a filter that changes the rows shown re-renders the
    # ~40 x 11 cells on screen, 100-200 ms on a loaded 2-core machine. For the cells these tables hold (one line of
    # Text, no tab, no newline, no justify, no ellipsis) the same segments are built directly: the text's own
    # segments, cropped or padded to the column, the padding either side, the row's and the component's styles over
    # them (tests/unit/test_keyed_table_render.py checks they equal DataTable's, cell by cell). Anything else, or a
    # Textual whose internals moved, goes through DataTable's own.
    _fast_cells = True

    def _render_cell(
        self, row_index: int, column_index: int, base_style: Style, width: int, cursor: bool = False, hover: bool = False
    ) -> Any:
        if row_index < 0 or column_index < 0 or not FastDataTable._fast_cells:
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        try:
            row_key = self._row_locations.get_key(row_index)
            column_key = self._column_locations.get_key(column_index)
            key: Any = (
                row_key,
                column_key,
                base_style,
                cursor,
                hover,
                self._show_hover_cursor,
                self._update_count,
                self._pseudo_class_state,
            )
            cache: Any = self._cell_render_cache  # DataTable's, under DataTable's key: its cache and ours are one
            if key in cache:
                return cache[key]
            row = self.rows[row_key]  # type: ignore[index]
            cell = self._get_row_renderables(row_index)[1][column_index]
            line = (
                None
                if row.height != 1 or row_index < self.fixed_rows or column_index < self.fixed_columns
                else self._cell_segments(cell, width, self.cell_padding, keep_empty=True)
            )
            if line is None:
                return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
            component_style, post_style = self._cell_styles(hover, cursor, self.show_cursor)
        except (AttributeError, KeyError, TypeError, IndexError):
            FastDataTable._fast_cells = False
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        pre = base_style + Style.from_meta({"row": row_index, "column": column_index}) + component_style
        lines = [list(Segment.apply_style(line, style=pre, post_style=post_style))]
        cache[key] = lines
        return lines

    # A filter that changes the rows shown moves every row on screen to a new index, and DataTable renders each of
    # them again cell by cell (the cell's meta names its row index, and the zebra stripe follows it). Here a row's
    # line is put together from each cell's text segments, cropped and padded to the column, kept between renders
    # under the row and column (dropped when the cell or the width changes), with the row's style, the cursor's or
    # hover's, and the cell's meta put over them, as DataTable's _render_cell does. Rows with a label, fixed columns,
    # more than one line, or a cell that is not one line of Text go through DataTable's own (and _render_cell above).
    _fast_rows = True

    def _render_line_in_row(self, row_key: Any, line_no: int, base_style: Style, cursor_location: Any, hover_location: Any) -> Any:
        if not FastDataTable._fast_rows or line_no != 0 or self.cursor_type != "row":
            return super()._render_line_in_row(row_key, line_no, base_style, cursor_location, hover_location)
        try:
            cache_key = (
                row_key,
                line_no,
                base_style,
                cursor_location,
                hover_location,
                self.cursor_type,
                self.show_cursor,
                self._show_hover_cursor,
                self._update_count,
                self._pseudo_class_state,
            )
            cache: Any = self._row_render_cache  # DataTable's, under DataTable's key
            if cache_key in cache:
                return cache[cache_key]
            row_index = self._row_locations.get(row_key)
            if (
                row_index is None
                or row_index < self.fixed_rows
                or self.fixed_columns
                or (self._labelled_row_exists and self.show_row_labels)
                or self.rows[row_key].height != 1
            ):
                return super()._render_line_in_row(row_key, line_no, base_style, cursor_location, hover_location)
            data = self._data[row_key]
            columns = self.ordered_columns
            pad = self.cell_padding
            show_cursor = self.show_cursor
            cursor = cursor_location.row == row_index
            hover = hover_location.row == row_index
            component_style, post_style = self._cell_styles(hover, cursor, show_cursor)
            extend_style, _ = self._get_styles_to_render_cell(
                False, False, False, hover, cursor, show_cursor, self._show_hover_cursor, False, False
            )
            row_style = self._get_row_style(row_index, base_style)
            widths = [column.get_render_width(self) for column in columns]
            inner = self._inner.setdefault(row_key, {})
            cells = []
            for column, width in zip(columns, widths):
                cell = data.get(column.key)
                kept = inner.get(column.key)
                if kept is None or kept[0] is not cell or kept[1] != width:
                    segments = self._cell_segments(cell, width, pad)
                    if segments is None:
                        return super()._render_line_in_row(row_key, line_no, base_style, cursor_location, hover_location)
                    kept = inner[column.key] = (cell, width, segments, {})
                cells.append(kept)
        except (AttributeError, KeyError, TypeError, IndexError):
            FastDataTable._fast_rows = False
            return super()._render_line_in_row(row_key, line_no, base_style, cursor_location, hover_location)
        # The cell's meta comes last: it adds no colour, so the order changes nothing. A cell's segments with the row's
        # styles over them are kept with the cell, per style (zebra, cursor, hover: a few), merged where their styles
        # are one (as the line's Strip.simplify would merge them), so only the meta is added per render; they go with
        # the cell when it changes (a live table's updates leave nothing behind).
        row = row_style + component_style
        styled_key = (row, post_style)
        scrollable: list[list[Segment]] = []
        for column_index, (_cell, _width, segments, variants) in enumerate(cells):
            styled = variants.get(styled_key)
            if styled is None:
                if len(variants) >= 8:  # a theme change makes new styles: the old ones go
                    variants.clear()
                styled = variants[styled_key] = list(Segment.simplify(Segment.apply_style(segments, style=row, post_style=post_style)))
            meta = Style.from_meta({"row": row_index, "column": column_index})
            scrollable.append([Segment(t, s + meta if s else meta) for t, s, _c in styled])
        remaining = max(0, self.size.width - sum(widths) - self._row_label_column_width)
        extend = row_style + extend_style + Style.from_meta({"row": row_index, "column": 0, "out_of_bounds": True})
        scrollable.append([Segment(" " * remaining, extend)])
        pair: tuple[list[list[Segment]], list[list[Segment]]] = ([], scrollable)
        cache[cache_key] = pair
        return pair

    def _cell_styles(self, hover: bool, cursor: bool, show_cursor: bool) -> tuple[Style, Style]:
        """A body cell's component and post styles (DataTable's, for a cell neither header, label nor fixed)."""
        return self._get_styles_to_render_cell(
            False,
            False,
            False,
            hover,
            cursor,
            show_cursor,
            self._show_hover_cursor,
            self.cursor_foreground_priority == "css",
            self.cursor_background_priority == "css",
        )

    def _cell_segments(self, cell: object, width: int, pad: int, keep_empty: bool = False) -> list[Segment] | None:
        """A one-line Text (or str) cell's own segments cropped or padded to ``width`` with ``pad`` either side (None: not
        such a cell); ``keep_empty``: with its empty segments, as DataTable's cell render has them (a line drops them)."""
        if isinstance(cell, str):  # escaped by literal(): DataTable's formatter makes it Text the same way
            cell = Text.from_markup(cell, end="")
        if (
            not isinstance(cell, Text)
            or cell.justify not in (None, "default")
            or cell.overflow not in (None, "fold", "crop")
            or "\n" in cell.plain
            or "\t" in cell.plain
            or width - 2 * pad < 1
        ):
            return None
        console = self.app.console
        null = Style.null()
        segments = cell.render(console, end="")
        if cell.style:
            segments = Segment.apply_style(segments, style=console.get_style(cell.style, default=null))
        line = [s for s in Segment.adjust_line_length(list(segments), width - 2 * pad, style=null) if s.text or keep_empty]
        return [Segment(" " * pad, null), *line, Segment(" " * pad, null)] if pad else line

    def notify_style_update(self) -> None:
        if self.__dict__.get("_inner"):  # (DataTable's __init__ may get here before ours has run)
            self._inner.clear()
        super().notify_style_update()

    def render_lines(self, crop: Region) -> list[Strip]:
        if self._stale:
            self._drop_stale_renders()
        self._pass = {}
        try:
            return super().render_lines(crop)
        finally:
            self._pass = None

    def render_line(self, y: int) -> Strip:
        styles = self._pass
        if styles is None or self.fixed_rows or not FastDataTable._fast_rows:
            return super().render_line(y)
        base = styles.get("base")
        if base is None:
            base = styles["base"] = self.rich_style
        scroll_x, scroll_y = self.scroll_offset
        if y >= (self.header_height if self.show_header else 0):
            y += scroll_y
        return self._render_line(y, scroll_x, scroll_x + self.size.width, base)

    def _get_row_style(self, row_index: int, base_style: Style) -> Style:
        styles = self._pass
        if styles is None or row_index < max(0, self.fixed_rows) or not self.zebra_stripes:
            return super()._get_row_style(row_index, base_style)
        parity = row_index % 2
        style = styles.get(parity)
        if style is None:
            style = styles[parity] = super()._get_row_style(row_index, base_style)
        return style
