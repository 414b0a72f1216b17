"""Provides MetricPlot: a line plot with axes (textual-plotext) — a run's loss or tokens/s by step, two runs
overlaid, a host's GPU memory over the last minutes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from textual_plotext import PlotextPlot

MAX_POINTS = 400  # more than a terminal has columns for: longer series are thinned evenly (ends kept)
COLORS = ("cyan", "magenta", "green", "orange", "blue", "red", "yellow", "white")


@dataclass(frozen=True)
class Series:
    """One line: its legend label and its points (None values are gaps, left out)."""

    label: str
    x: Sequence[float]
    y: Sequence[float | None]


def thin(xs: Sequence[float], ys: Sequence[float], limit: int = MAX_POINTS) -> tuple[list[float], list[float]]:
    """At most ``limit`` points, evenly spaced, the first and last kept."""
    n = len(xs)
    if n <= limit:
        return list(xs), list(ys)
    step = (n - 1) / (limit - 1)
    idx = sorted({round(i * step) for i in range(limit)})
    return [xs[i] for i in idx], [ys[i] for i in idx]


class MetricPlot(PlotextPlot):
    """A line plot with axes; ``show`` replaces what it draws."""

    DEFAULT_CSS = """
    MetricPlot { height: 1fr; width: 1fr; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.lines: list[Series] = []  # what is drawn (tests and the screens read it)

    def show(
        self, series: Sequence[Series], *, xlabel: str, ylabel: str = "", title: str = "", xlim: tuple[float, float] | None = None
    ) -> None:
        """Draw ``series`` (one line each, a legend when there are several) with ``xlabel`` under the x axis; ``xlim``:
        the x axis's ends (else plotext's own, which pads a lone point's x both ways)."""
        plt = self.plt
        plt.clear_data()
        drawn: list[Series] = []
        for i, s in enumerate(series):
            pts = [(x, y) for x, y in zip(s.x, s.y) if y is not None]
            if not pts:
                continue
            xs, ys = thin([p[0] for p in pts], [float(p[1]) for p in pts])
            plt.plot(xs, ys, label=s.label if len(series) > 1 else "", color=COLORS[i % len(COLORS)], marker="braille")
            drawn.append(Series(s.label, xs, ys))
        if xlim is not None:
            plt.xlim(*xlim)
        plt.xlabel(xlabel)
        plt.ylabel(ylabel)
        plt.title(title)
        self.lines = drawn
        self.refresh()
