"""The long-lived console processes' cyclic-collector policy: one owner for freezing what start-up built.

The console (console/tui/app.py) and ``gpudeck watch`` (console/watch/service.py) hold, for as long as they run,
what connecting built: every host's link, its SSH connection, the screens. A full collection walks all of it (170 ms
with 256 hosts, bench/tui.py) and finds nothing to free, and with N hosts there is N times as much of it, so the cost
of each collection grows with the fleet. Once no link is still connecting (or after FREEZE_AFTER_S), both take it out
of the collector's sight (:func:`freeze_startup_heap`); frozen objects are still freed by reference counting.

Then each sets its own thresholds: the console's collector runs young collections only, and the console itself starts
a young one when none ran for 0.2 s and the middle and full ones around key presses (``due_collection`` in
console/tui/app.py); the watcher, with no keys to wait for, leaves them to
the collector at HEADLESS_THRESHOLDS (each scrape builds tens of thousands of short-lived objects, so young
collections run further apart than Python's 700).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

FREEZE_AFTER_S = 60.0  # freeze by then even if some link is still connecting
HEADLESS_THRESHOLDS = (50_000, 20, 100)


def freeze_due(link_states: Iterable[str], running_s: float) -> bool:
    """Whether start-up is over: no link is still ``connecting``, or the process has run FREEZE_AFTER_S."""
    return running_s > FREEZE_AFTER_S or all(state != "connecting" for state in link_states)


def freeze_startup_heap(thresholds: tuple[int, int, int]) -> None:
    """Collect once, freeze what survives (the start-up heap), then collect at ``thresholds`` from now on."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
