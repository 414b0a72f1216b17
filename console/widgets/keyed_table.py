"""Provides KeyedTable: a DataTable kept in step with a keyed model, writing only the cells that changed.

dolphie's rule for live tables: rows have keys, stale rows are removed, new
rows are added, and an existing row gets ``update_cell`` only for the cells
whose value changed — the table is never cleared, so the cursor, the scroll
position and the marks survive every refresh, and a refresh of 256 hosts where
three changed costs three rows. Columns given a width never re-measure (a
shrinking auto-width cell makes DataTable re-measure its whole column).

Rows scrolled out of view are not redrawn: their new cells wait (``_deferred``)
and are written when the row scrolls into view, so a refresh costs the rows
the operator can see — on a 256-host fleet, the 40 on screen.

Rows can be *marked* (multi-select): the first column shows ✓ for marked rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import DataTable

from gpudeck.console.widgets.cells import MARK, literal

MARK_COLUMN = "_mark"


@dataclass(frozen=True)
class Col:
    """A column: its key, its heading, and a fixed width (None: as wide as its widest cell)."""

    key: str
    label: str
    width: int | None = None


def fit(columns: Sequence[Col], width: int, *, markable: bool = False, least: int = 24) -> list[Col]:
    """The columns with every auto-width one given a fixed share of what ``width`` leaves (at least ``least``).

    A live table with hundreds of rows must not have auto-width columns: each cell that shrinks makes
    DataTable re-measure its whole column, which is O(rows) per cell and O(rows²) per refresh.
    """
    auto = [c for c in columns if c.width is None]
    if not auto:
        return list(columns)
    used = sum(c.width or 0 for c in columns) + 2 * len(columns) + (3 if markable else 0) + 2  # cell padding, mark, scrollbar
    share = max(least, (width - used) // len(auto))
    return [Col(c.key, c.label, share) if c.width is None else c for c in columns]


class KeyedTable(DataTable):
    """A DataTable updated by row key (never cleared), with optional row marks."""

    def __init__(
        self,
        columns: Sequence[Col],
        *,
        markable: bool = False,
        id: str | None = None,
        classes: str | None = None,
        zebra_stripes: bool = True,
    ) -> None:
        super().__init__(id=id, classes=classes, cursor_type="row", zebra_stripes=zebra_stripes)
        self.cols = list(columns)
        self.markable = markable
        self.marks: set[str] = set()
        self._cells: dict[str, dict[str, object]] = {}
        self._deferred: dict[str, dict[str, object]] = {}  # newer cells of rows out of view
        self._stale: set[tuple[str, str]] = set()  # cells written in place whose renders must be dropped
        self._stale_lines: set[int] = set()
        self._fixed = {c.key for c in self.cols if c.width is not None}
        self.cells_written = 0  # how many cells the table was asked to redraw (tests keep updates O(changed))
        if markable:
            self.add_column(" ", key=MARK_COLUMN, width=1)
        for c in self.cols:
            self.add_column(c.label, key=c.key, width=c.width)

    # ------------------------------------------------------------------ model

    def upsert(self, key: str, cells: Mapping[str, object]) -> int:
        """Show ``cells`` in row ``key`` (added when new); returns the number of cells written."""
        old = self._cells.get(key)
        if old is None:
            row: list[object] = [Text(MARK if key in self.marks else "", style="bold green")] if self.markable else []
            row.extend(literal(cells.get(c.key, "")) for c in self.cols)
            self.add_row(*row, key=key)
            self._cells[key] = dict(cells)
            self.cells_written += len(row)
            return len(row)
        if not self._in_view(key):
            self._deferred[key] = dict(cells)
            return 0
        self._deferred.pop(key, None)
        return self._write(key, old, cells)

    def _write(self, key: str, old: dict[str, object], cells: Mapping[str, object]) -> int:
        n = 0
        for c in self.cols:
            v = cells.get(c.key, "")
            if old.get(c.key) != v:
                if c.key in self._fixed and self._targeted:
                    self._set_in_place(key, c.key, literal(v))
                else:
                    self.update_cell(key, c.key, literal(v), update_width=c.key not in self._fixed)
                old[c.key] = v
                n += 1
        self.cells_written += n
        return n

    # DataTable.update_cell bumps one counter that is part of every render cache key, so one changed
    # cell re-renders every visible row (~40 rows x 7 cells, 50-100 ms on a loaded 2-core machine). For
    # fixed-width cells the table here writes the value in place, refreshes that row's region only, and
    # before the next paint drops exactly the cache entries of the cells that changed. This leans on
    # DataTable's private caches (Textual 8.2); if they are not there, update_cell is used instead.
    _targeted = True

    def _set_in_place(self, key: str, column: str, value: object) -> None:
        try:
            self._data[key][column] = value  # type: ignore[index]  # RowKey/ColumnKey hash and compare as their str
            index = self._row_locations.get(key)  # type: ignore[arg-type]
        except (AttributeError, KeyError, TypeError):
            KeyedTable._targeted = False
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
            KeyedTable._targeted = False
            self._update_count += 1  # the safe way: every cache misses once

    def render_lines(self, crop: Region) -> list[Strip]:
        if self._stale:
            self._drop_stale_renders()
        return super().render_lines(crop)

    def _in_view(self, key: str) -> bool:
        """Whether row ``key`` is on screen (or near it): rows have height 1 in these tables."""
        if not self.is_mounted or self.size.height == 0:
            return True
        try:
            index = self.get_row_index(key)
        except Exception:
            return True
        top = int(self.scroll_y)
        return top - 2 <= index <= top + self.size.height + 2

    def flush_deferred(self) -> int:
        """Write the waiting cells of rows that are now in view; returns cells written."""
        n = 0
        for key in [k for k in self._deferred if self._in_view(k)]:
            cells = self._deferred.pop(key)
            old = self._cells.get(key)
            if old is not None:
                n += self._write(key, old, cells)
        return n

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        if self._deferred:
            self.call_later(self.flush_deferred)

    def on_resize(self) -> None:
        if self._deferred:
            self.call_later(self.flush_deferred)

    def drop(self, key: str) -> None:
        """Remove row ``key`` if it is there."""
        if key in self._cells:
            del self._cells[key]
            self._deferred.pop(key, None)
            self.marks.discard(key)
            self.remove_row(key)

    def sync(self, rows: Mapping[str, Mapping[str, object]], *, remove_missing: bool = True) -> int:
        """Make the table show exactly ``rows`` (or at least them, without ``remove_missing``); returns cells written."""
        if remove_missing:
            for stale in [k for k in self._cells if k not in rows]:
                self.drop(stale)
        return sum(self.upsert(k, cells) for k, cells in rows.items())

    def reset(self) -> None:
        """Remove every row (for static tables that are rebuilt, such as a diff; never for a live one)."""
        self._cells.clear()
        self._deferred.clear()
        self.marks.clear()
        self.clear()

    def keys(self) -> list[str]:
        """Row keys in display order."""
        return [str(r.key.value) for r in self.ordered_rows]

    def cells_of(self, key: str) -> dict[str, object] | None:
        """The newest cells of row ``key`` (including those waiting for it to scroll into view)."""
        if key in self._deferred:
            return {**self._cells.get(key, {}), **self._deferred[key]}
        return self._cells.get(key)

    @property
    def cursor_key(self) -> str | None:
        """The key of the highlighted row (None in an empty table)."""
        if self.row_count == 0:
            return None
        try:
            return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)
        except Exception:
            return None

    def move_cursor_to_key(self, key: str) -> None:
        """Highlight row ``key`` if it is there."""
        if key in self._cells:
            self.move_cursor(row=self.get_row_index(key), animate=False)

    # ------------------------------------------------------------------ marks

    def set_marked(self, key: str, on: bool) -> None:
        """Mark or unmark one row."""
        if not self.markable or key not in self._cells:
            return
        if on:
            self.marks.add(key)
        else:
            self.marks.discard(key)
        self.update_cell(key, MARK_COLUMN, Text(MARK if on else "", style="bold green"))

    def toggle_mark(self, key: str | None = None) -> None:
        """Flip the mark of ``key`` (the highlighted row by default)."""
        key = key or self.cursor_key
        if key is not None:
            self.set_marked(key, key not in self.marks)

    def toggle_mark_and_advance(self) -> None:
        """Flip the highlighted row's mark and move to the next row (space down a list marks it)."""
        self.toggle_mark()
        if self.cursor_row < self.row_count - 1:
            self.move_cursor(row=self.cursor_row + 1)

    def mark_all(self, keys: Iterable[str]) -> None:
        """Mark these rows (and only these)."""
        want = set(keys)
        for k in list(self.marks - want):
            self.set_marked(k, False)
        for k in want:
            self.set_marked(k, True)

    def sort_by(self, column: str, reverse: bool = False) -> None:
        """Sort by a column (its cells' ``sort_value`` where they have one, else their text), keeping the highlighted row."""
        for key in list(self._deferred):  # sorting moves rows into view: write what they wait for first
            self._write(key, self._cells[key], self._deferred.pop(key))
        cur = self.cursor_key
        self.sort(column, key=lambda v: getattr(v, "sort_value", None) or str(v), reverse=reverse)
        if cur is not None:
            self.move_cursor_to_key(cur)
