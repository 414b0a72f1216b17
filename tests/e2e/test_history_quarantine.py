"""A real agent journal carrying events the history cannot store: each is quarantined by itself, the rest of the
host's history goes in, `gpudeck history --problems` shows them, and later runs keep reaching the history.

(A journal event holding a lone surrogate is not in this test: the agent stores such text as U+FFFD, so it never
reaches the console (tests/e2e/test_hostile_run_files.py); tests/unit/test_history.py quarantines one given to the
history directly.)"""

from __future__ import annotations

import json
import sqlite3
import sys
import time

from tests.agent_harness import AgentProc, wait_for


def _ended(agent: AgentProc, rid: str) -> bool:
    return next((r for r in agent.cli_json("runs") if r["id"] == rid), {}).get("state") == "succeeded"


def test_bad_journal_events_are_quarantined_and_the_history_goes_on(agent: AgentProc) -> None:
    first = agent.cli_json("launch", "--name", "before", "--", sys.executable, "-c", "pass")["id"]
    wait_for(lambda: _ended(agent, first), timeout=60, what="the first run to end")
    agent.stop()
    db = sqlite3.connect(agent.state_dir / "journal.db")
    try:
        bad = [
            ("telemetry", first, '{"record": {"type": "step", "step": 18446744073709551616, "loss": 1.0}, "offset": 1}'),
            ("telemetry", first, '{"record": {"type": "manifest", "params_total": ' + "9" * 40 + "}}"),
        ]
        db.executemany("INSERT INTO events(ts, kind, run_id, data) VALUES (?,?,?,?)", [(time.time(), k, r, d) for k, r, d in bad])
        db.commit()
    finally:
        db.close()
    agent.start()
    rows = agent.cli_json("history")
    assert first in [r["id"] for r in rows]
    problems = agent.cli_json("history", "--problems")
    assert len(problems) == 2, problems
    assert "64-bit INTEGER" in problems[0]["error"] and "18446744073709551616" in problems[0]["raw"]
    human = agent.cli("history", "--problems").stdout
    assert "2 event(s) kept out of the history" in human and "local" in human
    second = agent.cli_json("launch", "--name", "after", "--", sys.executable, "-c", "pass")["id"]
    wait_for(lambda: _ended(agent, second), timeout=60, what="the second run to end")
    wait_for(
        lambda: next((r for r in agent.cli_json("history") if r["id"] == second), {}).get("state") == "succeeded",
        timeout=60,
        what="the run after the bad events to reach the history",
    )
    assert len(agent.cli_json("history", "--problems")) == 2  # quarantined once, never pulled again
    assert json.loads(agent.cli("show", first, "--json").stdout)["state"] == "succeeded"
