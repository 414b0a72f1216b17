"""Provides the CLI's progress line: a wait longer than about a second on a terminal shows what it waits for on stderr.

:func:`waiting` wraps one await (connecting to hosts, syncing the history, a stop's grace period, a rebuild, a
remote launch) with rich's status spinner and the elapsed seconds. It starts only after :data:`DELAY_S`, so a quick
answer shows nothing; it is silent when stderr is not a terminal or the command prints ``--json``, and it never
redirects stdout or stderr (nothing may be printed inside it; what the command prints comes after).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DELAY_S = 1.0


class _Elapsed:
    """The status text with the seconds since it began, rendered afresh on every refresh."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = time.monotonic()

    def __rich__(self) -> str:
        return f"{self.label} ({time.monotonic() - self.t0:.0f} s)"


_enabled = True


def enable(on: bool) -> None:
    """Whether progress may show at all (the CLI turns it off for ``--json``)."""
    global _enabled
    _enabled = on


def shows() -> bool:
    """Whether a progress line would show now: enabled and stderr is a terminal."""
    return _enabled and sys.stderr.isatty()


@contextmanager
def waiting(label: str, delay_s: float = DELAY_S) -> Iterator[None]:
    """Show ``label`` with a spinner and elapsed time on stderr while the block runs, once it has taken ``delay_s``."""
    if not shows():
        yield
        return
    from rich.console import Console
    from rich.live import Live
    from rich.spinner import Spinner

    # the command's own output stays where it goes: no redirection of stdout or stderr
    status: Any = Live(
        Spinner("dots", text=_Elapsed(label)),
        console=Console(stderr=True),
        transient=True,
        refresh_per_second=8,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    lock = threading.Lock()
    started = False

    def start() -> None:
        nonlocal started
        with lock:
            if not done:
                status.start()
                started = True

    done = False
    timer = threading.Timer(delay_s, start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            done = True
            timer.cancel()
            if started:
                status.stop()
