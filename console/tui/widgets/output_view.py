"""Provides OutputView: a run's output that stays responsive at millions of lines.

The approach is toolong's: the text goes to a spool file, the widget keeps only
the byte offset where each line starts, and it reads the few lines the
viewport shows when it draws them. Appends arrive in batches (the Run screen
flushes a few times a second), so a run writing 50,000 lines a second costs
one write and one newline scan per batch, not a widget per line.
"""

from __future__ import annotations

import re
import tempfile
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from gpudeck.console.core.sanitize import escape_controls

CACHE_LINES = 4096
_NEWLINE = re.compile(b"\n")
SEARCH_CHUNK = 4 << 20
MATCH_STYLE = Style(bgcolor="yellow", color="black", bold=True)
CURRENT_STYLE = Style(bgcolor="magenta", color="white", bold=True, underline=True)  # the match n/N moved to
CURRENT_GUTTER = Style(color="magenta", bold=True)


def match_spans(text: str, term: str | None, lo: int, hi: int) -> list[tuple[int, int]]:
    """Where ``term`` occurs in ``text`` (case-insensitive), clipped to the columns ``lo``..``hi`` and relative to ``lo``:
    a match cut by the window's edge is drawn as a match for the part that shows."""
    if not term:
        return []
    lower, t = text.lower(), term.lower()
    spans = []
    hit = lower.find(t, max(0, lo - len(t) + 1))
    while 0 <= hit < hi:
        start, end = max(hit, lo), min(hit + len(t), hi)
        if end > start:
            spans.append((start - lo, end - lo))
        hit = lower.find(t, hit + len(t))
    return spans


