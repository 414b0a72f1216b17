"""Provides SteadyText: a few lines of text that a screen sets many times a second, laid out again only when its size may change.

A Static's ``update`` asks for a layout of the whole screen every time, since the new text may need another size. The
Fleet's summary changes with every delivery of hosts (4-8 a second at 1,024 hosts), the Runs note with every
delivery of runs, a filter's count with every key; each asked for a layout of its screen (bench/RESULTS.md 39-filter
and 40-steady). SteadyText asks only when the text may need another size:

- with ``width: auto`` (a filter's count) it keeps the widest width it has shown, so a narrower text repaints its
  row and nothing around it moves; a wider one lays out once;
- otherwise (a screen-wide summary) it lays out when the number of lines changes, or when a line is too long for
  the width it has (it may wrap to another line count).

Text is shown as it is (a str is never read as markup) with control characters escaped (cells.shown).
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.style import Style
from rich.text import Span, Text
from textual.widget import Widget

from gpudeck.console.tui.widgets.cells import shown


def _widest(text: Text) -> int:
    return max((cell_len(line) for line in text.plain.split("\n")), default=0)


def _look(text: Text) -> tuple[str, list[Span], str | Style]:
    return (text.plain, text.spans, text.style)  # Text's own == leaves its style out


class SteadyText(Widget):
    """A label set with :meth:`show`; see the module's note."""

    DEFAULT_CSS = "SteadyText { height: auto; }"

    def __init__(self, content: str | Text = "", *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._text = content if isinstance(content, Text) else Text(content)
        self._width = _widest(self._text)  # the widest shown (width: auto)

    @property
    def text(self) -> Text:
        """What it shows (not to be changed in place: give :meth:`show` a new one)."""
        return self._text

    def _auto_width(self) -> bool:
        width = self.styles.width
        return width is not None and width.is_auto

    def show(self, content: str | Text) -> None:
        """Show ``content`` instead: a repaint of this widget, and a layout of the screen only if its size may change."""
        text = content if isinstance(content, Text) else Text(content)
        if _look(text) == _look(self._text):
            return
        old, self._text = self._text, text
        widest = _widest(text)
        if self._auto_width():
            layout = widest > self._width
            self._width = max(widest, self._width)
        else:
            room = self.content_size.width
            layout = room <= 0 or old.plain.count("\n") != text.plain.count("\n") or widest > room or _widest(old) > room
        self.refresh(layout=layout)

    def render(self) -> Text:
        text = shown(self._text)
        if self._auto_width() and "\n" not in text.plain and cell_len(text.plain) < self._width:
            text = text.copy()
            text.pad_right(self._width - cell_len(text.plain))
        return text
