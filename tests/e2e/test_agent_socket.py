"""The agent's socket under bad input, other users, and the dial bridge; all real processes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpudeck.agents.wire.errors import BadRequest, NotFound, RemoteError
from gpudeck.agents.wire.protocol import GetEvents, GetRun, GetSnapshot, Launch, LaunchSpec, Ping, Pong, Snapshot, Stop, WatchSnapshots
from tests.agent_harness import ROOT, AgentProc, run_state, wait_for


def raw_conn(agent: AgentProc) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(agent.state_dir / "sock" / "agent.sock"))
    return s


def read_line(s: socket.socket, buf: bytearray) -> dict:
    while b"\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, "agent closed the connection"
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def test_socket_is_private(agent: AgentProc) -> None:
    sock = agent.state_dir / "sock" / "agent.sock"
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(agent.state_dir.stat().st_mode) == 0o700


def test_hostile_frames_get_typed_errors_and_the_connection_survives(agent: AgentProc) -> None:
    s = raw_conn(agent)
    buf = bytearray()
    cases = [
        (b"{not json\n", "bad_json"),
        (b'{"type":"rm_rf","request_id":"a"}\n', "bad_message"),
        (b'{"type":"stop","run_id":42,"request_id":"b"}\n', "bad_message"),
        (b'{"type":"launch","request_id":"c","spec":{"argv":[]}}\n', "bad_request"),
        (b'{"type":"launch","request_id":"d","spec":{"argv":["a\\u0000b"]}}\n', "bad_request"),
        (b'{"type":"get_run","request_id":"e","run_id":"r-missing"}\n', "not_found"),
        (b'{"type":"hello","request_id":"f","version":999}\n', "unsupported_version"),
        (b'{"type":"cancel","request_id":"g","target":"nothing"}\n', "bad_request"),
        (b'{"type":"stop","request_id":"h","run_id":"x","grace_s":-5}\n', "bad_request"),
        (b"\xff\xfe\x00garbage\n", "bad_json"),
        (b'"just a string"\n', "bad_message"),
    ]
    for frame, code in cases:
        s.sendall(frame)
        reply = read_line(s, buf)
        assert reply["type"] == "error" and reply["code"] == code, (frame, reply)
        assert reply["message"]
    # an oversized frame (> 1 MiB) is discarded and answered; the connection stays usable
    s.sendall(b'{"type":"ping","request_id":"' + b"x" * (2 << 20) + b'"}\n')
    reply = read_line(s, buf)
    assert reply["code"] == "frame_too_large"
    s.sendall(b'{"type":"ping","request_id":"after"}\n')
    reply = read_line(s, buf)
    assert reply == {"type": "pong", "request_id": "after", "ts": reply["ts"]}
    s.close()
    assert agent.proc is not None and agent.proc.poll() is None


def test_random_bytes_never_kill_the_agent(agent: AgentProc) -> None:
    import random

    rng = random.Random(7)
    for _ in range(30):
        s = raw_conn(agent)
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 5000)))
        try:
            s.sendall(junk + b"\n")
        except OSError:
            pass
        s.close()
    s = raw_conn(agent)
    buf = bytearray()
    s.sendall(b'{"type":"ping","request_id":"ok"}\n')
    assert read_line(s, buf)["type"] == "pong"
    s.close()


def test_other_users_are_refused(agent: AgentProc) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as another uid")
    probe = (
        "import os, socket, sys, json\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except PermissionError:\n"
        "    print('EACCES'); sys.exit(0)\n"
        # the agent answers at connect time, before any request: read that first
        "print(s.recv(4096).decode().strip())\n"
    )
    sock = agent.state_dir / "sock" / "agent.sock"
    out = subprocess.run([sys.executable, "-c", probe, str(sock)], capture_output=True, text=True, timeout=20)
    assert out.stdout.strip() == "EACCES", out  # the 0700 folder keeps them out
    # even with the folder opened up by mistake, the peer-credential check refuses them
    dirs = [agent.home, agent.state_dir, sock.parent]
    modes = [d.stat().st_mode for d in dirs]
    try:
        for d in dirs:
            os.chmod(d, 0o755)
        os.chmod(sock, 0o666)
        out = subprocess.run([sys.executable, "-c", probe, str(sock)], capture_output=True, text=True, timeout=20)
        reply = json.loads(out.stdout)
        assert reply["type"] == "error" and reply["code"] == "permission_denied", out
    finally:
        for d, m in zip(dirs, modes):
            os.chmod(d, stat.S_IMODE(m))
        os.chmod(sock, 0o600)


def test_dial_bridges_and_starts_the_agent(gpudeck_home: Path) -> None:
    env = {**os.environ, "GPUDECK_HOME": str(gpudeck_home), "PYTHONPATH": str(ROOT)}
    requests = b'{"type":"hello","request_id":"h","version":1}\n{"type":"ping","request_id":"p"}\n{"type":"list_runs","request_id":"l"}\n'
    out = subprocess.run(
        [sys.executable, "-m", "gpudeck.console.cli.main", "agent", "dial"], input=requests, capture_output=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    replies = [json.loads(ln) for ln in out.stdout.splitlines()]
    assert {r["request_id"]: r["type"] for r in replies} == {"h": "hello_reply", "p": "pong", "l": "run_list"}
    hello = next(r for r in replies if r["type"] == "hello_reply")
    # the agent it started is detached and still serving; stop it by its pid
    try:
        st = subprocess.run(
            [sys.executable, "-m", "gpudeck.console.cli.main", "agent", "status", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        )
        assert json.loads(st.stdout)["pid"] == hello["pid"]
    finally:
        os.kill(hello["pid"], 15)
        wait_for(
            lambda: not os.path.exists(f"/proc/{hello['pid']}") or open(f"/proc/{hello['pid']}/stat").read().split()[2] == "Z",
            what="the agent to exit",
        )


def test_event_stream_follows_new_events_in_order(agent: AgentProc) -> None:
    async def go() -> list[int]:
        c = await agent.client()
        seen: list = []
        try:
            stream = c.stream(GetEvents(after_seq=0, follow=True))

            async def consume() -> None:
                async for batch in stream:
                    seen.extend(batch.events)  # type: ignore[attr-defined]
                    if any(e.kind == "run_state" and e.data.get("state") == "succeeded" for e in seen):
                        return

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.2)
            await c.request(Launch(spec=LaunchSpec(argv=["true"], cwd="/")))
            await asyncio.wait_for(task, 20)
            assert (await c.request(Ping())).ts > 0  # type: ignore[attr-defined]
            with pytest.raises(NotFound):
                await c.request(GetRun(run_id="r-none"))
        finally:
            await c.close()
        return [e.seq for e in seen]

    seqs = asyncio.run(go())
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_agent_stop_leaves_runs_running_for_the_next_agent(agent: AgentProc) -> None:
    rid = agent.cli_json("launch", "--", "sleep", "300")["id"]
    out = agent.cli("agent", "stop").stdout
    assert f"agent {agent.pid} stopped" in out
    assert agent.proc is not None and agent.proc.wait(5) == 0
    st = agent.cli("agent", "status", check=False)
    assert st.returncode == 3 and "not running" in st.stdout
    agent.start()
    assert next(r for r in agent.cli_json("runs") if r["id"] == rid)["state"] == "running"


def test_every_request_type_has_a_handler_in_the_dispatch_table() -> None:
    from gpudeck.agents.server.daemon import _HANDLERS
    from gpudeck.agents.wire.protocol import Request

    assert set(_HANDLERS) == set(Request.__args__), "a request type without a handler (or a handler for no request)"  # type: ignore[attr-defined]


def test_a_held_journal_write_lock_delays_no_ping_or_snapshot_and_the_queued_events_follow(agent: AgentProc, tmp_path: Path) -> None:
    """The journal's disk is 'slow' (another connection holds its write lock): the agent keeps answering; what the
    supervisor journaled meanwhile is committed, in order and gapless, once the lock is let go."""
    import sqlite3
    import time

    from gpudeck.agents.wire.protocol import GetSnapshot

    gate = tmp_path / "go"
    rid = agent.cli_json("launch", "--", "sh", "-c", f"while [ ! -e '{gate}' ]; do sleep 0.05; done; exit 3")["id"]
    wait_for(lambda: run_state(agent, rid) == "running", timeout=30, what="the run to start")
    held = sqlite3.connect(agent.state_dir / "journal.db", isolation_level=None, timeout=10)
    held.execute("BEGIN IMMEDIATE")
    released = False
    gate.touch()  # the run ends now, while its end cannot be written

    async def go() -> tuple[list[float], str]:
        c = await agent.client()
        try:
            rtts = []
            t_end = time.monotonic() + 3.0  # the run ends (and its end is journaled) while the lock is held
            state = ""
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                await c.request(Ping(), timeout=30)
                rtts.append(time.monotonic() - t0)
                snap = await c.request(GetSnapshot(), timeout=30)
                state = next((r.state for r in snap.runs if r.id == rid), "ended")  # type: ignore[attr-defined]
                await asyncio.sleep(0.05)
            return rtts, state
        finally:
            await c.close()

    try:
        rtts, state = asyncio.run(go())
        assert not released
        print(
            f"\nwith the journal's write lock held 3 s: {len(rtts)} pings, slowest {max(rtts) * 1000:.1f} ms; the run is {state} in the last snapshot"
        )
        assert state == "ended", "the run's end was not seen while its record waited for the disk"
    finally:
        held.execute("COMMIT")
        held.close()
        released = True
    row = wait_for(
        lambda: (r := next(r for r in agent.cli_json("runs") if r["id"] == rid))["state"] == "failed" and r,
        what="the queued end to be committed",
    )
    assert row["exit_code"] == 3
    db = sqlite3.connect(agent.state_dir / "journal.db")
    seqs = [s for (s,) in db.execute("SELECT seq FROM events ORDER BY seq")]
    db.close()
    assert seqs == list(range(1, len(seqs) + 1))


def test_agent_status_says_when_the_gpus_are_simulated(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpudeck agent status` on a host with GPUDECK_SIMULATE_GPUS said "GPUs: NVML ok"; the Hello now says simulated."""
    from tests.agent_harness import teardown_agent

    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "2:H200:141")
    a = AgentProc(gpudeck_home).start()
    try:
        out = a.cli("agent", "status").stdout
        assert "GPUs: SIMULATED" in out and "NVML ok" not in out, out
        assert json.loads(a.cli("agent", "status", "--json").stdout)["simulated"] is True
    finally:
        teardown_agent(a)


