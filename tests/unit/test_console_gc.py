"""due_collection: when the console starts a collection itself (console/tui/app.py)."""

from __future__ import annotations

import pytest

from gpudeck.console.tui.app import GC_FULL_AFTER, GC_IDLE_S, GC_MIDDLE_AFTER, GC_WAIT_LIMIT, GC_YOUNG_EVERY_S, due_collection

BUSY, IDLE = 0.0, GC_IDLE_S


@pytest.mark.parametrize(
    "counts,idle_s,gap_s,want",
    [
        ((9_999, 0, 0), IDLE, 0.0, None),  # young ones are the collector's own
        ((0, GC_MIDDLE_AFTER - 1, 0), IDLE, 0.0, None),
        ((0, GC_MIDDLE_AFTER, 0), IDLE, 0.0, 1),
        ((0, GC_MIDDLE_AFTER, 0), BUSY, 0.0, None),  # keys are coming: it waits
        ((0, GC_MIDDLE_AFTER * GC_WAIT_LIMIT - 1, 0), BUSY, 0.0, None),
        ((0, GC_MIDDLE_AFTER * GC_WAIT_LIMIT, 0), BUSY, 0.0, 1),  # ... but not forever
        ((0, 0, GC_FULL_AFTER), IDLE, 0.0, 2),
        ((0, GC_MIDDLE_AFTER, GC_FULL_AFTER), IDLE, 0.0, 2),  # the full one covers the middle one
        ((0, GC_MIDDLE_AFTER, GC_FULL_AFTER), BUSY, 0.0, None),
        ((0, 0, GC_FULL_AFTER * GC_WAIT_LIMIT), BUSY, 0.0, 2),
        ((0, GC_MIDDLE_AFTER * GC_WAIT_LIMIT, GC_FULL_AFTER), BUSY, 0.0, 1),
        # a console that frees as much as it makes goes seconds without a young collection while the young generation
        # fills: one is started when none ran for GC_YOUNG_EVERY_S, keys or not, so each stays short
        ((0, 0, 0), BUSY, GC_YOUNG_EVERY_S - 0.01, None),
        ((0, 0, 0), BUSY, GC_YOUNG_EVERY_S, 0),
        ((0, 0, 0), IDLE, GC_YOUNG_EVERY_S, 0),
        ((0, GC_MIDDLE_AFTER, 0), IDLE, GC_YOUNG_EVERY_S, 1),  # the middle one covers the young one
    ],
)
def test_due_collection(counts: tuple[int, int, int], idle_s: float, gap_s: float, want: int | None) -> None:
    assert due_collection(counts, idle_s, gap_s) == want
