"""The long-lived console processes' cyclic-collector policy, in one place: freezing what start-up built, and when
the console starts collections itself.

The console (console/tui/app.py) and ``gpudeck watch`` (console/watch/service.py) hold, for as long as they run,
what connecting built: every host's link, its SSH connection, the screens. A full collection walks all of it (170 ms
with 256 hosts, bench/tui.py) and finds nothing to free, and with N hosts there is N times as much of it, so the cost
of each collection grows with the fleet. Once no link is still connecting (or after FREEZE_AFTER_S), both take it out
of the collector's sight (:func:`freeze_startup_heap`); frozen objects are still freed by reference counting.

Then the watcher, with no keys to wait for, leaves collections to the collector at HEADLESS_THRESHOLDS (each scrape
builds tens of thousands of short-lived objects, so young collections run further apart than Python's 700). The
console runs them through :class:`KeyAwareCollector`: the collector's own young collections, one more whenever none ran
for YOUNG_EVERY_S, and the middle and full ones when nobody is pressing keys (:func:`due_collection`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable

FREEZE_AFTER_S = 60.0  # freeze by then even if some link is still connecting
HEADLESS_THRESHOLDS = (50_000, 20, 100)

# The console's. The collector runs young collections by itself, every YOUNG_AT net allocations; the middle and full
# ones are the console's to start, when nobody is pressing keys. Python's default (700, 10, 10) set off a full
# collection every couple of seconds while a run's output streamed (50-90 ms each). 50,000 young made each young
# collection a 20-70 ms pause, because what Textual leaves in reference cycles (each layout's map, each toast's nodes)
# is freed only by the collector: a young pass freed 30,000 objects. At 10,000 they take 5-15 ms of CPU; a middle one,
# freeing what the young ones promoted, takes 80-105 ms with 256 hosts and a run streaming, and a key press that met
# one waited that long (bench/tui.py --parts 3, bench/RESULTS.md section 24).
YOUNG_AT = 10_000
# ... and at least this often. The collector counts allocations less deallocations, so a console that replaces as much
# as it makes (every host's snapshot and cells, every second) can go seconds without a young collection while the
# young generation fills with everything made since: at 1,024 hosts the slow young collections came 1-10 s apart and
# walked 40,000-94,000 objects, 12-32 ms here and 41-73 ms on the device's slower cores, and a key that met one waited
# (bench/RESULTS.md 36-young). A young collection is started when none ran for YOUNG_EVERY_S.
YOUNG_EVERY_S = 0.2
CHECK_S = 0.1  # how often the console looks whether a collection is due
NEVER = 1 << 30  # the collector's own middle and full collections, as thresholds: never
MIDDLE_AFTER = 20  # young collections before a middle one is due (Python's default is 10)
FULL_AFTER = 100  # middle collections before a full one is due (as the collector's threshold was)
IDLE_S = 1.0  # a due collection waits until no key or click came for this long
# ... or until it has been due this long: it waits for an idle moment, never forever. A count of young collections
# (4 times the due count, before 37-cells) no longer measures time since young collections come every YOUNG_EVERY_S
# at least: at 1,024 hosts the 80th came 6-8 s after the 20th, and a middle collection of 65-80 ms (a filter's new
# rows, walked once) landed inside a filter being typed (bench/RESULTS.md 37-cells).
WAIT_LIMIT_S = 10.0


def freeze_due(link_states: Iterable[str], running_s: float) -> bool:
    """Whether start-up is over: no link is still ``connecting``, or the process has run FREEZE_AFTER_S."""
    return running_s > FREEZE_AFTER_S or all(state != "connecting" for state in link_states)


def freeze_startup_heap(thresholds: tuple[int, int, int]) -> None:
    """Collect once, freeze what survives (the start-up heap), then collect at ``thresholds`` from now on."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)


def owed(counts: tuple[int, int, int]) -> int | None:
    """The older generation whose collection is owed by ``counts`` (``gc.get_count()``: the middle and full entries
    count the collections below them since their own last), or None."""
    _, young_runs, middle_runs = counts
    if middle_runs >= FULL_AFTER:
        return 2
    if young_runs >= MIDDLE_AFTER:
        return 1
    return None


def due_collection(counts: tuple[int, int, int], idle_s: float, young_gap_s: float = 0.0, owed_for_s: float = 0.0) -> int | None:
    """The generation to collect now, or None: ``idle_s`` is how long since the last key or click, ``young_gap_s``
    how long since the last collection of any generation, ``owed_for_s`` how long the older collection :func:`owed`
    names has been owed.

    A full collection is owed after FULL_AFTER middle ones, a middle one after MIDDLE_AFTER young ones; an owed one runs
    once input has been idle for IDLE_S, or, if input never pauses, once it has been owed for WAIT_LIMIT_S. A young one
    is due when none ran for YOUNG_EVERY_S, keys or not: it is short because it comes often."""
    gen = owed(counts)
    if gen is not None and (idle_s >= IDLE_S or owed_for_s >= WAIT_LIMIT_S):
        return gen
    if young_gap_s >= YOUNG_EVERY_S:
        return 0
    return None


class KeyAwareCollector:
    """The console's collections once its start-up heap is frozen: :meth:`start`, then :meth:`check` every CHECK_S
    with when the last key or click came; :meth:`stop` when the app goes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.collected_at = clock()  # the end of the last collection of any generation, the collector's own included
        self.owed_since: float | None = None  # when the owed older collection became owed (None: none is)

    def start(self) -> None:
        freeze_startup_heap((YOUNG_AT, NEVER, NEVER))
        self.collected_at = self.clock()
        gc.callbacks.append(self._collected)

    def stop(self) -> None:
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)

    def _collected(self, phase: str, _info: dict) -> None:
        if phase == "stop":
            self.collected_at = self.clock()

    def check(self, input_at: float) -> int | None:
        """Run the collection due now, if any; returns its generation."""
        now = self.clock()
        counts = gc.get_count()
        if owed(counts) is None:
            self.owed_since = None
        elif self.owed_since is None:
            self.owed_since = now
        gen = due_collection(counts, now - input_at, now - self.collected_at, 0.0 if self.owed_since is None else now - self.owed_since)
        if gen is not None:
            gc.collect(gen)
            if gen > 0:
                self.owed_since = None
        return gen
