"""Provides cell renderers shared by the tables: memory bars, states, attributions, alerts, sparklines.

The cells a live table rebuilds every second (a host's state, bars and name; a run's state and start) are made once
per distinct look and shared: ``memo`` keeps them. A Rich Text is three objects the cyclic collector walks (itself, its
text list, its spans list), and at 1,024 hosts the Fleet's cells were most of what a middle collection walked
(bench/RESULTS.md 37-cells). A shared cell is never changed in place: build a new Text (``Text.assemble``,
``append_text`` onto your own) instead of appending to one of these.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar, overload

from rich.markup import escape as rich_escape
from rich.text import Text
from textual.markup import escape as textual_escape

from gpudeck.console.core.fmt import gib
from gpudeck.console.core.sanitize import escape_controls, has_controls

STATE_STYLES = {
    "up": "bold green",
    "connecting": "yellow",
    "unreachable": "bold red",
    "version_mismatch": "bold magenta",
    "host_key": "bold magenta",
    "running": "green",
    "starting": "yellow",
    "stopping": "yellow",
    "succeeded": "cyan",
    "failed": "bold red",
    "stopped": "magenta",
    "lost": "bold red",
    "preflight_failed": "red",
    "pending": "dim",
}
STATE_WORDS = {"version_mismatch": "version mismatch", "host_key": "host key refused", "preflight_failed": "preflight failed"}

ATTRIBUTION_STYLES = {"RUN": "green", "STALE": "bold red", "FOREIGN": "yellow", "NO_SUCH_PROCESS": "bold magenta"}
LEFTOVER_STYLES = {
    "orphan": "bold red",
    "foreign": "yellow",
    "zombie": "bold red",
    "disk_sleep": "bold red",
    "no_such_process": "bold magenta",
    "live": "green",
}
SIMULATED = Text(" SIMULATED ", style="bold black on yellow")
MARK = "✓"
MEMO_CELLS = 16_384  # distinct cells kept per builder: more than the rows a live table rebuilds each second (hosts, runs)
MEMO_TEXT_MAX = 160  # a longer text (an agent's error, a history row's cause) is built each time and not kept: the
# cache's memory is bounded (16,384 cells of at most 160 characters per builder) whatever a far side sends

_T = TypeVar("_T")


def memo(build: Callable[..., _T]) -> Callable[..., _T]:
    """``build`` (hashable arguments) with its results kept and shared, least recently used first out, MEMO_CELLS of
    them; a call with a str argument over MEMO_TEXT_MAX characters builds and keeps nothing."""
    cached = functools.lru_cache(maxsize=MEMO_CELLS)(build)

    @functools.wraps(build)
    def call(*args: object, **kwargs: object) -> _T:
        for a in (*args, *kwargs.values()) if kwargs else args:  # a loop, not any(...): no generator object per call
            if type(a) is str and len(a) > MEMO_TEXT_MAX:
                return build(*args, **kwargs)
        return cached(*args, **kwargs)

    call.cache_info = cached.cache_info  # type: ignore[attr-defined]  # for tests and benches
    return call


@memo
def styled(text: str, style: str = "") -> Text:
    """``text`` in one style, shared (see the module's note)."""
    return Text(text, style=style)


def literal(value: object) -> object:
    """A table cell shown as text: a str's markup is escaped (DataTable and Rich tables parse str cells as Rich
    markup: a run named ``[/]`` would end the app), and control characters show as escapes in str and Text alike."""
    if isinstance(value, str):
        return rich_escape(escape_controls(value))
    if isinstance(value, Text):
        return shown(value)
    return value


_V = TypeVar("_V")


@overload
def plain_markup(value: str) -> str: ...


@overload
def plain_markup(value: _V) -> _V: ...


def plain_markup(value: object) -> object:
    """For a Static: a str with Textual's markup escaped and its controls shown as escapes (a Text: controls only)."""
    if isinstance(value, str):
        return textual_escape(escape_controls(value, keep="\n\t"))
    if isinstance(value, Text):
        return shown(value)
    return value


def shown(text: Text) -> Text:
    """``text`` (built from run-controlled strings) with its control characters escaped, styles kept (line breaks and
    tabs are the view's own and stay)."""
    plain = text.plain
    if not has_controls(plain.replace("\n", "").replace("\t", "")):
        return text

    def bad(c: str) -> bool:
        return c not in "\n\t" and has_controls(c)

    cuts = sorted({i for i, c in enumerate(plain) if bad(c)} | {i + 1 for i, c in enumerate(plain) if bad(c)})
    out = Text(end=text.end, justify=text.justify, no_wrap=text.no_wrap, overflow=text.overflow)
    for part in text.divide(cuts):
        if len(part.plain) == 1 and bad(part.plain):
            visible = Text(escape_controls(part.plain), style=part.style)
            for span in part.spans:  # the one character's styles cover its whole escape
                visible.stylize(span.style, 0, len(visible))
            out.append_text(visible)
        else:
            out.append_text(part)
    return out


@memo
def _bar(block: str, filled: int, width: int, style: str, label: str) -> Text:
    t = Text()
    t.append(block * filled, style=style)
    t.append("░" * (width - filled), style="dim")
    t.append(label)
    return t


def mem_bar(used: int, total: int, width: int = 12) -> Text:
    """A memory bar with the figures: '█████░░░░░░░  45.0/141.0 GiB' (shared: see the module's note)."""
    frac = 0.0 if total <= 0 else min(1.0, used / total)
    style = "green" if frac < 0.6 else "yellow" if frac < 0.9 else "red"
    return _bar("█", round(frac * width), width, style, f" {gib(used)}/{gib(total)} GiB")


def pct_bar(pct: float | None, width: int = 5) -> Text:
    """A utilisation figure with a small bar: '▇▇▇░░  62%' (shared: see the module's note)."""
    if pct is None:
        return styled("-", "dim")
    frac = max(0.0, min(1.0, pct / 100))
    return _bar("▇", round(frac * width), width, "cyan", f" {pct:3.0f}%")


@memo
def state_text(state: str, extra: str = "") -> Text:
    """A state word in its colour (shared: see the module's note)."""
    word = STATE_WORDS.get(state, state)
    return Text(word + (f" {extra}" if extra else ""), style=STATE_STYLES.get(state, ""))


def attribution_text(attribution: str) -> Text:
    """RUN / STALE / FOREIGN / NO SUCH PROCESS in its colour."""
    return Text(attribution.replace("_", " "), style=ATTRIBUTION_STYLES.get(attribution, ""))


def leftover_text(kind: str) -> Text:
    """orphan / foreign / zombie / disk sleep / no such process / live, in its colour."""
    return Text(kind.replace("_", " "), style=LEFTOVER_STYLES.get(kind, ""))


def alerts_text(alerts: tuple[str, ...] | list[str], critical: bool = False, limit: int = 3) -> Text:
    """Alert summaries joined, red when any is critical ('' when none; shared: see the module's note)."""
    if not alerts:
        return styled("")
    shown = "; ".join(alerts[:limit]) + (f" (+{len(alerts) - limit})" if len(alerts) > limit else "")
    return styled("⚠ " + shown, "bold red" if critical else "red")


def ok_text(ok: bool | None) -> Text:
    """✓ / ✗ / ? for a check that passed, failed, or could not be decided."""
    if ok is None:
        return Text("?", style="dim")
    return Text("✓", style="bold green") if ok else Text("✗", style="bold red")


class SortableText(Text):
    """A cell whose text is for reading and whose ``sort_value`` is for ordering (a time shown as 14:03:20)."""

    __slots__ = ("sort_value",)

    def __init__(self, text: str = "", style: str = "") -> None:
        super().__init__(text, style=style)
        self.sort_value = 0.0


@memo
def sortable(text: str, value: float, style: str = "") -> SortableText:
    """A cell that shows ``text`` and sorts by ``value`` (shared: see the module's note)."""
    t = SortableText(text, style=style)
    t.sort_value = value
    return t


_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float] | tuple[float, ...], width: int = 12) -> str:
    """The last ``width`` values as a unicode sparkline."""
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int((v - lo) / span * (len(_SPARK) - 1)))] for v in vals)
