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

Every table filters and sorts the same way (one implementation, for every screen): ``/`` opens a filter bar
above the table (case-insensitive text over every cell; ``esc`` clears it), a click on a column header or
``>`` / ``<`` sorts (again on the same column: the other way round), and the header of the sorted column and
the filter bar say what is in force. Rows the filter hides stay in the model and keep receiving updates, so
clearing the filter shows them as they are now.

A table given ``fold_from`` fits its columns to the terminal again on every resize (``fit``: the least important
fold first), keeping its rows, marks, filter, sort and highlighted row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widget import Widget
from textual.widgets import DataTable, Input, Static

from gpudeck.console.tui.compat.data_table import FastDataTable
from gpudeck.console.tui.widgets.cells import MARK, literal
from gpudeck.console.tui.widgets.steady import SteadyText

MARK_COLUMN = "_mark"


@dataclass(frozen=True)
class Col:
    """A column: its key, its heading, and a fixed width (None: as wide as its widest cell)."""

    key: str
    label: str
    width: int | None = None
    fold: int = 0  # 0: always shown; on a narrow terminal columns fold (are left out) highest ``fold`` first


def _used(columns: Sequence[Col], markable: bool) -> int:
    return sum(c.width or 0 for c in columns) + 2 * len(columns) + (3 if markable else 0) + 2  # cell padding, mark, scrollbar


