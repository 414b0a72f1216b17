"""What a run controls, through a real agent: its name, output and telemetry holding lone surrogates and invalid
UTF-8, and its exit.json rewritten with hostile content. The run is supervised and journaled, `gpudeck runs` and
`history` list it, its end gets a sane cause, and supervision of every other run goes on."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import GetEvents, ListRuns
from tests.agent_harness import AgentProc, run_state, wait_for

pytestmark = pytest.mark.slow
PY = sys.executable
FFFD = "\ufffd"

# a run that prints invalid UTF-8 and a lone surrogate escape, and writes telemetry holding them
LOUD = r"""
import json, os, sys, time
sys.stdout.buffer.write(b"bad bytes \xed\xa0\x80 \xff\xfe and a lone escape \\ud800 end\n")
sys.stdout.flush()
path = os.path.join(os.environ["GPUDECK_RUN_DIR"], "telemetry.jsonl")
with open(path, "ab") as fh:
    fh.write(json.dumps({"type": "manifest", "config_hash": "h\ud800", "role": "\udcff"}).encode() + b"\n")
    fh.write(json.dumps({"type": "step", "step": 1, "loss": 1.5, "note": "\ud800\udc00 ok"}).encode() + b"\n")
    fh.write(b'{"type": "step", "step": 2, "loss": 1.25, "note": "\xff"}\n')
    fh.write(json.dumps({"type": "step", "step": 3, "loss": 1.0}).encode() + b"\n")
