"""A run cannot lock its operator out of the agent: its processes (by cgroup, tag or ancestry) hold at most 8
connections each and 16 together, and all runs together never the share of the cap kept for peers in no run (the CLI,
`agent dial`). Real agent (RLIMIT_NOFILE lowered so its cap is small), real runs whose processes open real connections,
each holding an event stream, until refused; the operator's CLI and raw connections still get in."""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest

from gpudeck.agents.server.peers import PER_PID, PER_RUN
from tests.agent_harness import teardown_agent, wait_for
from tests.e2e.test_socket_limits import LimitedAgent

pytestmark = pytest.mark.slow
PROG = Path(__file__).parent / "progs" / "conn_hog.py"
PROCS = 3  # processes per run after the first: 3 x PER_PID is past PER_RUN, so such a run meets the run's limit


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    except OSError:
        return []


def _operator_conn(sock: Path) -> dict:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(sock))
    s.sendall(b'{"type":"hello","request_id":"op"}\n')
    reply = json.loads(s.makefile("rb").readline())
    s.close()
    return reply


def test_runs_are_capped_and_the_operator_keeps_its_share(gpudeck_home: Path, tmp_path: Path) -> None:
    a = LimitedAgent(gpudeck_home, nofile=160).start()
    try:
        found = wait_for(lambda: re.search(r"connections: (\d+) at most, (\d+) of them kept", a.log()), what="the agent's cap in its log")
        cap, reserve = int(found.group(1)), int(found.group(2))
        share = cap - reserve
        print(f"\nagent RLIMIT_NOFILE 160: {cap} connections at most, {reserve} kept for peers in no run")
        assert 0 < reserve < cap
        sock = a.state_dir / "sock" / "agent.sock"
        held, runs, messages = 0, 0, []
        while held < share:
            assert runs <= share // PER_RUN + 2, "runs kept getting connections past their share"
            out = tmp_path / f"run{runs}.jsonl"
            procs = 1 if runs == 0 else PROCS  # the first run has one process: it meets the limit of one process
            a.cli_json("launch", "--name", f"hog{runs}", "--", sys.executable, str(PROG), str(sock), str(procs), str(out))
            lines = wait_for(lambda out=out, n=procs: len(_lines(out)) == n and _lines(out), timeout=120, what="every process refused")
            if runs == 0:
                assert lines[0]["held"] == PER_PID and "the most one process of a run may" in lines[0]["refusal"]["message"]
            runs += 1
            for ln in lines:
                assert ln["held"] <= PER_PID and ln["refusal"]["code"] == "connection_limit", ln
                assert ln["typed"] == "ConnectionLimit", ln  # AgentClient raises the typed error
                messages.append(ln["refusal"]["message"])
            got = sum(ln["held"] for ln in lines)
            assert got <= PER_RUN
            held += got
            print(f"run {runs}: its {procs} process(es) got {[ln['held'] for ln in lines]} connections")
        assert held == share, (held, share)
        assert any("the most one process of a run may" in m for m in messages)
        assert any("the most one run may" in m for m in messages)
        assert any(f"runs hold {share} of the agent's {cap} connections" in m and "kept for the operator" in m for m in messages)
        print(f"a refusal reads: {messages[-1]}")
        # the operator: the CLI works, and every connection of its reserve is served
        assert isinstance(a.cli_json("runs"), list)
        replies = [_operator_conn(sock) for _ in range(reserve)]
        assert all(r["type"] == "hello_reply" for r in replies), replies[:2]
    finally:
        teardown_agent(a)