def test_a_snapshot_right_after_a_launch_or_a_stop_shows_it_though_the_last_sample_is_young(agent: AgentProc) -> None:
    """GetSnapshot answers from the agent's latest sample while it is young, but never one older than a state change:
    a launch and a stop are in the very next snapshot; max_age_s=0 gets a sample made for the request."""

    async def snap(c, **kw) -> Snapshot:  # type: ignore[no-untyped-def]
        got = await c.request(GetSnapshot(**kw), timeout=30)
        assert isinstance(got, Snapshot)
        return got

    async def go() -> None:
        c = await agent.client()
        try:
            # a warm cache: two snapshots in a row are one sample (each answered under its own request id)
            for _ in range(20):
                a, b = await snap(c, request_id="first"), await snap(c, request_id='second "quoted" é')
                if a.ts == b.ts:
                    break
            assert a.ts == b.ts, "the second snapshot was sampled again though nothing changed"
            assert (a.request_id, b.request_id) == ("first", 'second "quoted" é')
            fresh = await snap(c, max_age_s=0)
            assert fresh.ts > b.ts, "max_age_s=0 was answered from an earlier sample"
            await snap(c)  # the cache is warm again
            launched = await c.request(
                Launch(spec=LaunchSpec(argv=[sys.executable, "-c", "import time; time.sleep(60)"], name="fresh")), timeout=60
            )
            rid = launched.run.id  # type: ignore[attr-defined]
            after = await snap(c)
            assert any(r.id == rid for r in after.runs), "a snapshot right after a launch did not show the run"
            assert after.last_seq > b.last_seq, "the launch's committed events are not in the snapshot's last_seq"
            await snap(c)
            await c.request(Stop(run_id=rid, grace_s=1), timeout=60)
            stopped = await snap(c)
            assert all(r.id != rid for r in stopped.runs), "a snapshot right after a stop still showed the run live"
            with pytest.raises(BadRequest, match="max_age_s"):
                await snap(c, max_age_s=-1)
            assert (await snap(c, request_id="still up")).request_id == "still up"
        finally:
            await c.close()

    asyncio.run(go())


