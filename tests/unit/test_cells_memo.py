"""console/tui/widgets/cells.py's ``memo``: a cell rebuilt every second with the same look is the same object, the
cache stays bounded whatever text a far side sends, and a shared cell is not changed by being shown."""

from __future__ import annotations

import time

from rich.text import Text

from gpudeck.agents.wire.protocol import Gpu, Snapshot
from gpudeck.console.core.records import HostStatus
from gpudeck.console.tui.screens.fleet import host_cells
from gpudeck.console.tui.widgets.cells import MEMO_TEXT_MAX, alerts_text, literal, mem_bar, pct_bar, sortable, state_text, styled


def test_the_same_look_is_the_same_cell() -> None:
    assert styled("ok", "red") is styled("ok", "red")
    assert styled("ok", "red") is not styled("ok", "green")
    assert pct_bar(93.2) is pct_bar(93.4)  # both show "▇▇▇▇▇  93%"
    assert pct_bar(93.6) is not pct_bar(93.4) and pct_bar(93.6).plain.endswith(" 94%")
    gib = 1 << 30
    assert mem_bar(40 * gib, 141 * gib, width=10) is mem_bar(40 * gib + 1000, 141 * gib, width=10)
    assert state_text("unreachable", "5m") is state_text("unreachable", "5m")
    assert alerts_text(["a", "b"], True) is alerts_text(("a", "b"), True)
    s = sortable("14:03:20", 1.5)
    assert s is sortable("14:03:20", 1.5) and s.sort_value == 1.5 and not hasattr(s, "__dict__")


def test_a_long_text_is_built_and_not_kept() -> None:
    """An agent's 1 MB error a second, each one different, must not grow the console: over MEMO_TEXT_MAX characters a
    cell is built each time and nothing is kept."""
    before = styled.cache_info().currsize  # type: ignore[attr-defined]
    for i in range(50):
        long = f"{i} " + "x" * MEMO_TEXT_MAX
        a, b = styled(long, "red"), styled(long, "red")
        assert a is not b and a.plain == long
    assert styled.cache_info().currsize == before  # type: ignore[attr-defined]
    assert alerts_text(["y" * 1000]) is not alerts_text(["y" * 1000])


def test_a_host_row_rebuilt_with_nothing_changed_makes_no_new_cell() -> None:
    gib = 1 << 30
    gpus = [Gpu(index=i, memory_used=40 * gib, memory_total=141 * gib, util_gpu=90) for i in range(8)]
    snap = Snapshot(host="h1", ts=time.time(), epoch="e", gpus=gpus, simulated=True)
    st = HostStatus(name="h1", state="up", snapshot=snap, agent_version="0.1.0", since=1_700_000_000.0)
    first, _ = host_cells(st)
    again, _ = host_cells(st)
    assert first.keys() == again.keys()
    for key, cell in first.items():
        assert again[key] is cell or (isinstance(cell, str) and again[key] == cell), key
    assert "SIMULATED" in first["host"].plain  # type: ignore[union-attr]


def test_showing_a_shared_cell_leaves_it_as_it_was() -> None:
    cell = pct_bar(50.0)
    plain, spans = cell.plain, list(cell.spans)
    shown = literal(cell)
    assert shown is cell  # no control characters: shown as is
    assert isinstance(shown, Text) and cell.plain == plain and cell.spans == spans


def test_a_keyword_call_is_kept_and_bounded_like_a_positional_one() -> None:
    assert styled("kw", style="red") is styled("kw", style="red")
    assert styled("x" * (MEMO_TEXT_MAX + 1), style="red") is not styled("x" * (MEMO_TEXT_MAX + 1), style="red")
