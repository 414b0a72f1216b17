"""An agent-only install (``pip install ./gpudeck``: no textual, asyncssh, sqlite_utils, rich) runs every command the
agent's own messages name: `gpudeck agent status` and `gpudeck agent stop` against a real running agent. Once with the
console's packages hidden from a real `gpudeck` process before anything is imported (tests/unit/test_entry.py's
blocker), once as the real thing: a fresh venv with the base dependencies and this checkout installed --no-deps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agent_harness import ROOT, AgentProc
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


BASE_DEPS = ("nvidia-ml-py", "psutil", "msgspec", "platformdirs", "tomlkit", "py-spy")  # pyproject's [project] dependencies


@pytest.mark.slow
def test_a_fresh_agent_only_install_serves_and_answers_status_and_stop(tmp_path: Path) -> None:
    """The real thing: a new venv, the base dependencies, `pip install --no-deps` of this checkout (no console
    packages at all), and its own `gpudeck` script serving, then answering `agent status` and `agent stop`."""
    venv = tmp_path / "venv"
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True, timeout=300)  # the system's python: not our venv
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    src = tmp_path / "src"  # a copy: pip builds in the source folder (build/, *.egg-info), never in the checkout
    for name in ("agents", "console", "trainers"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for step in ([*pip, *BASE_DEPS], [*pip, "--no-deps", str(src)]):
        r = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            pytest.skip(f"cannot install here (no package index?): {r.stderr.strip().splitlines()[-1:]}")
    gd = str(venv / "bin" / "gpudeck")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(GPUDECK_HOME=str(tmp_path / "home"), GPUDECK_SIMULATE_GPUS="2:H200:141")
    assert subprocess.run([str(venv / "bin" / "python"), "-c", "import textual"], capture_output=True, env=env).returncode != 0
    serve = subprocess.Popen([gd, "agent", "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            st = subprocess.run([gd, "agent", "status", "--json"], env=env, capture_output=True, text=True, timeout=120)
            if st.returncode == 0 or time.monotonic() > deadline or serve.poll() is not None:
                break
            time.sleep(0.5)
        assert st.returncode == 0, (st.stdout, st.stderr)
        info = json.loads(st.stdout)
        assert info["pid"] == serve.pid and info["simulated"] is True
        assert info["state_dir"] == str(tmp_path / "home" / "agent")
        stop = subprocess.run([gd, "agent", "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0 and f"agent {serve.pid} stopped" in stop.stdout, stop.stderr
        assert serve.wait(30) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