class OutputView(ScrollView, can_focus=True):
    """Append-only text view over a spool file with a line-offset index."""

    DEFAULT_CSS = """
    OutputView {
        background: $surface;
    }
    """

    follow: reactive[bool] = reactive(True)

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self._spool = tempfile.TemporaryFile(prefix="gpudeck-output-")
        self._nbytes = 0
        self._starts = array("Q", [0])  # byte offset where each line starts; the last one is the open line
        self._max_width = 0
        self._cache: OrderedDict[int, str] = OrderedDict()
        self._io = threading.Lock()  # search reads the spool from a worker thread while appends write it
        self.search_term: str | None = None
        self.current_match: int | None = None  # the line of the match the search is on (drawn apart from the others)
        self.bytes_received = 0

    # ------------------------------------------------------------------ data

    @property
    def line_count(self) -> int:
        """Lines held, counting an unterminated last line."""
        n = len(self._starts)
        return n - 1 if self._starts[-1] == self._nbytes else n

    def append(self, data: str) -> None:
        """Add text (any number of lines, the last possibly partial)."""
        if not data:
            return
        raw = data.encode("utf-8", "replace")
        with self._io:
            self._spool.seek(0, 2)
            self._spool.write(raw)
        base = self._nbytes
        open_line = len(self._starts) - 1
        self._cache.pop(open_line, None)  # the open line grows
        starts = self._starts
        # the scans run in C (re, split): a batch of 70,000 lines costs tens of ms, not a Python loop per line
        widths = [len(part) for part in raw.split(b"\n")]
        widths[0] += base - starts[-1]  # the first part continues the open line
        starts.extend(base + m.end() for m in _NEWLINE.finditer(raw))
        self._max_width = max(self._max_width, max(widths))  # bytes approximate the width; good enough for scrolling
        self._nbytes += len(raw)
        self.bytes_received += len(raw)
        self.virtual_size = Size(min(self._max_width, 4096), self.line_count)
        if self.follow:
            # force: the scrollbar that allows scrolling appears only at the next layout
            self.scroll_to(y=self.line_count, animate=False, immediate=True, force=True)
        self.refresh()

    def line(self, index: int) -> str:
        """The text of line ``index`` (read from the spool, cached)."""
        cached = self._cache.get(index)
        if cached is not None:
            self._cache.move_to_end(index)
            return cached
        if index < 0 or index >= self.line_count:
            return ""
        start = self._starts[index]
        end = self._starts[index + 1] - 1 if index + 1 < len(self._starts) else self._nbytes
        with self._io:
            self._spool.seek(start)
            raw = self._spool.read(max(0, end - start))
        # the run's bytes: an escape sequence would reach the operator's terminal, so controls show as escapes
        text = escape_controls(raw.decode("utf-8", "replace").rstrip("\r").expandtabs(8))
        self._cache[index] = text
        if len(self._cache) > CACHE_LINES:
            self._cache.popitem(last=False)
        return text

    def line_at_offset(self, offset: int) -> int:
        """The index of the line holding byte ``offset``."""
        return max(0, bisect_right(self._starts, offset) - 1)

    def find(self, term: str, from_line: int, forward: bool = True) -> int | None:
        """The next (or previous) line containing ``term`` (case-insensitive), scanning the spool."""
        needle = term.lower().encode("utf-8")
        if not needle:
            return None
        if forward:
            pos = self._starts[min(from_line + 1, len(self._starts) - 1)] if from_line + 1 < len(self._starts) else self._nbytes
            while pos < self._nbytes:
                with self._io:
                    self._spool.seek(pos)
                    chunk = self._spool.read(SEARCH_CHUNK + len(needle)).lower()
                hit = chunk.find(needle)
                if hit >= 0:
                    return self.line_at_offset(pos + hit)
                pos += SEARCH_CHUNK
            return None
        end = self._starts[from_line] if 0 <= from_line < len(self._starts) else self._nbytes
        while end > 0:
            start = max(0, end - SEARCH_CHUNK)
            with self._io:
                self._spool.seek(start)
                chunk = self._spool.read(end - start + len(needle)).lower()
            hit = chunk.rfind(needle, 0, end - start + len(needle) - 1)
            if hit >= 0 and start + hit < end:
                return self.line_at_offset(start + hit)
            end = start
        return None

    # force, immediate: a scroll is dropped while the vertical scrollbar the new lines need is not laid out yet
    # (allow_vertical_scroll is False until the next layout), and a search right after reads scroll_offset
    def go_top(self) -> None:
        """To the first line, reading (not following)."""
        self.follow = False
        self.scroll_to(x=0, y=0, animate=False, immediate=True, force=True)

    def go_bottom(self) -> None:
        """To the last line, following from now on."""
        self.follow = True
        self.scroll_to(y=self.line_count, animate=False, immediate=True, force=True)

    def find_wrapping(self, term: str, from_line: int, forward: bool = True) -> tuple[int, bool] | None:
        """Like :meth:`find`, going on from the other end when nothing is left that way: (line, whether it wrapped)."""
        found = self.find(term, from_line, forward)
        if found is not None:
            return found, False
        found = self.find(term, -1 if forward else self.line_count, forward)
        return (found, True) if found is not None else None

    def show_match(self, index: int) -> None:
        """Make line ``index`` the current match and scroll to it."""
        self.current_match = index
        self.go_to_line(index)
        self.refresh()

    def go_to_line(self, index: int) -> None:
        """Scroll so line ``index`` is in view (and stop following)."""
        self.follow = False
        self.scroll_to(y=max(0, index - self.size.height // 2), animate=False, immediate=True, force=True)

    def on_unmount(self) -> None:
        self._spool.close()

    # ------------------------------------------------------------------ drawing

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        index = scroll_y + y
        width = self.size.width
        base = self.rich_style
        if index >= self.line_count:
            return Strip.blank(width, base)
        text = self.line(index)
        current = self.search_term is not None and index == self.current_match
        # a bar in the first column of the current match (found at a glance, even scrolled sideways); it takes a column
        # of its own, so the line's text starts after it, whole
        gutter = 1 if current else 0
        visible = text[scroll_x : scroll_x + max(0, width - gutter)]
        segments: list[Segment] = [Segment("▌", base + CURRENT_GUTTER)] if current else []
        hit_style = CURRENT_STYLE if current else MATCH_STYLE
        pos = 0
        for start, end in match_spans(text, self.search_term, scroll_x, scroll_x + len(visible)):
            if start > pos:
                segments.append(Segment(visible[pos:start], base))
            segments.append(Segment(visible[start:end], base + hit_style))
            pos = end
        if pos < len(visible):
            segments.append(Segment(visible[pos:], base))
        pad = width - gutter - len(visible)
        if pad > 0:
            segments.append(Segment(" " * pad, base))
        return Strip(segments, width)

    def watch_scroll_y(self, old: float, new: float) -> None:
        # scrolling up by hand stops following; reaching the bottom again resumes it
        super().watch_scroll_y(old, new)
        if new < old:
            self.follow = False
        elif new >= self.max_scroll_y:
            self.follow = True
