"""Issue 29 end to end, on CPU with real agents and processes (GPU memory from the labelled simulated sampler):

- memory no visible process explains (the simulated GPUs' ``;unaccounted=``) is a holder: ``status`` shows it,
  pre-flight refuses a plain command on that GPU (``--force`` goes past it, recorded), ``reclaim`` lists it as
  nothing here can signal, and ``agent status`` says which PID namespace the agent sees;
- an agent in its own PID namespace (``unshare --pid``) says so.

The same on a real GPU from inside ``unshare --pid``: tests/gpu/test_unaccounted_gpu.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import GetRun, ListLeftovers
from tests.agent_harness import AgentProc, teardown_agent

pytestmark = pytest.mark.slow
PY = sys.executable
HOLDER = str(Path(__file__).parent / "progs" / "sim_gpu_holder.py")
GIB = 2**30


def _agent(home: Path, monkeypatch: pytest.MonkeyPatch, spec: str) -> Iterator[AgentProc]:
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", spec)
    a = AgentProc(home).start()
    yield a
    teardown_agent(a)


@pytest.fixture
def hidden_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    yield from _agent(gpudeck_home, monkeypatch, "2:H200:141;unaccounted=0:7.6")


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    yield from _agent(gpudeck_home, monkeypatch, "2:H200:141")


def _state(a: AgentProc, rid: str) -> str:
    return str(a.ask(GetRun(run_id=rid))["run"]["state"])


def _leftovers(a: AgentProc) -> list[dict]:
    return list(a.ask(ListLeftovers()).get("leftovers", []))


def test_unaccounted_memory_is_a_holder_in_status_preflight_and_reclaim(hidden_agent: AgentProc) -> None:
    a = hidden_agent
    agent_status = a.cli("agent", "status").stdout
    print("\n" + agent_status)  # the integrator's record of what this machine reports
    assert "PID namespace: " in agent_status and "containment: " in agent_status
    assert json.loads(a.cli("agent", "status", "--json").stdout)["namespace"]["pid_namespace"] in ("host", "isolated")

    snap = a.cli_json("status", "--host", "local")
    held = int(7.6 * GIB)
    assert snap["simulated"] and snap["gpus"][0]["unaccounted_bytes"] == held and not snap["gpus"][0].get("processes")
    assert [(u["gpu"], u["used_bytes"], u["holder"]) for u in snap["unaccounted"]] == [(0, held, True)]
    human = a.cli("status", "--host", "local").stdout
    assert "GPU 0: 7.6 GiB UNACCOUNTED (cannot be signalled from here)" in human and "SIMULATED" in human

    # a plain command on that GPU is refused before anything starts, naming the memory and where to look
    cp = a.cli("launch", "--name", "plain", "--gpus", "0", "--", "sleep", "30", check=False)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert "nothing was started" in cp.stderr and "7.6 GiB is held by no process visible here on GPU 0" in cp.stderr
    assert "outside this agent's PID namespace" in cp.stderr and "--force" in cp.stderr
    # the other GPU is free; --force goes past it and is recorded
    assert a.cli_json("launch", "--gpus", "1", "--", "sleep", "30")["state"] == "running"
    forced = a.cli_json("launch", "--gpus", "0", "--force", "--", "sleep", "30")
    assert forced["state"] == "running" and forced["preflight"]["forced"] is True
    check = next(c for c in forced["preflight"]["checks"] if c["name"] == "gpu_holders")
    assert check["overridden"] and check["details"]["unaccounted"] == [{"gpu": 0, "used_bytes": held}]

    listing = a.cli_json("reclaim", "local")
    assert listing["leftovers"] == [] and [u["gpu"] for u in listing["unaccounted"]] == [0]
    text = a.cli("reclaim", "local").stdout
    assert "no leftovers" not in text and "no leftover process" in text
    assert "outside this agent's PID namespace or by the driver" in text and "run gpudeck on the host" in text


def test_an_agent_in_its_own_pid_namespace_says_so(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs util-linux's unshare and root")
    if subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is refused here")
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "1:H200:141;unaccounted=0:3")
    a = AgentProc(gpudeck_home, prefix=(unshare, "--pid", "--fork", "--mount-proc", "--kill-child")).start()
    try:
        text = a.cli("agent", "status").stdout
        assert "PID namespace: own PID namespace" in text and "NVML lists only this namespace's processes" in text, text
        snap = a.cli_json("status", "--host", "local")
        assert snap["namespace"]["pid_namespace"] == "isolated"
        assert "this agent runs in its own PID namespace" in snap["unaccounted"][0]["note"]
        assert "PID NAMESPACE: own PID namespace" in a.cli("status", "--host", "local").stdout
    finally:
        a.stop()  # unshare, by its pid; --kill-child takes the agent (pid 1 of the namespace) with it
