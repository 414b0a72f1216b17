"""Fuzzing a live agent process over its socket: every frame is answered (a reply or a typed error), nothing hangs, others are served.

Frames are random bytes, every request field with random values, and mutated
valid requests — only of request types that cannot start or signal anything
(no Launch, Preflight, Reclaim, Fingerprint, RebuildEnv: a fuzzer must never
run commands or kill processes on the machine it runs on); any frame that
decodes to another type is skipped before it is sent. The agent has no runs,
so a Stop or GetRun with a random id can only be refused. A second client
pings all along; its worst latency is the "serves other clients meanwhile"
figure.
"""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from gpudeck.agents.wire import protocol as p
from gpudeck.agents.wire.protocol import Error, decode_request
from tests.agent_harness import AgentProc
from tests.fuzz.test_protocol_fuzz import FRAMES, TAGS, json_values, mutated
from tests.sshd_harness import short_tmp

pytestmark = pytest.mark.slow
SAFE = (
    p.Hello,
    p.Ping,
    p.GetSnapshot,
    p.ListRuns,
    p.GetRun,
    p.Stop,
    p.GetEvents,
    p.ReadOutput,
    p.GetMetrics,
    p.Cancel,
    p.ListLeftovers,
    p.VerifyRun,
)
STREAMS = (p.WatchSnapshots, p.GetEvents, p.ReadOutput)
SAFE_FRAMES = [f for f in FRAMES if isinstance(decode_request(f), SAFE)]
REPLY_TIMEOUT_S = 10.0
KNOWN_CODES = {"bad_json", "bad_message", "bad_request", "not_found", "unsupported_version", "frame_too_large", "permission_denied"}


class Pinger(threading.Thread):
    """Another client that pings the agent every 50 ms and records each round trip."""

    def __init__(self, sock_path: Path) -> None:
        super().__init__(daemon=True)
        self.sock_path = sock_path
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(REPLY_TIMEOUT_S)
        s.connect(str(self.sock_path))
        f = s.makefile("rb")
        i = 0
        while not self.stop_flag.is_set():
            i += 1
            t = time.monotonic()
            try:
                s.sendall(json.dumps({"type": "ping", "request_id": f"bg{i}"}).encode() + b"\n")
                line = f.readline()
                if json.loads(line).get("type") != "pong":
                    self.failures.append(line.decode(errors="replace"))
            except (OSError, ValueError) as exc:
                self.failures.append(repr(exc))
                return
            self.latencies.append(time.monotonic() - t)
            time.sleep(0.05)
        s.close()


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[AgentProc, Pinger]]:
    home = short_tmp("gd-fz-")
    a = AgentProc(home).start()
    pinger = Pinger(a.state_dir / "sock" / "agent.sock")
    pinger.start()
    try:
        yield a, pinger
    finally:
        pinger.stop_flag.set()
        pinger.join(15)
        a.stop()
        a.stop_autostarted()
        shutil.rmtree(home, ignore_errors=True)


def exchange(a: AgentProc, frame: bytes) -> list[dict]:
    """Send one frame, then a sentinel ping, on a fresh connection; return the replies to the frame once all are in."""
    expected = decode_request(frame)
    rid = None if isinstance(expected, Error) else expected.request_id
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(REPLY_TIMEOUT_S)
    s.connect(str(a.state_dir / "sock" / "agent.sock"))
    try:
        s.sendall(frame + b"\n" + b'{"type":"ping","request_id":"__sentinel__"}\n')
        f = s.makefile("rb")
        replies: list[dict] = []
        sentinel = False
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = f.readline()
            assert line, f"the agent closed the connection after {frame[:200]!r} (replies so far: {replies})"
            msg = json.loads(line)
            if msg.get("request_id", "") == "__sentinel__" and msg.get("type") == "pong" and rid != "__sentinel__":
                sentinel = True
            else:
                replies.append(msg)
            # a bad frame is answered before the next frame is read; a request's reply carries its request_id
            answered = bool(replies) if rid is None else any(r.get("request_id", "") == rid for r in replies)
            if sentinel and answered:
                return replies
        raise AssertionError(f"no answer within {REPLY_TIMEOUT_S} s to {frame[:200]!r}: {replies}")
    finally:
        s.close()


def check_replies(frame: bytes, replies: list[dict]) -> None:
    expected = decode_request(frame)
    if isinstance(expected, Error):
        assert replies and replies[0]["type"] == "error" and replies[0]["code"] == expected.code, (frame[:200], replies)
    for r in replies:
        msgspec.json.decode(json.dumps(r).encode(), type=p.Reply)  # every line is a well-formed reply
        if r["type"] == "error":
            assert r["code"] in KNOWN_CODES, f"{r['code']}: {r['message']} (for {frame[:200]!r})"
            assert r["message"]


def _safe(frame: bytes) -> bool:
    out = decode_request(frame)
    return isinstance(out, Error) or isinstance(out, SAFE) and not (isinstance(out, STREAMS) and getattr(out, "follow", False))


