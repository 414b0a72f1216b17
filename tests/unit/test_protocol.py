"""Unit tests of the wire protocol: round trips, typed errors for every kind of bad input, framing."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gpudeck.agents.wire.protocol import (
    JSON_SPACE,
    MAX_FRAME,
    Error,
    FrameReader,
    GetEvents,
    Launch,
    LaunchSpec,
    Stop,
    decode_request,
    encode,
)


def test_round_trip_keeps_every_field() -> None:
    msg = Launch(request_id="r1", spec=LaunchSpec(argv=["python", "-c", "print(1)"], gpus=[0, 3], env={"A": "b"}, name="n"))
    back = decode_request(encode(msg).strip())
    assert back == msg


def test_bad_inputs_get_typed_errors() -> None:
    assert decode_request(b"{not json").code == "bad_json"  # type: ignore[union-attr]
    e = decode_request(b'{"type": "launch_rockets", "request_id": "x"}')
    assert isinstance(e, Error) and e.code == "bad_message" and e.request_id == "x"
    e = decode_request(b'{"type": "stop", "run_id": 7, "request_id": "y"}')
    assert isinstance(e, Error) and e.code == "bad_message" and "run_id" in e.message and e.request_id == "y"
    e = decode_request(b'{"type": "launch", "spec": {"argv": "rm -rf /"}}')
    assert isinstance(e, Error) and e.code == "bad_message"
    e = decode_request(b"[1, 2, 3]")
    assert isinstance(e, Error)
    assert isinstance(decode_request(b'{"type": "stop", "run_id": "r-1"}'), Stop)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000))
def test_decoder_never_raises_on_bytes(data: bytes) -> None:
    out = decode_request(data)
    assert isinstance(out, (Error, msgspec.Struct))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(["hello", "ping", "launch", "stop", "get_events", "read_output", "cancel", "get_run", "watch_snapshots", "x"]),
    st.dictionaries(
        st.sampled_from(["request_id", "spec", "run_id", "after_seq", "offset", "follow", "grace_s", "target", "argv"]),
        json_values,
        max_size=5,
    ),
)
def test_decoder_on_structured_garbage(tag: str, fields: dict) -> None:
    line = msgspec.json.encode({"type": tag, **fields})
    out = decode_request(line)
    assert isinstance(out, (Error, msgspec.Struct))


def test_frame_reader_splits_and_bounds() -> None:
    fr = FrameReader(max_frame=10)
    assert fr.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert fr.feed(b":2}\n\n") == [b'{"b":2}']
    # an oversized frame is reported once, discarded to its newline, and the stream goes on
    assert fr.feed(b"x" * 25) == [None]
    assert fr.feed(b"y" * 25) == []
    assert fr.feed(b'zz\n{"c":3}\n') == [b'{"c":3}']
    assert fr.pending == 0


def test_frame_reader_trims_json_whitespace_only() -> None:
    """A vertical tab or form feed is not JSON whitespace: the frame keeps it and is answered as bad JSON, not as a
    well-formed value of the wrong shape (found by tests/fuzz/test_agent_fuzz.py with the frame b"\\x0b0")."""
    fr = FrameReader(max_frame=MAX_FRAME)
    assert fr.feed(b" \t0\r\n") == [b"0"]
    assert fr.feed(b"\x0b0\n") == [b"\x0b0"]
    assert fr.feed(b'\x0c{"type": "ping"}\n\x0b\n') == [b'\x0c{"type": "ping"}', b"\x0b"]
    for frame in (b"\x0b0", b"\x0b", b'\x0c{"type": "ping"}'):
        out = decode_request(frame)
        assert isinstance(out, Error) and out.code == "bad_json", (frame, out)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=30).filter(lambda b: b"\n" not in b and b.strip(JSON_SPACE) == b), max_size=10),
    st.integers(1, 7),
)
def test_frame_reader_any_chunking(lines: list[bytes], step: int) -> None:
    stream = b"".join(ln + b"\n" for ln in lines)
    fr = FrameReader(max_frame=MAX_FRAME)
    got: list = []
    for i in range(0, len(stream), step):
        got.extend(fr.feed(stream[i : i + step]))
    assert got == lines


def test_get_events_defaults() -> None:
    e = decode_request(b'{"type": "get_events"}')
    assert isinstance(e, GetEvents) and e.after_seq == 0 and e.follow is False


def test_a_decoded_snapshots_leaf_lists_leave_the_collector_after_one_look() -> None:
    """A console following 1,024 hosts holds every host's latest snapshot: its command lines and per-GPU process lists
    are tuples, which a young collection stops tracking, so the middle collections do not walk them (bench/RESULTS.md
    37-cells). An old agent's or journal's arrays decode into them the same way."""
    import gc

    from gpudeck.agents.wire.protocol import Gpu, GpuProcess, NamespaceInfo, ProcInfo, Snapshot, decode_reply, encode

    snap = Snapshot(
        host="h",
        ts=1.0,
        epoch="e",
        gpus=[
            Gpu(index=0, memory_used=1, processes=(GpuProcess(pid=5, gpu=0, cmdline=("python", "train.py")),)),
            Gpu(index=1, memory_used=0),
        ],
        processes=[ProcInfo(pid=5, cmdline=("python", "train.py"))],
        namespace=NamespaceInfo(evidence=("pid:[1]",)),
    )
    got = decode_reply(encode(snap))
    assert isinstance(got, Snapshot)
    leaves = [got.gpus[0].processes, got.gpus[0].processes[0].cmdline, got.processes[0].cmdline]
    assert all(type(x) is tuple for x in leaves) and got.gpus[1].processes == ()
    assert got.namespace is not None and got.namespace.evidence == ("pid:[1]",)
    gc.collect(0)
    assert not any(gc.is_tracked(x) for x in leaves)
    old = b'{"type":"snapshot","host":"h","ts":1.0,"epoch":"e","gpus":[{"index":0,"memory_used":1,"processes":[{"pid":5,"gpu":0,"cmdline":["a"]}]}]}'
    assert decode_reply(old).gpus[0].processes[0].cmdline == ("a",)  # type: ignore[union-attr]
