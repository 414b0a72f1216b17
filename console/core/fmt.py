"""Provides plain-text formatting shared by the CLI and the console: GiB, durations, times."""

from __future__ import annotations

import datetime as dt
import time


def gib(n: int | None) -> str:
    """Bytes as GiB with one decimal ('-' for unknown)."""
    return "-" if n is None else f"{n / 2**30:.1f}"


def duration(seconds: float | None) -> str:
    """Seconds as '1h02m', '3m05s', '12s' ('-' for unknown)."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def when(ts: float | None) -> str:
    """A unix time as local 'YYYY-MM-DD HH:MM:SS' ('-' for none)."""
    return "-" if not ts else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def ago(ts: float | None) -> str:
    """'12s ago', '3m05s ago' ('never' for none)."""
    return "never" if not ts else f"{duration(time.time() - ts)} ago"


def elapsed(started: float | None, ended: float | None) -> float | None:
    """Seconds a run has run (so far)."""
    if not started:
        return None
    return (ended or time.time()) - started
