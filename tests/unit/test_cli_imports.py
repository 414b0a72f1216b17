"""The `gpudeck` script imports only what a command needs: no asyncssh, Textual or sqlite-utils for `--help`,
`--version`, `status --host local` or `runs --no-sync` (issue 30). Each call is the installed script in a fresh
process with PYTHONPROFILEIMPORTTIME=1, so every module it imported is named on stderr; a command that does
connect over SSH is the control that shows the check sees asyncssh when it is there."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.agent_harness import AgentProc, wait_for

GPUDECK = str(Path(sys.executable).with_name("gpudeck"))
HEAVY = ("asyncssh", "textual", "sqlite_utils")


def _gpudeck(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run the real script (GPUDECK_HOME from the fixture); its result and the top-level names of every module it imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    cp = subprocess.run([GPUDECK, *args], capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    modules = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in cp.stderr.splitlines() if line.startswith("import time:")}
    return cp, modules


def _answers(sock: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
            return True
        except OSError:
            return False


def _heavy(modules: set[str]) -> list[str]:
    return [m for m in HEAVY if m in modules]


def test_help_and_version_import_no_console_library(gpudeck_home: Path) -> None:
    for args in (["--help"], ["status", "--help"], ["--version"], ["runs", "--help"]):
        cp, modules = _gpudeck(*args)
        assert cp.returncode == 0 and cp.stdout.strip(), cp.stderr[-2000:]
        assert "gpudeck" in modules  # the import report is there: an empty one would pass anything
        assert _heavy(modules) == [], (args, _heavy(modules))
        assert "msgspec" not in modules, args  # nor the wire protocol: the parser imports no command's code
    cp, _ = _gpudeck("--help")
    assert "status" in cp.stdout and "watch" in cp.stdout  # every command is still listed


def test_status_of_the_local_host_imports_no_ssh_textual_or_sqlite_utils(agent: AgentProc) -> None:
    first, _ = _gpudeck("status", "--host", "local")  # the first command on a new GPUDECK_HOME creates history.db (sqlite-utils)
    assert first.returncode == 0, first.stderr[-2000:]
    cp, modules = _gpudeck("status", "--host", "local")
    assert cp.returncode == 0 and "host local" in cp.stdout, cp.stderr[-2000:]
    assert "gpudeck" in modules and "msgspec" in modules  # it did reach the agent through the console's code
    assert _heavy(modules) == [], _heavy(modules)
    # the control: a host that is not local goes through SSH, and the check sees asyncssh arrive
    cp, modules = _gpudeck("status", "--host", "nosuchhost.invalid")
    assert cp.returncode == 3, cp.stderr[-2000:]
    assert "asyncssh" in modules


def test_runs_no_sync_reads_the_history_and_asks_no_agent(agent: AgentProc) -> None:
    rid = agent.cli("launch", "--name", "nosync", "--", sys.executable, "-c", "pass").stdout.strip()
    wait_for(lambda: next(r for r in agent.cli_json("runs") if r["id"] == rid)["state"] == "succeeded", 60, what=rid)
    live = next(r for r in agent.cli_json("runs") if r["id"] == rid)
    agent.cli("history", "--host", "local")  # the sync that --no-sync then reads
    agent.stop()  # no agent from here on: --no-sync must answer without one, and must not start one
    cp, modules = _gpudeck("runs", "--host", "local", "--no-sync", "--json")
    assert cp.returncode == 0, cp.stderr[-2000:]
    rows = json.loads(cp.stdout)
    row = next(r for r in rows if r["id"] == rid)
    assert list(row) == list(live)  # one record shape, as `runs` prints it
    assert row["name"] == "nosync" and row["state"] == "succeeded" and row["host"] == "local"
    assert _heavy(modules) == [], _heavy(modules)
    assert not _answers(agent.state_dir / "sock" / "agent.sock")  # and no agent was started for it
    text, _ = _gpudeck("runs", "--no-sync")
    assert text.returncode == 0 and rid in text.stdout, text.stderr[-2000:]
