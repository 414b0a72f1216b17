"""``gpudeck launch --reclaim-holders`` against a real agent on SIMULATED GPUs with a real holder process: the holder is
named (pid, user, GiB, age), reclaimed with the verified GiB per GPU, pre-flight runs again and the run starts; a holder
of another user is refused before anything is stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_harness import AgentProc, teardown_agent, wait_for
from tests.functional.conftest import SPAWN, Holder


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "2:H200")
    a = AgentProc(gpudeck_home).start()
    yield a
    teardown_agent(a)


@pytest.fixture
def holder() -> Iterator[Holder]:
    """A process outside gpudeck (nobody's child here) holding 20 GiB on simulated GPU 0; killed by pid afterwards."""
    env = {**os.environ, "GPUDECK_SIM_GPU_MEM": "0:20"}
    out = subprocess.run([sys.executable, "-c", SPAWN], env=env, capture_output=True, text=True, check=True, timeout=30)
    h = Holder(int(out.stdout.strip()))
    yield h
    try:
        os.kill(h.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _held(a: AgentProc, pid: int) -> None:
    wait_for(
        lambda: any(p["pid"] == pid for p in a.cli_json("status", "--host", "local")["gpus"][0]["processes"]),
        20,
        what="the holder on GPU 0",
    )


def test_reclaim_holders_names_reclaims_verifies_preflights_again_and_launches(sim_agent: AgentProc, holder: Holder) -> None:
    a = sim_agent
    _held(a, holder.pid)
    cp = a.cli("launch", "--reclaim-holders", "--grace", "2", "--gpus", "0", "--name", "after", "--", "sleep", "30", check=False)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    err = cp.stderr
    rid = cp.stdout.strip()
    # each step, in order: the refusal, the list (pid, user, GiB, age), the verified reclaim, pre-flight again, launch
    order = ["pre-flight on local", "1 process(es) to reclaim", f"local:{holder.pid}", "reclaiming 1 process", "GPU 0: 20.0 GiB freed"]
    order += ["pre-flight again on local", "pre-flight passed; launching"]
    at = [err.find(s) for s in order]
    assert all(i >= 0 for i in at) and at == sorted(at), err
    line = next(x for x in err.splitlines() if f"local:{holder.pid}" in x)
    assert f"user {os.environ.get('USER') or ''}".strip() in line and "GPU 0: 20.0 GiB" in line and "age " in line and "foreign" in line
    assert not holder.alive()
    run = next(r for r in a.cli_json("runs") if r["id"] == rid)
    assert run["state"] in ("starting", "running") and run.get("name") == "after"
    a.cli("stop", rid, "--grace", "1")


def test_a_holder_of_another_user_is_refused_and_nothing_is_stopped(sim_agent: AgentProc, holder: Holder) -> None:
    a = sim_agent
    _held(a, holder.pid)
    # the launch is asked for by another operator (getpass reads LOGNAME/USER): the holder is not theirs
    env = {**a.env, "LOGNAME": "someone-else", "USER": "someone-else"}
    cp = subprocess.run(
        [sys.executable, "-m", "gpudeck.console.cli", "launch", "--reclaim-holders", "--gpus", "0", "--", "sleep", "30"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert f"local:{holder.pid}" in cp.stderr and "REFUSED" in cp.stderr and "not to you (someone-else)" in cp.stderr
    assert "reclaim-and-launch stopped" in cp.stderr and "--force" in cp.stderr
    assert "reclaiming" not in cp.stderr and holder.alive()
    assert not [r for r in a.cli_json("runs") if r["state"] in ("starting", "running")]


def test_reclaim_holders_and_force_are_one_choice(sim_agent: AgentProc) -> None:
    cp = sim_agent.cli("launch", "--reclaim-holders", "--force", "--", "sleep", "1", check=False)
    assert cp.returncode == 2 and "choose one" in cp.stderr
    assert json.loads(sim_agent.cli("runs", "--json").stdout) == []
