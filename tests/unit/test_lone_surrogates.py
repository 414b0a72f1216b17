"""Lone surrogates (a surrogateescape'd byte, a "\\ud800" escape that Python's json writes) in run-controlled text:
msgspec refuses to encode them, so every path from such a string to the wire or the journal replaces them with
U+FFFD instead of failing the message (and with it the event stream, the run list or the launch)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec

from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.protocol import (
    EventBatch,
    Launch,
    LaunchSpec,
    RunInfo,
    RunList,
    decode_reply,
    decode_request,
    encode,
    scrub_text,
)

LONE = ["\ud800", "\udfff", "\udcff", "a\ud83d", "\ude00b"]


def test_scrub_text_replaces_lone_surrogates_and_joins_pairs() -> None:
    assert scrub_text("a\ud800b") == "a\ufffdb"
    assert scrub_text("\ud83d\ude00") == "\U0001f600"  # a valid pair is its character
    assert scrub_text("plain") == "plain"


def test_encode_never_fails_on_a_lone_surrogate_and_the_other_side_decodes_it() -> None:
    for s in LONE:
        run = RunInfo(id="r-1", host="h", state="running", spec=LaunchSpec(argv=["x", s], name=s), name=s, cause=s, created=1.0)
        line = encode(RunList(request_id="q", runs=[run]))
        back = decode_reply(line.rstrip(b"\n"))
        assert isinstance(back, RunList) and "\ufffd" in (back.runs[0].name or "")


def test_a_request_with_lone_surrogate_escapes_is_decoded_with_replacement_characters() -> None:
    line = json.dumps({"type": "launch", "request_id": "x", "spec": {"argv": ["echo", "\ud800"], "name": "n\udcff"}}).encode()
    req = decode_request(line)
    assert isinstance(req, Launch) and req.spec.name == "n\ufffd" and req.spec.argv[1] == "\ufffd"
    # still refused: what is not JSON for any other reason
    assert not isinstance(decode_request(b'{"type": "launch", "spec": \\ud800}'), Launch)


def test_the_journal_stores_and_serves_lone_surrogates_as_replacement_characters(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.db", "h")
    try:
        run = RunInfo(
            id="r-1", host="h", state="running", spec=LaunchSpec(argv=["x\udcff"], name="n\ud800"), name="n\ud800", created=time.time()
        )
        j.create_run(run)
        j.update_run("r-1", "run_state", {"state": "failed", "cause": "killed \udcff"}, state="failed", cause="killed \udcff")
        j.append("telemetry", "r-1", {"record": {"type": "step", "note": "\ud800", "\udcff": 1}, "offset": 1})
        j.flush()
        events = j.events_after(0)
        batch = encode(EventBatch(request_id="e", epoch=j.epoch, events=events, last_seq=j.committed_seq))
        back = decode_reply(batch.rstrip(b"\n"))
        assert isinstance(back, EventBatch) and len(back.events) == len(events)
        tel = next(e for e in back.events if e.kind == "telemetry")
        assert tel.data["record"] == {"type": "step", "note": "\ufffd", "\ufffd": 1}
        got = j.get_run("r-1")
        assert got is not None and got.name == "n\ufffd" and got.cause == "killed \ufffd"
        msgspec.json.encode(got)  # plain msgspec takes it: nothing stored holds a lone surrogate
    finally:
        j.close()
