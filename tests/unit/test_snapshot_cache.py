"""GetSnapshot's cache (agents/server/snapshot.py): one encoded sample answers many requests, byte for byte what a
snapshot built for each would say, and only while it is young and nothing it shows has changed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gpudeck.agents.server.daemon import Agent
from gpudeck.agents.server.snapshot import EncodedSnapshot
from gpudeck.agents.wire.protocol import SNAPSHOT_MAX_AGE_S, Gpu, Snapshot, decode_reply, encode


def _snap() -> Snapshot:
    return Snapshot(
        host="h", ts=1.5, epoch="e", gpus=[Gpu(index=0, uuid="GPU-1", name="H200", memory_used=1 << 20, memory_total=1 << 30)], last_seq=7
    )


@pytest.mark.parametrize("rid", ["", "r-1", 'quote " and \\ back', "é ✓ \n", "lone \ud800 surrogate"])
def test_a_cached_reply_is_the_bytes_a_snapshot_built_for_the_request_would_be(rid: str) -> None:
    cached = EncodedSnapshot(None, 0.0, _snap())  # type: ignore[arg-type]
    assert cached.tail is not None, "the request_id no longer leads a snapshot line: every reply is encoded whole"
    own = _snap()
    own.request_id = rid
    assert cached.reply(rid) == encode(own)
    back = decode_reply(cached.reply(rid))
    assert isinstance(back, Snapshot) and back.gpus[0].name == "H200" and back.last_seq == 7


def test_the_latest_sample_answers_only_while_young_and_unchanged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "2:H200:141")

    async def go() -> None:
        agent = Agent(tmp_path / "agent")
        try:
            cache = agent.snapshot_cache
            key = cache.state_key()
            got = cache.sample(key)
            cache.keep(got)
            assert cache.fresh(SNAPSHOT_MAX_AGE_S, key) is got
            assert cache.fresh(0, key) is None, "max_age_s 0 asks for a sample made for the request"
            # an event (a run created, changed or ended, an alert) makes the next request sample again
            agent.supervisor.runs.append("members", "r-test", {"added": [{"pid": 1}]})
            changed = cache.state_key()
            assert changed != key and cache.fresh(SNAPSHOT_MAX_AGE_S, changed) is None
            # too old for the request's bound, and never older than SNAPSHOT_MAX_AGE_S whatever a client asks
            got.taken = time.monotonic() - 0.4
            assert cache.fresh(0.3, key) is None and cache.fresh(SNAPSHOT_MAX_AGE_S, key) is got
            got.taken = time.monotonic() - SNAPSHOT_MAX_AGE_S - 0.1
            assert cache.fresh(3600.0, key) is None
            # an older sample finishing late never replaces a younger one
            young = cache.sample(key)
            cache.keep(young)
            cache.keep(got)
            assert cache.latest is young
        finally:
            agent.journal.close()

    asyncio.run(go())


def test_the_tick_samples_ahead_once_a_request_for_a_client_at_a_steady_pace_and_never_for_nobody(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "1:H200:141")

    async def go() -> None:
        agent = Agent(tmp_path / "agent")
        try:
            cache = agent.snapshot_cache
            assert not cache.due(10.0), "nobody asked: an idle agent samples nothing ahead"
            cache.note_request()
            assert not cache.due(10.0), "one request says nothing of when the next comes"
            now = time.monotonic()
            cache.asked, cache.gap, cache.pending = now - 0.1, 1.0, True  # a client asking once a second, 0.1 s ago
            assert not cache.due(10.0), "sampled now, it would be 0.9 s old when asked for: a later tick does it"
            cache.asked = now - 0.3
            assert cache.due(10.0) and not cache.due(10.0), "one sample ahead per request"
            cache.asked, cache.gap, cache.pending = now - 0.3, 30.0, True
            assert not cache.due(10.0), "a client asking every 30 s gets a sample made for its request"
        finally:
            agent.journal.close()

    asyncio.run(go())
