"""console/tui/compat/textual_fixes.py: Strip.divide without the reference cycle, answering exactly as upstream does."""

from __future__ import annotations

import gc

import pytest
from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip

from gpudeck.console.tui import app as _app  # noqa: F401  (importing the console's app installs the fix)
from gpudeck.console.tui.compat import textual_fixes

SEGMENTS = [Segment("gpu0 ", Style(bold=True)), Segment("82.1 GiB", Style(color="red")), Segment(" ok")]
LENGTH = 16


def strip() -> Strip:
    return Strip(list(SEGMENTS), LENGTH)


def test_the_console_runs_with_the_fix_installed() -> None:
    assert textual_fixes.installed()


def test_upstream_still_keeps_a_whole_strip_in_a_cycle_with_itself() -> None:
    """When this fails, Textual no longer caches [self] in the strip's own cache: delete console/tui/compat/textual_fixes.py."""
    s = strip()
    parts = textual_fixes.UPSTREAM_DIVIDE(s, [LENGTH])
    assert parts[0] is s
    assert any(s in cached for cached in s._divide_cache._cache.values()), (
        "Textual's Strip.divide no longer keeps the strip in its own cache; the fix in console/tui/compat/textual_fixes.py can go"
    )


@pytest.mark.parametrize(
    "cuts",
    [[LENGTH], [5, LENGTH], [5, 13, LENGTH], [], [0, LENGTH], [LENGTH, LENGTH + 4], [LENGTH + 4], [3, 3, LENGTH], [LENGTH, 5]],
    ids=lambda c: ",".join(map(str, c)) or "none",
)
def test_the_fix_divides_as_upstream_does(cuts: list[int]) -> None:
    ours = strip().divide(iter(cuts))  # any iterable, as upstream takes
    theirs = textual_fixes.UPSTREAM_DIVIDE(strip(), iter(cuts))
    assert [(list(p), p.cell_length) for p in ours] == [(list(p), p.cell_length) for p in theirs]


def left_for_the_collector(divide: object) -> int:
    """How many objects a whole strip, divided by ``divide`` and dropped, leaves for the cyclic collector."""
    gc.collect()
    gc.disable()
    try:
        s = strip()
        parts = divide(s, [LENGTH])  # type: ignore[operator]
        assert list(parts) == [s]
        del parts, s
        return gc.collect()
    finally:
        gc.enable()


def test_a_whole_strip_divided_is_freed_by_reference_counting() -> None:
    assert left_for_the_collector(textual_fixes.UPSTREAM_DIVIDE) > 0  # the measure sees upstream's cycle
    assert left_for_the_collector(Strip.divide) == 0  # with the fix, the strip and its caches went at once