def test_a_fingerprint_probes_under_the_environment_the_run_will_get_and_a_bad_one_is_refused(agent: AgentProc) -> None:
    """The cross-node gate sends the run's environment with Fingerprint: the probe sees it (an LD_LIBRARY_PATH given with
    --env decides which libnccl it finds, as for the run); a name a process cannot be given is a typed refusal."""
    from gpudeck.agents.wire.protocol import Fingerprint, FingerprintReply

    async def go() -> None:
        c = await agent.client()
        try:
            got = await c.request(
                Fingerprint(python=sys.executable, env={"NCCL_DEBUG": "INFO", "TORCH_SHOW_CPP_STACKTRACES": "1"}), timeout=120
            )
            assert isinstance(got, FingerprintReply)
            assert got.env.dist_env.get("NCCL_DEBUG") == "INFO" and got.env.dist_env.get("TORCH_SHOW_CPP_STACKTRACES") == "1"
            plain = await c.request(Fingerprint(python=sys.executable), timeout=120)
            assert isinstance(plain, FingerprintReply) and "NCCL_DEBUG" not in plain.env.dist_env
            with pytest.raises(BadRequest, match="not valid"):
                await c.request(Fingerprint(python=sys.executable, env={"A=B": "x"}), timeout=30)
            assert isinstance(await c.request(Ping(), timeout=30), object)  # the connection survives the refusal
        finally:
            await c.close()

    asyncio.run(go())


