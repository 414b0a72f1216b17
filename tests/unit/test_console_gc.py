"""due_collection: when the console starts a middle or full collection itself (console/tui/app.py)."""

from __future__ import annotations

import pytest

from gpudeck.console.tui.app import GC_FULL_AFTER, GC_IDLE_S, GC_MIDDLE_AFTER, GC_WAIT_LIMIT, due_collection

BUSY, IDLE = 0.0, GC_IDLE_S


@pytest.mark.parametrize(
    "counts,idle_s,want",
    [
        ((9_999, 0, 0), IDLE, None),  # young ones are the collector's own
        ((0, GC_MIDDLE_AFTER - 1, 0), IDLE, None),
        ((0, GC_MIDDLE_AFTER, 0), IDLE, 1),
        ((0, GC_MIDDLE_AFTER, 0), BUSY, None),  # keys are coming: it waits
        ((0, GC_MIDDLE_AFTER * GC_WAIT_LIMIT - 1, 0), BUSY, None),
        ((0, GC_MIDDLE_AFTER * GC_WAIT_LIMIT, 0), BUSY, 1),  # ... but not forever
        ((0, 0, GC_FULL_AFTER), IDLE, 2),
        ((0, GC_MIDDLE_AFTER, GC_FULL_AFTER), IDLE, 2),  # the full one covers the middle one
        ((0, GC_MIDDLE_AFTER, GC_FULL_AFTER), BUSY, None),
        ((0, 0, GC_FULL_AFTER * GC_WAIT_LIMIT), BUSY, 2),
        ((0, GC_MIDDLE_AFTER * GC_WAIT_LIMIT, GC_FULL_AFTER), BUSY, 1),
    ],
)
def test_due_collection(counts: tuple[int, int, int], idle_s: float, want: int | None) -> None:
    assert due_collection(counts, idle_s) == want
