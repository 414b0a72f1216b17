"""Provides ProgressLine: one line that says what a long operation is doing and for how long, or how it ended."""

from __future__ import annotations

import time

from rich.text import Text
from textual.timer import Timer
from textual.widgets import Static

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class ProgressLine(Static):
    """A spinner, a label and the elapsed seconds while something runs; the outcome afterwards."""

    DEFAULT_CSS = """
    ProgressLine {
        height: auto;
        padding: 0 1;
    }
    """

    def __init__(self, text: str = "", *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(text, id=id, classes=classes)
        self._label = ""
        self._hint = ""
        self._t0 = 0.0
        self._tick = 0
        self._timer: Timer | None = None

    @property
    def running(self) -> bool:
        """Whether an operation is in progress."""
        return self._timer is not None

    @property
    def elapsed(self) -> float:
        """Seconds since the operation started."""
        return time.monotonic() - self._t0

    def start(self, label: str, hint: str = "") -> None:
        """Show ``label`` with a spinner and the time it has taken so far (``hint``: what happens next)."""
        self._label, self._hint = label, hint
        self._t0 = time.monotonic()
        if self._timer is None:
            self._timer = self.set_interval(0.25, self._draw)
        self._draw()

    def note(self, label: str, hint: str | None = None) -> None:
        """Change what the running operation says (the clock keeps running)."""
        self._label = label
        if hint is not None:
            self._hint = hint
        self._draw()

    def _draw(self) -> None:
        self._tick += 1
        t = Text()
        t.append(SPINNER[self._tick % len(SPINNER)] + " ", style="bold yellow")
        t.append(self._label, style="yellow")
        t.append(f"  {self.elapsed:.0f} s", style="bold")
        if self._hint:
            t.append(f"  ({self._hint})", style="dim")
        self.update(t)

    def finish(self, text: str | Text, style: str = "green") -> float:
        """Stop the clock and show the outcome; returns the seconds it took."""
        took = self.elapsed
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self.update(text if isinstance(text, Text) else Text(text, style=style))
        return took
