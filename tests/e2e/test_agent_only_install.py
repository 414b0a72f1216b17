"""An agent-only install (``pip install ./gpudeck``: no textual, asyncssh, sqlite_utils, rich) runs every command the
agent's own messages name: `gpudeck agent status` and `gpudeck agent stop` against a real running agent. The console's
packages are hidden from a real `gpudeck` process before anything is imported (tests/unit/test_entry.py's blocker)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.agent_harness import AgentProc
from tests.unit.test_entry import BLOCK

# runs `gpudeck.console.entry.main(argv)` (the `gpudeck` script) with the console's packages missing, as in an agent-only
# install (test_entry's blocker); every one of them it loaded anyway (none may be) is printed last, on stderr
BLOCKED_GPUDECK = (
    BLOCK
    + """from gpudeck.console.entry import main
try:
    rc = main(sys.argv[1:])
finally:
    print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN and sys.modules[m] is not None), file=sys.stderr)
sys.exit(rc)
"""
)


def _gpudeck(agent: AgentProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKED_GPUDECK, *args], env=agent.env, capture_output=True, text=True, timeout=120)


def test_agent_status_and_stop_run_without_the_consoles_packages(agent: AgentProc) -> None:
    st = _gpudeck(agent, "agent", "status", "--json")
    assert st.returncode == 0, st.stderr
    assert st.stderr.strip().endswith("loaded: []"), st.stderr
    info = json.loads(st.stdout)
    assert info["running"] is True and info["pid"] == agent.pid and info["state_dir"] == str(agent.state_dir)

    text = _gpudeck(agent, "agent", "status")
    assert text.returncode == 0 and f"agent: running, pid {agent.pid}" in text.stdout, text.stderr

    # the blocker is real: the console's own commands say what to install, exit 2
    console = _gpudeck(agent, "runs")
    assert console.returncode == 2 and "pip install './gpudeck[console]'" in console.stderr, console.stderr

    stop = _gpudeck(agent, "agent", "stop")
    assert stop.returncode == 0 and f"agent {agent.pid} stopped" in stop.stdout, stop.stderr
    assert agent.proc is not None and agent.proc.wait(30) == 0
    gone = _gpudeck(agent, "agent", "status")
    assert gone.returncode == 3 and "agent: not running" in gone.stdout, (gone.stdout, gone.stderr)
