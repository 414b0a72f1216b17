"""The history's event check (console/history/quarantine.py): its fast path never passes what the full walk refuses.

``check_event`` first asks ``_plain`` (no paths built, exact types only) and walks the data with ``_walk`` only when
that says "look closer". So the verdicts stay the walk's: for any data, ``_plain`` true implies the walk passes it,
and ``check_event`` raises exactly when the walk does, with the walk's message.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpudeck.agents.wire.protocol import Event
from gpudeck.console.history import quarantine


class Sub(int):
    pass


HOSTILE_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**66), max_value=2**66),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["\ud800", "a\udfffb", "é", "日本", "\x00"]),
    st.builds(Sub, st.integers(-5, 5)),
    st.binary(max_size=4),
)
KEYS = st.one_of(st.text(max_size=6), st.sampled_from(["\ud800", "k\udc00"]), st.integers(-3, 3), st.none())
TREES = st.recursive(
    HOSTILE_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(KEYS, inner, max_size=4),
    ),
    max_leaves=30,
)


def walk_verdict(data: object) -> str | None:
    try:
        quarantine._walk(data)
    except quarantine.BadEvent as exc:
        return str(exc)
    return None


def check_verdict(data: object) -> str | None:
    try:
        quarantine.check_event(Event(seq=1, ts=1.0, kind="telemetry", run_id="r", data=data))  # type: ignore[arg-type]
    except quarantine.BadEvent as exc:
        return str(exc)
    return None


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(KEYS, TREES, max_size=5))
def test_the_fast_path_never_passes_what_the_walk_refuses(data: dict) -> None:
    walked = walk_verdict(data)
    if quarantine._plain(data, 1):
        assert walked is None, (data, walked)
    assert check_verdict(data) == walked


def nested(depth: int) -> dict:
    d: dict = {"leaf": 1}
    for _ in range(depth - 1):
        d = {"x": d}
    return d


@pytest.mark.parametrize("depth", [quarantine.MAX_DEPTH - 2, quarantine.MAX_DEPTH - 1, quarantine.MAX_DEPTH, quarantine.MAX_DEPTH + 1])
def test_the_depth_limit_is_the_walks_at_every_depth_near_it(depth: int) -> None:
    data = nested(depth)
    assert check_verdict(data) == walk_verdict(data)
    assert (walk_verdict(nested(quarantine.MAX_DEPTH + 1)) or "").endswith(f"nested deeper than {quarantine.MAX_DEPTH}")


def test_a_telemetry_step_takes_the_fast_path() -> None:
    rec = {
        "ts": 1.5,
        "rank": 0,
        "type": "step",
        "step": 25,
        "loss": 2.5,
        "tokens_per_s": 412000.0,
        "mfu": 0.41,
        "tokens": 2**40,
        "ok": True,
        "note": None,
    }
    assert quarantine._plain({"record": rec, "offset": 3, "tags": ["a", "é"]}, 1)
    for bad in (math.inf, math.nan, 2**63, "\ud800"):
        assert not quarantine._plain({"record": {**rec, "loss": bad}}, 1)
        assert check_verdict({"record": {**rec, "loss": bad}}) is not None
