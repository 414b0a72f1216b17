"""Provides cell renderers shared by the tables: memory bars, states, attributions, durations."""

from __future__ import annotations

from rich.text import Text

from console.fmt import gib

STATE_STYLES = {
    "up": "bold green",
    "connecting": "yellow",
    "unreachable": "bold red",
    "version_mismatch": "bold magenta",
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

ATTRIBUTION_STYLES = {"RUN": "green", "STALE": "bold red", "FOREIGN": "yellow", "NO_SUCH_PROCESS": "bold magenta"}


def mem_bar(used: int, total: int, width: int = 12) -> Text:
    """A memory bar with the figures: '█████░░░░░░░  45.0/141.0 GiB'."""
    frac = 0.0 if total <= 0 else min(1.0, used / total)
    filled = round(frac * width)
    style = "green" if frac < 0.6 else "yellow" if frac < 0.9 else "red"
    t = Text()
    t.append("█" * filled, style=style)
    t.append("░" * (width - filled), style="dim")
    t.append(f" {gib(used)}/{gib(total)} GiB")
    return t


def state_text(state: str, extra: str = "") -> Text:
    """A state word in its colour."""
    return Text(state + (f" {extra}" if extra else ""), style=STATE_STYLES.get(state, ""))


def attribution_text(attribution: str) -> Text:
    """RUN / STALE / FOREIGN / NO SUCH PROCESS in its colour."""
    return Text(attribution.replace("_", " "), style=ATTRIBUTION_STYLES.get(attribution, ""))


_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 12) -> str:
    """The last ``width`` values as a unicode sparkline."""
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int((v - lo) / span * (len(_SPARK) - 1)))] for v in vals)
