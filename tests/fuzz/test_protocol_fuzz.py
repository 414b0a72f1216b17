"""Fuzzing the wire decoder and the framer: whatever bytes arrive, the answer is a request or a typed Error, never an exception.

Three sources of input: arbitrary bytes; every request type with every field
given a random JSON value (so each field's validation is reached); and valid
frames of every type with byte-level mutations (flips, inserts, deletes,
JSON punctuation, truncation). The framer is checked against a one-line model
under every chunking. CI-fast; ``tests/fuzz/atheris_agent.py`` runs the same
targets coverage-guided for as long as you like.
"""

from __future__ import annotations

import typing

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpudeck.agents.wire import protocol as p
from gpudeck.agents.wire.protocol import JSON_SPACE, MAX_FRAME, Error, FrameReader, decode_request, encode

REQUEST_TYPES: tuple[type, ...] = typing.get_args(p.Request)
ERROR_CODES = {"bad_json", "bad_message"}
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_spec = p.LaunchSpec(
    argv=["python", "-c", "print(1)"], name="n", gpus=[0, 1], env={"A": "b"}, cwd="/tmp", start="fresh", claims=p.Claims(gpus=2, note="x")
)
EXAMPLES: list[msgspec.Struct] = [
    p.Hello(request_id="h", client="fuzz", host_alias="gpu1"),
    p.Ping(request_id="p"),
    p.GetSnapshot(request_id="s"),
    p.WatchSnapshots(request_id="w", interval_s=0.5),
    p.Launch(request_id="l", spec=_spec),
    p.ListRuns(request_id="lr", limit=5),
    p.GetRun(request_id="g", run_id="r-0123abcd"),
    p.Stop(request_id="st", run_id="r-0123abcd", grace_s=3.0),
    p.GetEvents(request_id="e", after_seq=10, limit=100, follow=True),
    p.ReadOutput(request_id="o", run_id="r-0123abcd", offset=-100, max_bytes=1000, follow=False),
    p.GetMetrics(request_id="m", run_id="r-0123abcd", max_points=10),
    p.Cancel(request_id="c", target="w"),
    p.Preflight(request_id="pf", spec=_spec),
    p.ListLeftovers(request_id="ll", include_live=True),
    p.Reclaim(request_id="rc", pids=[1, 2], grace_s=1.0),
    p.Fingerprint(request_id="fp", python="python3"),
    p.RebuildEnv(request_id="rb", env=p.EnvFingerprint(python="python3", freeze=["a==1"])),
    p.VerifyRun(request_id="v", run_id="r-0123abcd"),
    p.TriageRun(request_id="t", run_id="r-0123abcd"),
]
FRAMES = [encode(m).rstrip(b"\n") for m in EXAMPLES]
TAGS = {cls: msgspec.inspect.type_info(cls).tag for cls in REQUEST_TYPES}  # type: ignore[attr-defined]


def test_the_examples_cover_every_request_type_and_round_trip() -> None:
    assert {type(m) for m in EXAMPLES} == set(REQUEST_TYPES), "a request type has no example: add it so it is fuzzed"
    for m, f in zip(EXAMPLES, FRAMES):
        assert decode_request(f) == m


def check(out: object, frame: bytes) -> None:
    """The decoder's contract for one frame."""
    if isinstance(out, Error):
        assert out.code in ERROR_CODES, out
        assert out.message and len(out.message) < 20_000, out
        assert len(out.request_id) <= 200
        if out.code == "bad_message":
            # the client can match the error to its request whenever it sent a usable request_id
            try:
                obj = msgspec.json.decode(frame)
            except (msgspec.DecodeError, RecursionError):
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("request_id"), str) and len(obj["request_id"]) <= 200:
                assert out.request_id == obj["request_id"]
        return
    assert isinstance(out, REQUEST_TYPES), type(out)
    # a decoded request is a well-typed value: it encodes and decodes to itself
    assert decode_request(encode(out).rstrip(b"\n")) == out  # type: ignore[arg-type]


@FAST
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_decode_to_a_request_or_a_typed_error(data: bytes) -> None:
    check(decode_request(data), data)


json_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False) | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=25
)


