"""What gpudeck changes in Textual's behaviour: one change, said here, in docs/architecture.md and tested.

**Strip.divide kept every whole strip alive in a reference cycle** (Textual 8.2.8, the newest on PyPI on
2026-12-02). The compositor divides each line it paints at the cuts of the widgets over it; a line that no
widget cuts is divided at its own length, and upstream answers that with ``[self]`` *and caches that list in
the strip's own ``_divide_cache``*: strip -> cache -> list -> strip. Reference counting can then never free the
strip, its segments or its seven small caches; only the cyclic collector can, so every line painted becomes
work for it. With 256 hosts (bench/tui.py --parts 3) the objects only the collector could free in 30 s went
from 547,599 to 327,833 with this change, among them 80,965 FIFOCaches to 2,102; its young passes had grown to
20-70 ms, each one a key press that waits (bench/RESULTS.md section 24).

The change wraps ``Strip.divide`` and answers that one case with a new ``[self]`` without caching it; every
other case is upstream's own code, unchanged. Dividing at the strip's own length returns the strip itself
either way, so callers see the same strips. ``tests/unit/test_textual_fixes.py`` checks that upstream still
builds the cycle (when it fails, Textual has fixed it: delete this module) and that the wrapped method returns
what upstream returns for every kind of cut list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from textual.strip import Strip

UPSTREAM_DIVIDE = Strip.divide


def _divide(self: Strip, cuts: Iterable[int]) -> Sequence[Strip]:
    length = self.cell_length
    kept = [cut for cut in cuts if cut <= length]  # what upstream keeps, in its order
    if kept == [length]:
        return [self]
    return UPSTREAM_DIVIDE(self, kept)


_divide.__doc__ = UPSTREAM_DIVIDE.__doc__
_divide.__wrapped__ = UPSTREAM_DIVIDE  # type: ignore[attr-defined]


def install() -> None:
    """Put the wrapped ``Strip.divide`` in place (idempotent); the console's app calls it when it is imported."""
    Strip.divide = _divide  # type: ignore[method-assign]


def installed() -> bool:
    return Strip.divide is _divide