def test_a_snapshot_stream_goes_out_at_the_phase_the_console_asked_for_and_a_negative_phase_is_refused(agent: AgentProc) -> None:
    """WatchSnapshots.phase_s moves the stream's instants off the whole interval (a big fleet's console spreads its
    hosts over a few phases, console/fleet/fleet.py SNAPSHOT_GROUP): each snapshot is sampled at a whole interval plus
    the phase. A late wake-up on a busy machine only adds to the offset, so the earliest of several is the one read."""

    interval = 0.3  # not a multiple of the agent's 0.5 s supervision tick, which shares the sampler thread

    async def offsets(c, phase: float) -> list[float]:  # type: ignore[no-untyped-def]
        got: list[float] = []
        stream = c.stream(WatchSnapshots(interval_s=interval, phase_s=phase))
        try:
            async for snap in stream:
                got.append(snap.ts)
                if len(got) == 6:
                    break
        finally:
            await stream.aclose()
        # the first goes out at once; the others on the grid: how far each is from a whole interval plus the phase
        # (either side: a clock step must not turn an on-time sample into one a whole interval late)
        return sorted(min(o, interval - o) for o in ((ts - phase) % interval for ts in got[1:]))

    async def go() -> None:
        c = await agent.client()
        try:
            for phase in (0.15, 0.05, 1.0):  # 1.0 is taken modulo the interval: 0.1
                nearest = (await offsets(c, phase))[0]
                assert nearest < 0.07, f"phase {phase}: every snapshot came {nearest:.3f} s or more off its instant"
            # negative: refused by the agent; NaN and infinity go out as JSON null and are refused as not understood
            for bad in (-0.1, float("nan"), float("inf")):
                with pytest.raises((BadRequest, RemoteError), match="phase_s"):
                    async for _ in c.stream(WatchSnapshots(interval_s=interval, phase_s=bad)):
                        pass
            assert isinstance(await c.request(Ping(), timeout=30), Pong)  # the connection is still served
        finally:
            await c.close()

    asyncio.run(go())
