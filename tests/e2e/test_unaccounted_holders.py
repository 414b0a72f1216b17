"""Issue 29 end to end, on CPU with real agents and processes (GPU memory from the labelled simulated sampler):

- memory no visible process explains (the simulated GPUs' ``;unaccounted=``) is a holder: ``status`` shows it,
  pre-flight refuses a plain command on that GPU (``--force`` goes past it, recorded), ``reclaim`` lists it as
  nothing here can signal, and ``agent status`` says which PID namespace the agent sees;
- a reclaim's verification names the processes it stopped and what of the same run still holds memory;
- ``stop`` and ``reclaim`` agree on an ended run's member that cleared its environment (``env -i``), at each level.

The same on a real GPU from inside ``unshare --pid``: tests/gpu/test_unaccounted_gpu.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpudeck.agents.wire.protocol import GetRun, ListLeftovers
from tests.agent_harness import AgentProc, kill_pids, simulated_agent, wait_for
from tests.e2e.test_agent_runs import gone, read_pids
from tests.e2e.test_containment import LEVELS

pytestmark = pytest.mark.slow
PY = sys.executable
HOLDER = str(Path(__file__).parent / "progs" / "sim_gpu_holder.py")
GIB = 2**30


@pytest.fixture
def hidden_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    yield from simulated_agent(gpudeck_home, monkeypatch, "2:H200:141;unaccounted=0:7.6")


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentProc]:
    yield from simulated_agent(gpudeck_home, monkeypatch, "2:H200:141")


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
    assert "GPU 0: 7.6 GiB UNACCOUNTED, held by no process visible to this agent" in human and "SIMULATED" in human

    # a plain command on that GPU is refused before anything starts, naming the memory and where to look
    cp = a.cli("launch", "--name", "plain", "--gpus", "0", "--", "sleep", "30", check=False)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert "nothing was started" in cp.stderr and "GPU 0: 7.6 GiB held by no process visible to this agent" in cp.stderr
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


def _holders_run(a: AgentProc, tmp_path: Path, *gib: int) -> tuple[str, dict[int, int]]:
    """A run that starts one simulated holder per figure (GPU 0) and ends, leaving them behind with its tag."""
    pidfile = tmp_path / "holders"
    code = (
        "import os, subprocess, sys\n"
        "lines = []\n"
        f"for gib in {list(gib)!r}:\n"
        "    env = dict(os.environ, GPUDECK_SIM_GPU_MEM=f'0:{gib}')\n"
        f"    p = subprocess.Popen([sys.executable, {HOLDER!r}], env=env, stdout=subprocess.DEVNULL)\n"
        "    lines.append(f'{gib} {p.pid}\\n')\n"
        f"open({str(pidfile) + '.tmp'!r}, 'w').write(''.join(lines))\n"
        f"os.replace({str(pidfile) + '.tmp'!r}, {str(pidfile)!r})\n"
    )
    rid = a.cli_json("launch", "--gpus", "0", "--", PY, "-c", code)["id"]
    pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), timeout=30, what="the holders")
    wait_for(lambda: _state(a, rid) == "succeeded", timeout=30, what="the run to end")
    by_gib = {int(k): v for k, v in pids.items()}
    wait_for(lambda: {lo["pid"] for lo in _leftovers(a)} >= set(by_gib.values()), timeout=30, what="both leftovers")
    return rid, by_gib


def test_a_reclaim_names_what_it_verified_and_what_of_the_run_still_holds(sim_agent: AgentProc, tmp_path: Path) -> None:
    a = sim_agent
    rid, pids = _holders_run(a, tmp_path, 10, 30)
    try:
        res = a.cli_json("reclaim", f"local:{pids[10]}", "--grace", "2")[0]
        note = res["gpu_note"]
        assert res["gpu_verified"] is True and res["freed_bytes"] == 10 * GIB, res
        # it verified the one process it stopped, and says so; the run's other leftover still holds 30 GiB
        assert "no process of the run" not in note, note
        assert f"the 1 process reclaimed (pid {pids[10]}) holds no GPU memory" in note, note
        assert f"still held, not stopped by this reclaim: pid {pids[30]} (run {rid}) 30.0 GiB on GPU 0" in note, note
        assert f"gpudeck reclaim local:{pids[30]}" in note
        assert [(p["pid"], p["run_id"], p["used_bytes"]) for p in res["still_held"]] == [(pids[30], rid, 30 * GIB)]
        human = a.cli("reclaim", f"local:{pids[30]}", "--grace", "2").stdout
        assert f"the 1 process reclaimed (pid {pids[30]}) holds no GPU memory" in human
        assert f"no other process of run {rid} holds GPU memory" in human
    finally:
        kill_pids(list(pids.values()))


@pytest.fixture(params=LEVELS)
def level_agent(request: pytest.FixtureRequest, gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, AgentProc]]:
    monkeypatch.setenv("GPUDECK_CONTAINMENT", request.param)
    for a in simulated_agent(gpudeck_home, monkeypatch, "2:H200:141"):
        yield request.param, a


def test_stop_and_reclaim_agree_on_an_env_cleared_member_of_an_ended_run(level_agent: tuple[str, AgentProc], tmp_path: Path) -> None:
    level, a = level_agent
    pidfile = tmp_path / "pid"
    # the run's only process forks `env -i sleep` (no tag: an empty environment) and exits; the sleep lives on
    rid = a.cli_json("launch", "--", "sh", "-c", f"env -i sleep 600 & echo envclear $! > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}")["id"]
    sleeper = wait_for(lambda: pidfile.exists() and read_pids(pidfile), timeout=30, what="the env-cleared child")["envclear"]
    try:
        wait_for(lambda: _state(a, rid) == "succeeded", timeout=30, what="the run to end")
        assert "GPUDECK_RUN_ID" not in psutil.Process(sleeper).environ()
        time.sleep(0.5)  # the shim is gone too: only the session (or the group) ties the sleeper to the run
        listed = [lo for lo in _leftovers(a) if lo["run_id"] == rid]
        assert [(lo["pid"], lo["kind"]) for lo in listed] == [(sleeper, "orphan")], listed
        assert listed[0]["found_by"] == ("cgroup" if level == "cgroupfs" else "ancestry")
        human = a.cli("reclaim", "local").stdout
        assert f"local:{sleeper}" in human and ("in its cgroup" if level == "cgroupfs" else "cleared its environment") in human
        # the stop of the same ended run stops exactly what reclaim listed
        res = a.cli_json("stop", rid, "--grace", "1")
        assert "already ended" in res["message"], res
        assert {p["pid"] for p in res["stopped"] if p["how"] != "already_gone"} == {lo["pid"] for lo in listed}, res
        assert gone(sleeper) and not res.get("survivors")
        assert [lo for lo in _leftovers(a) if lo["run_id"] == rid] == []
    finally:
        kill_pids([sleeper])


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
        # unshare blocks SIGTERM while its child runs (util-linux 2.38: SigBlk has SIGINT and SIGTERM), so a.stop()'s
        # SIGTERM alone waited its 10 s for the SIGKILL that --kill-child passes on: the agent (pid 1 of the namespace,
        # unshare's child) is asked to stop by its pid first, and unshare ends with it
        try:
            for child in psutil.Process(a.pid).children():
                child.terminate()
        except psutil.Error:
            pass
        a.stop()  # unshare, by its pid; --kill-child takes the agent with it if it is still there