@st.composite
def field_garbage(draw: st.DrawFn) -> bytes:
    """A request of a real type whose fields (some, all, or unknown ones) hold random JSON values."""
    cls = draw(st.sampled_from(REQUEST_TYPES))
    names = [f.encode_name for f in msgspec.structs.fields(cls)]
    chosen = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    obj: dict = {"type": TAGS[cls]}
    for n in chosen:
        obj[n] = draw(json_values)
    if draw(st.booleans()):
        obj[draw(st.text(max_size=8))] = draw(json_values)
    return msgspec.json.encode(obj)


@FAST
@given(field_garbage())
def test_every_field_of_every_request_type_with_wrong_values_gets_a_typed_error_or_decodes(frame: bytes) -> None:
    check(decode_request(frame), frame)


PUNCT = [
    b"{",
    b"}",
    b"[",
    b"]",
    b'"',
    b":",
    b",",
    b"\\",
    b"\x00",
    b"\xff",
    b"1e999",
    b"-0",
    b"null",
    b"true",
    b"\\u0000",
    b"\\ud800",
    b'"type":"x"',
]


@st.composite
def mutated(draw: st.DrawFn, frames: list[bytes] = FRAMES) -> bytes:
    """A valid frame (of any type, or of those given) after a few byte-level edits."""
    data = bytearray(draw(st.sampled_from(frames)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "punct", "dup", "truncate"]))
        i = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            j = min(i, len(data) - 1)
            data[j] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        elif op == "punct":
            data[i:i] = draw(st.sampled_from(PUNCT))
        elif op == "dup":
            data[i:i] = data[i : i + draw(st.integers(1, 32))]
        elif op == "truncate":
            del data[i:]
    return bytes(data)


@FAST
@given(mutated())
def test_mutated_frames_of_every_type_decode_to_a_request_or_a_typed_error(frame: bytes) -> None:
    check(decode_request(frame), frame)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 900), st.sampled_from([b"[", b'{"a":']))
def test_nesting_below_the_recursion_limit_is_a_typed_error(depth: int, opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    for frame in (
        opener * depth + (b"1" if opener != b"[" else b"") + closer * depth,
        b'{"type":"ping","request_id":"n","x":' + opener * depth + b"1" * (opener != b"[") + closer * depth + b"}",
    ):
        check(decode_request(frame), frame)


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_json_gets_a_typed_error(depth: int) -> None:
    for frame in (b"[" * depth + b"]" * depth, b'{"type":"ping","request_id":"deep","x":' + b"[" * depth + b"]" * depth + b"}"):
        out = decode_request(frame)
        # a top-level array is valid JSON of the wrong shape (bad_message); nesting past the limit is bad_json
        assert isinstance(out, Error) and out.code in ("bad_json", "bad_message"), out


# ---------------------------------------------------------------------- the framer


def frames_model(stream: bytes, max_frame: int) -> list[bytes | None]:
    """What FrameReader must yield for a stream, whatever its chunking: one None per oversized line, non-blank lines trimmed of JSON's whitespace."""
    parts = stream.split(b"\n")
    out: list[bytes | None] = []
    for line in parts[:-1]:
        if len(line) > max_frame:
            out.append(None)
        elif line.strip(JSON_SPACE):
            out.append(line.strip(JSON_SPACE))
    if len(parts[-1]) > max_frame:
        out.append(None)  # an unfinished line is reported as soon as it is too long
    return out


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.binary(max_size=40) | st.sampled_from([b"\n", b"\n\n", b" \t\r\n", b"x" * 33]), max_size=30),
    st.lists(st.integers(1, 50), min_size=1, max_size=20),
    st.integers(1, 32),
)
def test_frame_reader_matches_its_model_under_any_chunking(pieces: list[bytes], cuts: list[int], max_frame: int) -> None:
    stream = b"".join(pieces)
    fr = FrameReader(max_frame=max_frame)
    got: list[bytes | None] = []
    pos = 0
    i = 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        got.extend(fr.feed(stream[pos : pos + step]))
        pos += step
        i += 1
    assert got == frames_model(stream, max_frame)
    tail = stream.split(b"\n")[-1]
    assert fr.pending == (len(tail) if len(tail) <= max_frame else 0)
    for f in got:
        assert f is None or 0 < len(f) <= max_frame


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.integers(1, 700))
def test_every_frame_the_framer_yields_from_noise_decodes_safely(noise: bytes, step: int) -> None:
    fr = FrameReader(max_frame=MAX_FRAME)
    for i in range(0, len(noise), step):
        for f in fr.feed(noise[i : i + step]):
            if f is not None:
                check(decode_request(f), f)