@st.composite
def safe_field_garbage(draw: st.DrawFn) -> bytes:
    cls = draw(st.sampled_from(SAFE))
    names = [f.encode_name for f in msgspec.structs.fields(cls)]
    obj: dict = {"type": TAGS[cls]}
    for n in draw(st.lists(st.sampled_from(names), unique=True)) if names else []:
        obj[n] = draw(json_values)
    return msgspec.json.encode(obj)


def _strip(b: bytes) -> bytes:
    return b.replace(b"\n", b" ")


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.one_of(st.binary(min_size=1, max_size=2000).map(_strip), safe_field_garbage(), mutated().map(_strip)))
@example(frame=b"\x0b0")  # once answered bad_message: the reader trimmed the vertical tab that JSON does not allow
def test_every_fuzzed_frame_is_answered_and_the_agent_keeps_serving(live, frame: bytes) -> None:
    a, pinger = live
    assume(frame.strip(p.JSON_SPACE) and _safe(frame))
    replies = exchange(a, frame)
    check_replies(frame, replies)
    assert a.proc is not None and a.proc.poll() is None, "the agent died"
    assert not pinger.failures, pinger.failures


@FUZZ
@given(mutated(SAFE_FRAMES).map(_strip))
def test_mutated_safe_requests_are_answered(live, frame: bytes) -> None:
    a, pinger = live
    assume(frame.strip(p.JSON_SPACE) and _safe(frame))
    check_replies(frame, exchange(a, frame))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(st.binary(min_size=1, max_size=300).map(_strip), safe_field_garbage(), mutated(SAFE_FRAMES).map(_strip)),
        min_size=1,
        max_size=25,
    )
)
def test_many_fuzzed_frames_pipelined_on_one_connection_are_all_answered(live, frames: list[bytes]) -> None:
    a, _ = live
    frames = [f for f in frames if f.strip(p.JSON_SPACE) and _safe(f)]
    assume(frames)
    decoded = [decode_request(f) for f in frames]
    bad = sum(1 for d in decoded if isinstance(d, Error))
    rids = {d.request_id for d in decoded if not isinstance(d, Error)} - {"__sentinel__"}
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(REPLY_TIMEOUT_S)
    s.connect(str(a.state_dir / "sock" / "agent.sock"))
    try:
        s.sendall(b"".join(f + b"\n" for f in frames) + b'{"type":"ping","request_id":"__sentinel__"}\n')
        f = s.makefile("rb")
        replies: list[dict] = []
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            assert time.monotonic() < deadline, f"not every frame was answered within {REPLY_TIMEOUT_S} s: {replies}"
            line = f.readline()
            assert line, f"the agent closed the connection (replies so far: {replies})"
            replies.append(json.loads(line))
            decode_errors = sum(1 for r in replies if r.get("type") == "error" and r.get("code") in ("bad_json", "bad_message"))
            answered = {r.get("request_id", "") for r in replies}
            if any(r.get("request_id") == "__sentinel__" for r in replies) and decode_errors >= bad and rids <= answered:
                break
    finally:
        s.close()
    assert a.proc is not None and a.proc.poll() is None


def test_half_sent_frames_and_endless_lines_do_not_starve_other_clients(live) -> None:
    a, pinger = live
    path = str(a.state_dir / "sock" / "agent.sock")
    idle = []
    for i in range(150):  # clients that send half a request and go quiet
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(b'{"type":"ping","request_id":"half' + str(i).encode())
        idle.append(s)
    flood = socket.socket(socket.AF_UNIX)
    flood.connect(path)
    flood.settimeout(10)
    try:
        chunk = b"x" * (1 << 16)
        t0 = time.monotonic()
        for _ in range(64):  # 4 MiB of one endless line: discarded as it comes, never buffered
            flood.sendall(chunk)
        assert json.loads(flood.makefile("rb").readline())["code"] == "frame_too_large"
        replies = exchange(a, b'{"type":"ping","request_id":"fresh"}')
        assert [r["type"] for r in replies] == ["pong"]
        took = time.monotonic() - t0
    finally:
        flood.close()
        for s in idle:
            s.close()
    rss = _rss(a.pid)
    assert rss < 400 << 20, f"agent RSS {rss >> 20} MiB after the flood"
    assert a.proc is not None and a.proc.poll() is None
    print(f"\n150 half-sent clients + a 4 MiB endless line: a new client was served within {took:.2f} s; agent RSS {rss >> 20} MiB")


def test_a_deeply_nested_frame_gets_a_typed_error_and_the_connection_stays_up(live) -> None:
    a, _ = live
    replies = exchange(a, b'{"type":"ping","request_id":"deep","x":' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert replies and replies[0]["type"] == "error" and replies[0]["code"] == "bad_json", replies


def test_zz_fuzz_figures(live) -> None:
    """Runs last in this module: the other client was answered throughout, within a bound."""
    a, pinger = live
    assert not pinger.failures, pinger.failures
    lat = sorted(pinger.latencies)
    assert lat, "the background client never got an answer"
    p99 = lat[int(0.99 * (len(lat) - 1))]
    print(
        f"\nbackground client during the agent fuzz: {len(lat)} pings, median {statistics.median(lat) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms"
    )
    assert lat[-1] < 5.0


def _rss(pid: int) -> int:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) * 1024
    return 0