time.sleep(1.0)
"""


def _raw_launch(a: AgentProc, name: str, argv: list[str]) -> dict:
    """A Launch whose JSON holds lone-surrogate escapes, as Python's json.dumps writes a surrogateescape'd string."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(a.state_dir / "sock" / "agent.sock"))
    s.settimeout(60)
    try:
        s.sendall(json.dumps({"type": "launch", "request_id": "L1", "spec": {"argv": argv, "name": name}}).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            assert chunk, "the agent closed the connection"
            buf += chunk
        return json.loads(buf)
    finally:
        s.close()


def _runs(a: AgentProc) -> dict[str, dict]:
    return {r["id"]: r for r in a.cli_json("runs")}


def test_a_run_whose_name_output_and_telemetry_hold_lone_surrogates_is_supervised_journaled_and_listed(agent: AgentProc) -> None:
    reply = _raw_launch(agent, "sur\ud800rogate", [PY, "-c", LOUD])
    assert reply["type"] == "launch_reply", reply
    rid = reply["run"]["id"]
    assert reply["run"]["name"] == f"sur{FFFD}rogate"
    # and through the CLI: an argument with invalid UTF-8 (a surrogateescape'd string in the client's argv)
    cli_rid = agent.cli_json("launch", "--name", "cli\udcffname", "--", PY, "-c", "print('\\udcff'.encode('utf-8', 'surrogateescape'))")[
        "id"
    ]
    wait_for(lambda: all(run_state(agent, r) == "succeeded" for r in (rid, cli_rid)), timeout=60, what="both runs to end")
    runs = _runs(agent)
    print(f"\nruns: {runs[rid]['name']!r} {runs[rid]['state']}; {runs[cli_rid]['name']!r} {runs[cli_rid]['state']}")
    assert runs[cli_rid]["name"] == f"cli{FFFD}name"
    human = agent.cli("runs").stdout
    assert rid in human and cli_rid in human
    tail = agent.cli("tail", rid).stdout
    assert "bad bytes" in tail and "end" in tail
    hist = {r["id"]: r for r in agent.cli_json("history")}
    assert hist[rid]["state"] == "succeeded" and hist[rid]["name"] == f"sur{FFFD}rogate"
    assert hist[cli_rid]["state"] == "succeeded"
    assert rid in agent.cli("history").stdout
    show = json.loads(agent.cli("show", rid, "--json").stdout)
    assert show["state"] == "succeeded"
    # the event stream carries every event of the run (a lone surrogate never breaks the batch)
    events = asyncio.run(_events(agent))
    mine = [e for e in events if e.get("run_id") == rid]
    kinds = [e["kind"] for e in mine]
    assert "run_created" in kinds and kinds.count("run_state") >= 2, kinds
    rejected = [e["data"] for e in mine if e["kind"] == "telemetry_rejected"]
    steps = [e["data"]["record"] for e in mine if e["kind"] == "telemetry" and e["data"]["record"].get("type") == "step"]
    print(
        f"telemetry: steps journaled {[(r['step'], r.get('note')) for r in steps]}; rejected {[(r['line'], r['reason'][:60]) for r in rejected]}"
    )
    # a line holding a lone surrogate escape or invalid UTF-8 is refused by itself (the telemetry reader's limits);
    # a valid surrogate pair is its character; the lines around are read
    assert len(rejected) == 2 and steps and steps[0]["step"] == 1 and steps[0]["note"] == "\U00010000 ok"


async def _events(a: AgentProc) -> list[dict]:
    import msgspec

    c = await a.client()
    try:
        batch = await c.request(GetEvents(after_seq=0, limit=10000), timeout=60)
        await c.request(ListRuns(), timeout=60)
        return [msgspec.to_builtins(e) for e in batch.events]  # type: ignore[union-attr]
    finally:
        await c.close()


HOSTILE_EXIT = {
    "deep": b'{"returncode": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge": b'{"returncode": 0, "note": "' + b"x" * (4 << 20) + b'"}',
    "invalid_utf8": b'{"returncode": 0, "note": "\xff\xfe"}',
    "wrong_types": json.dumps({"returncode": "zero", "signal": 9, "ended": "yesterday", "launch_error": {"a": 1}}).encode(),
    "partly_typed": json.dumps({"returncode": 3, "signal": ["SIGKILL"], "ended": 1e308}).encode(),
}


def test_runs_whose_exit_json_is_hostile_get_a_sane_cause_and_supervision_goes_on(agent: AgentProc, tmp_path: Path) -> None:
    go = tmp_path / "go"
    wait_go = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.1)\nsys.exit(3)"
    ids = {}
    for name in HOSTILE_EXIT:
        ids[name] = agent.cli_json("launch", "--name", name, "--", PY, "-c", wait_go, str(go))["id"]
    wait_for(lambda: all(run_state(agent, r) == "running" for r in ids.values()), timeout=60, what="the runs to run")
    agent.stop()  # runs outlive the agent; they end while it is down
    go.write_text("")
    for name, rid in ids.items():
        exit_json = agent.state_dir / "runs" / rid / "exit.json"
        wait_for(exit_json.exists, timeout=60, what=f"{name}'s shim to write exit.json")
        time.sleep(0.2)
    time.sleep(1.0)
    for name, rid in ids.items():
        (agent.state_dir / "runs" / rid / "exit.json").write_bytes(HOSTILE_EXIT[name])  # the run's folder is the run's
    agent.start()
    wait_for(lambda: all(run_state(agent, r) in ("failed", "lost", "succeeded") for r in ids.values()), timeout=60, what="every run to end")
    runs = _runs(agent)
    for name, rid in ids.items():
        r = runs[rid]
        print(f"\n{name}: {r['state']}: {r.get('cause')!r:.160} (exit code {r.get('exit_code')}, signal {r.get('signal')})")
        assert isinstance(r.get("cause"), str) and len(r["cause"]) < 5000
        assert r.get("exit_code") is None or isinstance(r["exit_code"], int)
        assert r.get("signal") is None or isinstance(r["signal"], str)
    assert runs[ids["partly_typed"]]["state"] == "failed" and runs[ids["partly_typed"]]["exit_code"] == 3
    # supervision goes on: a new run is launched, watched and ended as usual
    after = agent.cli_json("launch", "--name", "after", "--", PY, "-c", "pass")["id"]
    wait_for(lambda: run_state(agent, after) == "succeeded", timeout=60, what="a later run to end")
    log = (agent.state_dir / "agent.log").read_text()
    assert "Traceback" not in log and "supervision tick failed" not in log, log[-3000:]
