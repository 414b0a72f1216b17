"""The CLI behaves like the tools beside it: --version, a closed pipe without a traceback, a wrong filter value or host
refused with a non-zero exit, negation without --, a typo'd --host not remembered, diff argument by argument and
never cut, and `runs --json` / `history --json` sharing kind, cause_class and alerts (real agent, real SQLite)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.agent_harness import AgentProc, run_state, wait_for

GPUDECK = [sys.executable, "-m", "gpudeck.console.cli.main"]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*GPUDECK, *args], capture_output=True, text=True, timeout=60, env=env)


def test_version_filters_and_hosts_refuse_like_the_tools_beside_it(gpudeck_home: Path) -> None:
    cp = _run("--version")
    assert cp.returncode == 0 and cp.stdout.startswith("gpudeck ")
    cp = _run("history", "--no-sync", "state:bogus")
    assert cp.returncode == 2 and "state:bogus: not a state" in cp.stderr and "failed" in cp.stderr
    assert _run("history", "--no-sync", "state:~fail").returncode == 0  # a substring is still free text
    cp = _run("history", "--no-sync", "-state:running", "state:ended")
    assert cp.returncode == 0 and "no runs match" in cp.stdout, cp.stderr
    cp = _run("hosts", "remove", "nosuch")
    assert cp.returncode == 1 and "nosuch: not in" in cp.stderr
    cp = _run("status", "--host", "typo.invalid")
    assert cp.returncode == 3
    db = next(gpudeck_home.rglob("history.db"), None)
    if db is not None:  # the history was made by another command; it must not remember the typo as a host
        assert not list(sqlite3.connect(db).execute("SELECT name FROM hosts WHERE name='typo.invalid'"))


def test_a_closed_pipe_ends_quietly(gpudeck_home: Path) -> None:
    for args in (["hosts", "list"], ["history", "--no-sync"], ["history", "--no-sync", "--json"]):
        p = subprocess.Popen([*GPUDECK, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # `| head` that has read enough before the command writes
        err = p.stderr.read()
        assert p.wait(timeout=60) in (0, 141) and "Traceback" not in err, err


def test_diff_is_argument_by_argument_and_never_cut(agent: AgentProc) -> None:
    long = "x" * 150
    a = agent.cli("launch", "--name", "a", "--", sys.executable, "-c", "pass", "--lr", "3e-4", long).stdout.strip()
    b = agent.cli("launch", "--name", "b", "--", sys.executable, "-c", "pass", "--lr", "1e-4", long + "y").stdout.strip()
    for rid in (a, b):
        wait_for(lambda rid=rid: run_state(agent, rid) == "succeeded", 30, what=rid)
    out = agent.cli("diff", a, b).stdout
    assert "--lr" in out and "3e-4" in out and "1e-4" in out, out
    assert long + "y" in out  # never cut to a width
    everything = agent.cli("diff", a, b, "--all").stdout
    assert "cwd" in everything and "cwd" not in out


def test_runs_and_history_json_share_kind_cause_class_and_alerts(agent: AgentProc) -> None:
    rid = agent.cli("launch", "--name", "shape", "--", sys.executable, "-c", "raise SystemExit(3)").stdout.strip()
    wait_for(lambda: run_state(agent, rid) == "failed", 30, what="the run to fail")
    live = next(r for r in agent.cli_json("runs") if r["id"] == rid)
    hist = next(r for r in json.loads(agent.cli("history", "--json", f"id:{rid}").stdout) if r["id"] == rid)
    for key in ("id", "host", "name", "kind", "state", "cause", "cause_class", "exit_code", "alerts", "spec", "members"):
        assert key in live and key in hist, key
    for key in ("id", "name", "kind", "state", "cause", "cause_class", "exit_code", "alerts"):
        assert live[key] == hist[key], (key, live[key], hist[key])
    # one record shape: the same keys, in the same order (README, "One record shape", documents each)
    assert list(live) == list(hist), (set(live) ^ set(hist), list(live), list(hist))
    for key in ("host", "started", "ended", "spec", "argv", "cwd", "operator", "gpus", "env"):
        assert live[key] == hist[key], (key, live[key], hist[key])


def test_relaunch_and_rollback_of_a_plain_command_ask_for_no_start(agent: AgentProc) -> None:
    rid = agent.cli("launch", "--name", "plain", "--", sys.executable, "-c", "pass").stdout.strip()
    wait_for(lambda: run_state(agent, rid) == "succeeded", 30, what="the run")
    again = json.loads(agent.cli("relaunch", rid, "--json").stdout)
    assert again["spec"]["parent"] == rid and again["spec"]["argv"] == [sys.executable, "-c", "pass"]
    back = json.loads(agent.cli("rollback", rid, "--to", rid, "--json").stdout)
    assert back["spec"]["parent"] == rid and back["spec"].get("start") is None
    cp = agent.cli("relaunch", rid, "--resume", "x", check=False)  # a malformed start is still refused
    assert cp.returncode == 2 and "not a step" in cp.stderr


def test_status_watch_redraws_with_a_filter_and_json_lines(agent: AgentProc) -> None:
    rid = agent.cli("launch", "--name", "watched", "--", sys.executable, "-c", "import time; time.sleep(60)").stdout.strip()
    wait_for(lambda: run_state(agent, rid) == "running", 30, what="the run")
    out = agent.cli("status", "--host", "local", "--watch", "-n", "0.2", "--count", "2", "--run", "watched").stdout
    assert out.count("every 0.2 s, only run=watched") == 2 and rid in out and "\x1b[" not in out  # not a terminal: frames
    none = agent.cli("status", "--host", "local", "--watch", "-n", "0.2", "--count", "1", "--run", "nosuch").stdout
    assert rid not in none and "no live runs" in none
    lines = agent.cli("status", "--host", "local", "--watch", "--json", "-n", "0.2", "--count", "2", "--user", "nobody").stdout.splitlines()
    docs = [json.loads(x) for x in lines]
    assert len(docs) == 2 and docs[0]["hosts"][0]["host"] == "local" and docs[0]["hosts"][0]["snapshot"]["runs"] == []
    cp = agent.cli("status", "-n", "1", check=False)
    assert cp.returncode == 2 and "go with --watch" in cp.stderr
    agent.cli("stop", rid, "--grace", "1")


def test_a_wait_on_a_terminal_shows_progress_on_stderr_and_none_with_json(agent: AgentProc) -> None:
    import os
    import pty

    prog = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
    rid = agent.cli("launch", "--name", "stubborn", "--", sys.executable, "-c", prog).stdout.strip()
    wait_for(lambda: run_state(agent, rid) == "running", 30, what="the run")
    wait_for(lambda: "up" in agent.cli("tail", rid).stdout, 30, what="its SIGTERM handler")
    master, slave = pty.openpty()
    p = subprocess.Popen([*GPUDECK, "stop", rid, "--grace", "3"], env=agent.env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the terminal's other end closed: the command is done
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out, _ = p.communicate(timeout=60)
    text = seen.decode(errors="replace")
    assert p.returncode == 0 and f"stopping {rid}: SIGTERM sent" in text and "s)" in text, text
    assert b"SIGKILL" in out  # the verified result on stdout, as without a terminal
    quiet = agent.cli("status", "--json").stderr
    assert quiet == ""
