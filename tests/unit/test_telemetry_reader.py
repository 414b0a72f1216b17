"""The agent's telemetry reader: torn lines, garbage, hostile lines rejected one by one with the reason, split-DFlash records without a loss."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudeck.agents.observe.telemetry import TelemetryRejection, TelemetryTail
from tests.fuzz.test_protocol_fuzz import json_values


def test_torn_lines_wait_and_garbage_is_counted(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    tail = TelemetryTail(f)
    assert tail.poll() == []  # no file yet
    f.write_bytes(b'{"ts": 1, "rank": 0, "type": "step", "step": 1, "loss": 3.0}\n{"ts": 2, "rank": 0, "ty')
    got = tail.poll()
    assert [r["step"] for r, _ in got] == [1]
    with open(f, "ab") as fh:
        fh.write(b'pe": "step", "step": 2, "loss": 2.5}\nnot json\n[1,2]\n')
    got = tail.poll()
    assert [r["step"] for r, _ in got] == [2]
    assert tail.summary.bad_lines == 2 and tail.summary.loss == 2.5
    assert got[-1][1] == f.stat().st_size - len(b"not json\n[1,2]\n")


def test_split_ranks_without_loss_keep_the_drafters_loss(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    lines = [
        {"ts": 1, "rank": 2, "type": "step", "step": 5, "loss": 1.25, "tokens_per_s": 100.0, "role": "drafter"},
        {"ts": 1, "rank": 0, "type": "step", "step": 5, "loss": None, "queue_depth": 3, "role": "target"},
    ]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tail = TelemetryTail(f)
    tail.poll()
    s = tail.summary
    assert s.step == 5 and s.loss == 1.25 and s.queue_depth == 3 and s.tokens_per_s == 100.0
    assert s.tps_history == [100.0]
    assert set(s.ranks) == {"0", "2"}


def _lines(tail: TelemetryTail) -> list[tuple[int, str]]:
    return [(r.line, r.reason) for r in tail.take_rejections()]


def test_each_hostile_line_is_rejected_by_itself_with_its_line_number_and_the_rest_goes_on(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    good = b'{"ts": 1, "rank": 0, "type": "step", "step": %d, "loss": 1.0}\n'
    bad = [
        b"[" * 100 + b"]" * 100,  # deep, and not an object
        b'{"type": "step", "x": ' + b"[" * 65 + b"]" * 65 + b"}",
        b'{"type": "step", "step": 9223372036854775808}',  # 2**63
        b'{"type": "eval", "nested": {"n": [1, 2, -9223372036854775809]}}',
        b'{"type": "step", "loss": 1e999}',
        b'{"type": "step", "step": "three"}',
        b'{"type": "step", "rank": 70000}',
        b'{"type": "step", "msg": "\xff\xfe"}',
        b'{"type": "step", "a": NaN}',
        b'{"no_type": 1}',
        b'{"type": "' + b"t" * 65 + b'"}',
        b'{"type": "x", "s": "' + b"a" * (1 << 20) + b'"}',  # longer than a line may be
    ]
    lines = []
    for i, b in enumerate(bad):
        lines += [good % i, b + b"\n"]
    lines.append(good % 99)
    f.write_bytes(b"".join(lines))
    tail = TelemetryTail(f)
    got = []
    while True:
        more = tail.poll()
        if not more and tail.offset == f.stat().st_size:
            break
        got += more
    assert [r["step"] for r, _ in got] == [*range(len(bad)), 99]
    rejected = _lines(tail)
    assert [n for n, _ in rejected] == [2 * i + 2 for i in range(len(bad))]
    reasons = dict(rejected)
    assert reasons[2] == "nesting deeper than 64" and reasons[4] == "nesting deeper than 64"
    assert "out of range" in reasons[6] and "$.step" in reasons[6]
    assert "out of range" in reasons[8] and "$.nested.n[2]" in reasons[8]
    assert "number out of range" in reasons[10]
    assert "step" in reasons[12] and "int" in reasons[12]
    assert "rank" in reasons[14]
    assert "UTF-8" in reasons[16]
    assert "not valid UTF-8 JSON" in reasons[18]
    assert "type" in reasons[20] and "type" in reasons[22]
    assert reasons[24] == f"longer than {1 << 20} bytes"
    assert tail.summary.bad_lines == len(bad) and tail.summary.step == 99
    assert TelemetryTail(f).take_rejections() == []  # nothing read yet, nothing refused yet
    assert (
        "telemetry line 2 rejected: nesting deeper than 64"
        == TelemetryRejection(line=2, offset=0, reason="nesting deeper than 64").describe()
    )


def test_an_endless_line_is_skipped_to_its_newline_as_one_rejection(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    with open(f, "wb") as fh:
        fh.write(b'{"type": "step", "step": 1}\n' + b"x" * (3 << 20))
    tail = TelemetryTail(f)
    assert [r["step"] for r, _ in tail.poll()] == [1]
    with open(f, "ab") as fh:
        fh.write(b"y" * (2 << 20) + b'\n{"type": "step", "step": 2}\n')
    got = []
    for _ in range(4):
        got += tail.poll()
    assert [r["step"] for r, _ in got] == [2]
    assert _lines(tail) == [(2, f"longer than {1 << 20} bytes")]


def test_a_last_line_without_a_newline_is_read_once_the_run_has_ended(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_bytes(b'{"type": "step", "step": 1}\n{"type": "done", "final_step": 1}')
    tail = TelemetryTail(f)
    assert [r["type"] for r, _ in tail.poll()] == ["step"]
    assert tail.poll() == []
    assert [r["type"] for r, _ in tail.poll(final=True)] == ["done"] and tail.summary.done
    assert tail.poll(final=True) == []


def test_line_numbers_count_from_the_start_of_the_file_when_resuming_at_an_offset(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    first = b'{"type": "step", "step": 1}\n\n{"type": "step", "step": 2}\n'
    f.write_bytes(first + b"junk\n")
    tail = TelemetryTail(f, offset=len(first))
    assert tail.poll() == []
    assert _lines(tail) == [(4, "not valid UTF-8 JSON (JSON is malformed: invalid character (byte 0))")]


def test_a_fifo_or_a_link_in_place_of_the_file_is_refused_without_blocking(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    os.mkfifo(f)
    tail = TelemetryTail(f)
    assert tail.poll() == [] and tail.poll() == []  # would block forever if opened as a file
    said = _lines(tail)
    assert len(said) == 1 and "not a regular file" in said[0][1], said  # said once
    f.unlink()
    secret = tmp_path / "elsewhere.jsonl"
    secret.write_text('{"type": "step", "step": 7}\n')
    f.symlink_to(secret)
    tail = TelemetryTail(f)
    assert tail.poll() == [] and tail.summary.step is None
    assert "symbolic link (not followed)" in _lines(tail)[0][1]
    f.unlink()
    f.write_text('{"type": "step", "step": 8}\n')
    assert [r["step"] for r, _ in tail.poll()] == [8]


def test_too_many_ranks_are_refused_past_the_cap(tmp_path: Path) -> None:
    from gpudeck.agents.observe.telemetry import MAX_RANKS

    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"type": "heartbeat", "rank": r}) + "\n" for r in range(MAX_RANKS + 3)))
    tail = TelemetryTail(f)
    assert len(tail.poll()) == MAX_RANKS
    assert len(tail.summary.ranks) == MAX_RANKS and len(tail.take_rejections()) == 3


KEYS = ["type", "ts", "rank", "step", "loss", "tokens_per_s", "mfu", "pid", "world_size", "role", "message", "final_step", "tau", "x"]
records = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), json_values, max_size=6).map(lambda d: d) | st.builds(
    lambda t, d: {"type": t, **d},
    st.sampled_from(["step", "manifest", "heartbeat", "eval", "done", "error", "checkpoint"]) | st.text(max_size=70),
    st.dictionaries(st.sampled_from(KEYS[1:]), json_values, max_size=6),
)
nested = st.builds(
    lambda n, inner: {"type": "step", "deep": json.loads("[" * n + json.dumps(inner) + "]" * n)}, st.integers(0, 300), json_values
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(json_values, records, nested, st.binary(max_size=300)), max_size=12), st.booleans())
def test_any_json_or_bytes_is_accepted_or_rejected_line_by_line_and_the_reader_goes_on(tmp_path: Path, items: list, final: bool) -> None:
    f = tmp_path / "fuzz.jsonl"
    chunks = []
    for it in items:
        if isinstance(it, bytes):
            chunks.append(it.replace(b"\n", b" ") + b"\n")
        else:
            chunks.append(json.dumps(it).encode() + b"\n")
    marker = b'{"type": "step", "step": 424242}\n'
    f.write_bytes(b"".join(chunks) + marker)
    tail = TelemetryTail(f)
    got = tail.poll(final=final)
    assert got and got[-1][0]["step"] == 424242 and tail.offset == f.stat().st_size
    accepted, rejected = len(got) - 1, tail.rejected
    assert accepted + rejected + sum(1 for c in chunks if not c.strip()) == len(chunks)
    for rec, _ in got:  # what is accepted can be stored: a dict with a str type, every int in 64 bits
        assert isinstance(rec, dict) and isinstance(rec["type"], str)
        msgspec.json.encode(rec)
    for r in tail.take_rejections():
        assert 1 <= r.line <= len(chunks) and r.reason