def fit(columns: Sequence[Col], width: int, *, markable: bool = False, least: int = 24) -> list[Col]:
    """The columns that fit ``width``, with every auto-width one given a fixed share of what is left (at least ``least``).

    Columns with a ``fold`` are left out, the highest first, until the fixed ones and ``least`` per auto-width
    one fit (at 100 columns the least important go; at 200 every one is there). A live table with hundreds of
    rows must not have auto-width columns: each cell that shrinks makes DataTable re-measure its whole column,
    which is O(rows) per cell and O(rows²) per refresh.
    """
    cols = list(columns)
    for level in sorted({c.fold for c in cols if c.fold}, reverse=True):
        auto_n = sum(1 for c in cols if c.width is None)
        if _used(cols, markable) + least * auto_n <= width:
            break
        cols = [c for c in cols if c.fold != level]
    auto = [c for c in cols if c.width is None]
    if not auto:
        return cols
    share = max(least, (width - _used(cols, markable)) // len(auto))
    return [Col(c.key, c.label, share, c.fold) if c.width is None else c for c in cols]


def cell_text(value: object) -> str:
    """A cell's text as the filter reads it."""
    return value.plain if isinstance(value, Text) else str(value)


def sort_key(value: object) -> tuple[int, Any]:
    """How a cell orders: its ``sort_value`` where it has one, else its number, else its text; '-' and blanks last."""
    v = getattr(value, "sort_value", None)
    if v is not None:
        return (0, v)
    text = cell_text(value).strip()
    if text in ("", "-"):
        return (2, "")
    try:
        return (0, float(text.replace(",", "")))
    except ValueError:
        return (1, text.lower())


class FilterBar(Horizontal):
    """The bar above a table while it is filtered: the filter text, how many rows match, the sort in force."""

    DEFAULT_CSS = """
    FilterBar { height: 1; display: none; }
    FilterBar.-shown { display: block; }
    FilterBar > .filter-label { width: auto; padding: 0 1 0 0; color: $accent; text-style: bold; }
    FilterBar > Input { border: none; height: 1; width: 1fr; padding: 0; background: $boost; }
    FilterBar > .filter-count { width: auto; padding: 0 0 0 1; color: $text-muted; }
    """
    BINDINGS = [Binding("escape", "clear", "Clear filter", show=False), Binding("down", "to_table", show=False)]

    def __init__(self, table: KeyedTable) -> None:
        super().__init__(id=f"{table.id}-filter" if table.id else None)
        self.table = table

    def compose(self) -> ComposeResult:
        yield Static("filter /", classes="filter-label")
        # compact: no border, one row, focused or not (a focused Input's border left its one row no room: the text was invisible)
        yield Input(placeholder="text in any column (enter: back to the table, esc: clear)", compact=True)
        yield SteadyText(classes="filter-count")  # a count that changes with every key lays nothing else out

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        event.stop()
        self.table.set_filter(event.value)

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_to_table()

    def action_to_table(self) -> None:
        self.table.focus()
        self.set_class(bool(self.table.filter_text), "-shown")
        if not self.table.filter_text:
            self.table.filter_closed()

    def action_clear(self) -> None:
        self.table.action_clear_filter()

    def show_count(self, text: str) -> None:
        """Say how many rows match."""
        self.query_one(SteadyText).show(text)


class KeyedTable(FastDataTable):
    """A DataTable updated by row key (never cleared by a refresh), with optional row marks, a filter and a sort."""

    BINDINGS = [
        Binding("slash", "filter", "Filter", key_display="/", tooltip="show only rows with this text (esc clears)"),
        Binding("greater_than_sign", "sort_next", "Sort", key_display=">", tooltip="sort by the next column (< the previous)"),
        Binding("less_than_sign", "sort_prev", "Sort back", key_display="<", show=False),
        Binding("exclamation_mark", "sort_invert", "Invert sort", key_display="!", show=False),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    # while the filter bar is open, a changed row's filter text is made when the row is updated (in the screen's
    # sliced delivery) rather than by the next key: 1,024 hosts all change every second, so the first key typed found
    # every row's text stale and made 1,024 of them (issue 33). False: made by the key, as before.
    EAGER_HAY = True
    HAY_WARM_SLICE = 256  # rows whose filter text is made per turn of the event loop when the bar opens

    class Reordered(Message):
        """The filter or the sort changed (the screen may say so)."""

        def __init__(self, table: KeyedTable) -> None:
            super().__init__()
            self.table = table

    def __init__(
        self,
        columns: Sequence[Col],
        *,
        markable: bool = False,
        id: str | None = None,
        classes: str | None = None,
        zebra_stripes: bool = True,
        filterable: bool = True,
        order: Callable[[Mapping[str, object]], Any] | None = None,
        order_columns: Iterable[str] = (),
        fold_from: Sequence[Col] | None = None,
        least: int = 24,
    ) -> None:
        """``order``: the table's own order when no column is chosen (by default: the order rows came in), reading
        the cells of ``order_columns``. ``fold_from``: every column ``columns`` were fitted from (``fit``, with
        ``least``); the table fits them again to the terminal's width whenever it is resized."""
        super().__init__(id=id, classes=classes, cursor_type="row", zebra_stripes=zebra_stripes)
        self.cols = list(columns)
        self.fold_from = list(fold_from) if fold_from is not None else None
        self.least = least
        self.markable = markable
        self.filterable = filterable
        self.marks: set[str] = set()
        self.filter_text = ""
        self.sort_column: str | None = None
        self.sort_reverse = False
        self.order = order
        self._order_columns = frozenset(order_columns)
        self._seq: dict[str, int] = {}
        self._counter = itertools.count()
        self._shown: set[str] = set()  # rows in the DataTable (the rest are filtered out)
        self._hay: dict[str, str] = {}  # row key -> its cells' text, lower case (the filter reads it)
        self._hay_eager = False  # the filter bar is open: a changed row's text is made at once (EAGER_HAY)
        self._order_due = False
        self.pin_top = False  # a cursor on the first row stays on the first row when the order changes
        self._cells: dict[str, dict[str, object]] = {}
        self._literals: dict[str, list[object]] = {}  # row key -> its cells escaped for the DataTable (re-adds reuse them)
        self._order_keys: dict[str, tuple[Any, int]] = {}  # row key -> its place in the table's own order (kept until it changes)
        self._order_all: list[str] | None = None  # every row key (shown or not) in the order in force; None: to be sorted again
        self._deferred: dict[str, dict[str, object]] = {}  # newer cells of rows out of view
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
            self._cells[key] = dict(cells)
            self._seq[key] = next(self._counter)
            self._order_all = None
            if not self._matches(key):
                return 0
            n = self._add(key)
            if self.sort_column is not None or self.order is not None:
                self._order_later()
            return n
        newest = self.cells_of(key) or old
        if self.sort_column is not None and newest.get(self.sort_column) != cells.get(self.sort_column):
            self._order_later()
        if self.order is not None and any(newest.get(c) != cells.get(c) for c in self._order_columns):
            self._order_keys.pop(key, None)
            self._order_all = None
            if self.sort_column is None:
                self._order_later()
        if any(newest.get(c.key) != cells.get(c.key) for c in self.cols):
            if self._hay_eager and not self.filter_text:  # with a filter in force the upsert below makes it
                self._hay[key] = self._hay_of(cells)
            else:
                self._hay.pop(key, None)  # with or without a filter in force: the next filter reads its new text
        if key not in self._shown:
            self._cells[key] = dict(cells)
            self._literals.pop(key, None)
            self._hay.pop(key, None)
            if self.filter_text and self._matches(key):
                self._order_later()
                return self._add(key)
            return 0
        if self.filter_text and not self._matches(key, cells):
            self._cells[key] = dict(cells)
            self._literals.pop(key, None)
            self._deferred.pop(key, None)
            self._shown.discard(key)
            self.remove_row(key)
            return 0
        if not self._in_view(key):
            self._deferred[key] = dict(cells)
            return 0
        self._deferred.pop(key, None)
        return self._write(key, old, cells)

    def _row_cells(self, key: str) -> list[object]:
        """Row ``key``'s cells as the DataTable holds them (escaped once, kept until the row changes)."""
        row = self._literals.get(key)
        if row is None:
            cells = self._cells[key]
            row = [Text(MARK if key in self.marks else "", style="bold green")] if self.markable else []
            row.extend(literal(cells.get(c.key, "")) for c in self.cols)
            self._literals[key] = row
        return row

    def _add(self, key: str) -> int:
        row = self._row_cells(key)
        self.add_row(*row, key=key)
        self._shown.add(key)
        self.cells_written += len(row)
        return len(row)

    def _add_many(self, keys: list[str]) -> None:
        """Show exactly ``keys`` (in this order) instead of the rows shown now, at once (a filter shows thousands again):
        FastDataTable's replace_rows, or clear() and add_row where it cannot."""
        if not self.replace_rows(keys, lambda key: self._literals.get(key) or self._row_cells(key), total=len(self._cells)):
            self.clear()
            self._shown.clear()
            for key in keys:
                self._add(key)
            return
        self._shown = set(keys)
        self.cells_written += len(keys) * len(self.ordered_columns)

    def _write(self, key: str, old: dict[str, object], cells: Mapping[str, object]) -> int:
        self._literals.pop(key, None)
        n = 0
        for c in self.cols:
            v = cells.get(c.key, "")
            if old.get(c.key) != v:
                if c.key in self._fixed:
                    self.write_in_place(key, c.key, literal(v))
                else:
                    self.update_cell(key, c.key, literal(v), update_width=c.key not in self._fixed)
                old[c.key] = v
                n += 1
        self.cells_written += n
        return n

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
        if self.fold_from is not None and self.is_mounted:
            self.refit(self.app.size.width)
        if self._deferred:
            self.call_later(self.flush_deferred)

    def refit(self, width: int) -> bool:
        """Fit ``fold_from`` to ``width`` again (columns fold or come back); True when the columns changed."""
        if self.fold_from is None:
            return False
        cols = fit(self.fold_from, width, markable=self.markable, least=self.least)
        if [(c.key, c.width) for c in cols] == [(c.key, c.width) for c in self.cols]:
            return False
        self.set_columns(cols)
        return True

    def set_columns(self, columns: Sequence[Col]) -> None:
        """Show ``columns`` instead of the columns shown now, every row kept (its cells, marks, the filter, the sort and
        the highlighted row): the rows are shown again in one go."""
        cur = self.cursor_key
        for key, cells in list(self._deferred.items()):
            self._cells[key] = {**self._cells.get(key, {}), **cells}
        self._deferred.clear()
        self.cols = list(columns)
        self._fixed = {c.key for c in self.cols if c.width is not None}
        self._literals.clear()
        self._hay.clear()  # the filter reads the columns shown
        self.forget_rows()
        self.forget_stale()
        self.clear(columns=True)
        self._shown.clear()
        if self.markable:
            self.add_column(" ", key=MARK_COLUMN, width=1)
        for c in self.cols:
            self.add_column(self._heading(c), key=c.key, width=c.width)
        self._order_all = None
        self._add_many(self._matching(self.filter_text))
        if cur is not None and cur in self._shown:
            self.call_after_refresh(self.move_cursor_to_key, cur)
        self._say()

    def drop(self, key: str) -> None:
        """Remove row ``key`` if it is there."""
        if key in self._cells:
            del self._cells[key]
            self._deferred.pop(key, None)
            self._hay.pop(key, None)
            self._literals.pop(key, None)
            self.forget_row(key)
            self._order_keys.pop(key, None)
            self._order_all = None
            self._seq.pop(key, None)
            self.marks.discard(key)
            if key in self._shown:
                self._shown.discard(key)
                self.remove_row(key)

    def upsert_many(self, rows: Mapping[str, Mapping[str, object]]) -> None:
        """``upsert`` for each of ``rows``, the new ones shown in one go (thousands of rows added one by one cost
        seconds: DataTable's add_row is a reactive update each)."""
        new = [k for k in rows if k not in self._cells]
        if len(new) < 100:
            for k, cells in rows.items():
                self.upsert(k, cells)
            return
        fresh = set(new)
        for k in new:
            self._cells[k] = dict(rows[k])
            self._seq[k] = next(self._counter)
        self._order_all = None
        for k, cells in rows.items():
            if k not in fresh:
                self.upsert(k, cells)
        for k in new:  # the filter's text of each new row, now: the first key press would otherwise make them all
            self._haystack(k)
        self._rebuild(self._matching(self.filter_text), ordered=True)
        self._say()

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
        self._shown.clear()
        self._hay.clear()
        self._literals.clear()
        self._order_keys.clear()
        self.forget_rows()
        self._order_all = None
        self._seq.clear()
        self.marks.clear()
        self.clear()

    @property
    def total_rows(self) -> int:
        """Rows in the model, the filtered-out ones included."""
        return len(self._cells)

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
        """Highlight row ``key`` if it is shown."""
        if key in self._shown:
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
        self._literals.pop(key, None)
        if key in self._shown:
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

    # ------------------------------------------------------------------ filter and sort

    def _hay_of(self, cells: Mapping[str, object]) -> str:
        return " ".join(cell_text(cells.get(c.key, "")) for c in self.cols).lower()

    def _haystack(self, key: str) -> str:
        hay = self._hay.get(key)
        if hay is None:
            hay = self._hay[key] = self._hay_of(self.cells_of(key) or {})
        return hay

    def _warm_hay(self) -> None:
        """Make the filter text of up to HAY_WARM_SLICE rows that have none, then queue the rest (the bar is open)."""
        if not self._hay_eager:
            return
        missing = [k for k in self._cells if k not in self._hay][: self.HAY_WARM_SLICE]
        for k in missing:
            self._haystack(k)
        if len(missing) == self.HAY_WARM_SLICE:
            self.call_later(self._warm_hay)

    def _matches(self, key: str, cells: Mapping[str, object] | None = None) -> bool:
        if not self.filter_text:
            return True
        if cells is not None:
            hay = " ".join(cell_text(cells.get(c.key, "")) for c in self.cols).lower()
            self._hay[key] = hay
        else:
            hay = self._hay.get(key) or ""
            if not hay:
                newest = self.cells_of(key) or {}
                hay = self._hay[key] = " ".join(cell_text(newest.get(c.key, "")) for c in self.cols).lower()
        return all(word in hay for word in self.filter_text.lower().split())

    def _ordered(self, keys: Iterable[str]) -> list[str]:
        if self.sort_column is not None:
            col = self.sort_column
            cells = self._cells
            deferred = self._deferred

            def by_column(k: str) -> tuple[tuple[int, Any], int]:
                row = deferred.get(k) or cells[k]
                return (sort_key(row.get(col, "")), self._seq.get(k, 0))

            ordered = sorted(keys, key=by_column, reverse=self.sort_reverse)
            if self.sort_reverse:  # blanks stay last either way
                blank = [k for k in ordered if by_column(k)[0][0] == 2]
                ordered = [k for k in ordered if by_column(k)[0][0] != 2] + blank[::-1]
            return ordered
        if self.order is not None:
            order, cache, seq = self.order, self._order_keys, self._seq

            def natural(k: str) -> tuple[Any, int]:
                v = cache.get(k)
                if v is None:
                    v = cache[k] = (order(self.cells_of(k) or {}), seq.get(k, 0))
                return v

            return sorted(keys, key=natural)
        return sorted(keys, key=lambda k: self._seq.get(k, 0))

    def _order_later(self) -> None:
        self._order_all = None
        if not self._order_due:
            self._order_due = True
            self.call_later(self.apply_order)

    def apply_order(self) -> None:
        """Put the shown rows in the order in force (the sort, else the table's own order), keeping the highlighted row."""
        self._order_due = False
        for key in list(self._deferred):  # ordering moves rows into view: write what they wait for first
            if key in self._shown:
                self._write(key, self._cells[key], self._deferred.pop(key))
        cur = None if self.pin_top and self.cursor_row == 0 else self.cursor_key
        order = self._ordered(self._shown)
        if not self.reorder_rows(order):  # DataTable's internals moved: show the rows again, in order
            self._rebuild(order)
        if cur is not None:
            self.move_cursor_to_key(cur)
        elif self.pin_top and self.row_count:
            self.move_cursor(row=0, animate=False)

    def set_filter(self, text: str) -> None:
        """Show only the rows whose text has every word of ``text`` (case-insensitive); '' shows every row.

        One pass over every row's lower-case text, kept between key presses, in the order in force (sorted once until
        a row or the order changes): no sort and no per-row call on a key press."""
        text = text.strip()
        if text == self.filter_text:
            return
        self.filter_text = text
        want = self._matching(text)
        if len(want) != len(self._shown) or not self._shown.issuperset(want):  # the same rows: nothing to redraw
            self._rebuild(want, ordered=True)
        self._say()

    def _matching(self, text: str) -> list[str]:
        """The keys of the rows with every word of ``text``, in the order in force."""
        if self._order_all is None:
            self._order_all = self._ordered(self._cells.keys())
        want = self._order_all
        hay = self._hay
        for k in [k for k in want if k not in hay]:
            self._haystack(k)
        for word in text.lower().split():
            want = [k for k in want if word in hay[k]]
        return want

    def _rebuild(self, keys: Iterable[str], ordered: bool = False) -> None:
        """Show exactly ``keys`` in the order in force (already in it when ``ordered``): a filter change, one pass, not
        O(n²) removes."""
        cur = self.cursor_key
        for key, cells in list(self._deferred.items()):
            self._cells[key] = {**self._cells.get(key, {}), **cells}
            self._literals.pop(key, None)
            self._hay.pop(key, None)
        self._deferred.clear()
        self.forget_stale()
        self._add_many(list(keys) if ordered else self._ordered(keys))
        if cur is not None and cur in self._shown:
            self.call_after_refresh(self.move_cursor_to_key, cur)

    async def action_filter(self) -> None:
        bar = await self.filter_bar()
        bar.add_class("-shown")
        bar.query_one(Input).focus()
        if self.EAGER_HAY and not self._hay_eager:
            self._hay_eager = True
            self.call_after_refresh(self._warm_hay)  # after the bar is on screen

    async def filter_bar(self) -> FilterBar:
        """The filter bar above this table (mounted the first time it is asked for)."""
        bars = [b for b in self.screen.query(FilterBar) if b.table is self]
        if bars:
            return bars[0]
        bar = FilterBar(self)
        parent = self.parent
        assert isinstance(parent, Widget)  # a table always sits in a screen or a container
        await parent.mount(bar, before=self)
        bar.show_count(self.describe())
        return bar

    def action_clear_filter(self) -> None:
        bars = [b for b in self.screen.query(FilterBar) if b.table is self]
        for bar in bars:
            bar.query_one(Input).value = ""
            bar.remove_class("-shown")
        self.filter_closed()
        self.set_filter("")
        self.focus()

    def filter_closed(self) -> None:
        """The filter bar is gone: a changed row's filter text waits for the next filter again."""
        self._hay_eager = False

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "filter":
            return self.filterable
        if action == "clear_filter":  # esc with no filter in force: the screen's (back)
            return bool(self.filter_text) or any(b.has_class("-shown") for b in self.screen.query(FilterBar) if b.table is self)
        return super().check_action(action, parameters)

    def sort_by(self, column: str | None, reverse: bool = False) -> None:
        """Sort by a column (None: the table's own order), keeping the highlighted row; the header shows it."""
        self.sort_column, self.sort_reverse = column, reverse
        for c in self.cols:
            try:
                self.columns[c.key].label = self._heading(c)  # type: ignore[index]
            except KeyError:
                pass
        self.columns_changed()
        self.apply_order()
        self._say()

    def _heading(self, c: Col) -> Text:
        """A column's heading, with ▲ / ▼ when the table is sorted by it."""
        mark = "" if c.key != self.sort_column else (" ▼" if self.sort_reverse else " ▲")
        return Text(c.label + mark, style="bold" if mark else "")

    def _cycle(self, step: int) -> None:
        keys = [None, *(c.key for c in self.cols)]
        i = keys.index(self.sort_column) if self.sort_column in keys else 0
        self.sort_by(keys[(i + step) % len(keys)], self.sort_reverse)

    def action_sort_next(self) -> None:
        self._cycle(1)

    def action_sort_prev(self) -> None:
        self._cycle(-1)

    def action_sort_invert(self) -> None:
        if self.sort_column is not None:
            self.sort_by(self.sort_column, not self.sort_reverse)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        column = str(event.column_key.value)
        if column == MARK_COLUMN:
            return
        if column == self.sort_column:
            self.sort_by(column, not self.sort_reverse)
        else:
            self.sort_by(column)

    def describe(self) -> str:
        """What is in force: 'sorted by STATE ▼', '12 of 256 rows match'."""
        parts = []
        if self.filter_text:
            parts.append(f"{len(self._shown)} of {len(self._cells)} rows match")
        if self.sort_column is not None:
            label = next((c.label for c in self.cols if c.key == self.sort_column), self.sort_column)
            parts.append(f"sorted by {label} {'▼' if self.sort_reverse else '▲'}")
        return "  ·  ".join(parts)

    def _say(self) -> None:
        if self.is_mounted:
            for bar in self.screen.query(FilterBar):
                if bar.table is self:
                    bar.show_count(self.describe())
            self.post_message(self.Reordered(self))
