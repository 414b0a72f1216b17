"""console/core/gcpolicy.py: when the console starts a collection itself (due_collection, KeyAwareCollector)."""

from __future__ import annotations

import gc

import pytest

from gpudeck.console.core.gcpolicy import FULL_AFTER, IDLE_S, MIDDLE_AFTER, WAIT_LIMIT_S, YOUNG_EVERY_S, KeyAwareCollector, due_collection

BUSY, IDLE = 0.0, IDLE_S


@pytest.mark.parametrize(
    "counts,idle_s,gap_s,owed_s,want",
    [
        ((9_999, 0, 0), IDLE, 0.0, 0.0, None),  # young ones are the collector's own
        ((0, MIDDLE_AFTER - 1, 0), IDLE, 0.0, 0.0, None),
        ((0, MIDDLE_AFTER, 0), IDLE, 0.0, 0.0, 1),
        ((0, MIDDLE_AFTER, 0), BUSY, 0.0, 0.0, None),  # keys are coming: it waits
        ((0, MIDDLE_AFTER * 4, 0), BUSY, 0.0, WAIT_LIMIT_S - 0.01, None),  # however many young ones ran meanwhile
        ((0, MIDDLE_AFTER, 0), BUSY, 0.0, WAIT_LIMIT_S, 1),  # ... but not forever
        ((0, 0, FULL_AFTER), IDLE, 0.0, 0.0, 2),
        ((0, MIDDLE_AFTER, FULL_AFTER), IDLE, 0.0, 0.0, 2),  # the full one covers the middle one
        ((0, MIDDLE_AFTER, FULL_AFTER), BUSY, 0.0, 0.0, None),
        ((0, 0, FULL_AFTER), BUSY, 0.0, WAIT_LIMIT_S, 2),
        # a console that frees as much as it makes goes seconds without a young collection while the young generation
        # fills: one is started when none ran for YOUNG_EVERY_S, keys or not, so each stays short
        ((0, 0, 0), BUSY, YOUNG_EVERY_S - 0.01, 0.0, None),
        ((0, 0, 0), BUSY, YOUNG_EVERY_S, 0.0, 0),
        ((0, 0, 0), IDLE, YOUNG_EVERY_S, 0.0, 0),
        ((0, MIDDLE_AFTER, 0), BUSY, YOUNG_EVERY_S, 0.0, 0),  # an owed middle one waits; the young one does not
        ((0, MIDDLE_AFTER, 0), IDLE, YOUNG_EVERY_S, 0.0, 1),  # the middle one covers the young one
    ],
)
def test_due_collection(counts: tuple[int, int, int], idle_s: float, gap_s: float, owed_s: float, want: int | None) -> None:
    assert due_collection(counts, idle_s, gap_s, owed_s) == want


def test_an_owed_collection_waits_for_keys_to_stop_for_at_most_the_wait_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector's calls are recorded, not made (this process's collector is left as it was); time is a counter."""
    now = [100.0]
    counts = [(0, 0, 0)]
    collected: list[int] = []
    monkeypatch.setattr(gc, "get_count", lambda: counts[0])
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    c = KeyAwareCollector(clock=lambda: now[0])
    c.collected_at = now[0]

    def typing(at: float) -> int | None:  # a key came just now
        now[0] = at
        gen = c.check(input_at=at)
        if gen == 0:
            c.collected_at = at  # as the collector's callback would note it
        return gen

    assert typing(100.05) is None
    counts[0] = (0, MIDDLE_AFTER, 0)  # a middle one becomes owed while keys come
    assert typing(100.1) is None
    assert typing(100.3) == 0  # young ones go on
    assert typing(100.1 + WAIT_LIMIT_S - 0.05) == 0
    assert 1 not in collected
    assert typing(100.1 + WAIT_LIMIT_S) == 1  # owed since 100.1: not forever
    assert c.owed_since is None
    counts[0] = (0, 0, 0)
    now[0] += 0.05
    assert c.check(input_at=now[0]) is None and c.owed_since is None
    counts[0] = (0, MIDDLE_AFTER, 0)
    now[0] += 0.05
    assert c.check(input_at=now[0] - IDLE_S) == 1  # keys stopped: at once
