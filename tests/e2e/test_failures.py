"""The failures of ARCHITECTURE.md replayed on CPU with real process trees (GPU memory from the labelled simulated sampler).

Each test is one failure case: a stale holder blocks a launch and reclaim frees it
(1, 3), killing the launcher leaves orphans that reclaim finds (2), a rank dies
and the run goes on (4), the environment moved and rollback refuses or rebuilds
(5), no default start (6), claims against observation (7), causes (8). The same
paths on real NVML run in tests/gpu/.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpudeck.agents.wire.protocol import GetRun
from tests.agent_harness import ROOT, AgentProc, run_state, teardown_agent, wait_for
from tests.trainer_harness import alive

pytestmark = pytest.mark.slow
PROGS = Path(__file__).resolve().parent / "progs"
PY = sys.executable
HOLDER = str(PROGS / "sim_gpu_holder.py")


@pytest.fixture
def sim_agent(gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "4:H200:141")
    a = AgentProc(gpudeck_home).start()
    yield a
    teardown_agent(a)


def _events(agent: AgentProc, rid: str) -> list[dict]:
    return json.loads(agent.cli("show", rid, "--json").stdout)["events"]


def _state(agent: AgentProc, rid: str) -> str:
    """The run's state, asked over the agent's socket: polling through the CLI is a Python start every 50 ms, a core
    taken from the run being waited for."""
    return str(agent.ask(GetRun(run_id=rid))["run"]["state"])


def _gpu0_used(agent: AgentProc) -> float:
    snap = agent.cli_json("status", "--host", "local")
    return snap["gpus"][0]["memory_used"] / 2**30


def test_a_stale_holder_blocks_the_launch_by_name_and_reclaim_frees_it(sim_agent: AgentProc) -> None:
    a = sim_agent
    # run 1 forks a worker that outlives it, holding 20 GiB on GPU 0 (a leftover of an ended run)
    r1 = a.cli_json(
        "launch",
        "--name",
        "leaky",
        "--env",
        "GPUDECK_SIM_GPU_MEM=0:20",
        "--",
        PY,
        HOLDER,
        "--fork-holder",
        "--seconds",
        "1",
        "--child-seconds",
        "120",
    )["id"]
    wait_for(lambda: run_state(a, r1) == "succeeded", 20, what="run 1 to end")
    snap = a.cli_json("status", "--host", "local")
    assert snap["simulated"] is True
    stale = [p for p in snap["gpus"][0]["processes"] if p["attribution"] == "STALE"]
    assert len(stale) == 1 and stale[0]["run_id"] == r1
    orphan = stale[0]["pid"]

    cp = a.cli("launch", "--name", "big", "--gpus", "0", "--need-gib", "130", "--", "sleep", "30", check=False)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert "nothing was started" in cp.stderr and f"pid {orphan}" in cp.stderr and r1 in cp.stderr
    assert "20.0 GiB" in cp.stderr and f"gpudeck reclaim local:{orphan}" in cp.stderr
    failed = next(r for r in a.cli_json("runs") if r.get("name") == "big")
    assert failed["state"] == "preflight_failed" and failed["cause"].startswith("pre-flight failed")
    assert not failed.get("members")  # nothing was started
    hist = a.cli_json("history", "cause:preflight")
    assert [r["id"] for r in hist] == [failed["id"]]

    listing = a.cli_json("reclaim", "local")["leftovers"]
    lo = next(x for x in listing if x["pid"] == orphan)
    assert lo["kind"] == "orphan" and lo["run_id"] == r1 and lo["gpu_bytes"] == {"0": 20 * 2**30}
    human = a.cli("reclaim", "local").stdout
    assert f"local:{orphan}" in human and "orphan" in human and "20.0 GiB" in human

    res = a.cli_json("reclaim", f"local:{orphan}", "--grace", "2")[0]
    assert [s["pid"] for s in res["stopped"]] == [orphan] and not res.get("survivors")
    assert res["gpu_verified"] is True and res["freed_bytes"] == 20 * 2**30
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    assert _gpu0_used(a) == 0.0

    ok = a.cli_json("launch", "--name", "big", "--gpus", "0", "--need-gib", "130", "--", "sleep", "30")
    assert ok["state"] == "running" and ok["preflight"]["ok"] is True


def test_force_overrides_only_the_holder_check_and_is_recorded(sim_agent: AgentProc) -> None:
    a = sim_agent
    holder = a.cli_json("launch", "--env", "GPUDECK_SIM_GPU_MEM=1:10", "--", PY, HOLDER)["id"]
    wait_for(
        lambda: any(p["attribution"] == "RUN" for p in a.cli_json("status", "--host", "local")["gpus"][1]["processes"]),
        10,
        what="holder on GPU 1",
    )
    # a live run on the GPU is not a FOREIGN/STALE holder; a process outside gpudeck is
    env = dict(a.env, GPUDECK_SIM_GPU_MEM="1:10")
    foreign = subprocess.Popen([PY, HOLDER], env=env, stdout=subprocess.DEVNULL)
    try:
        wait_for(
            lambda: any(p["attribution"] == "FOREIGN" for p in a.cli_json("status", "--host", "local")["gpus"][1]["processes"]),
            10,
            what="foreign holder",
        )
        cp = a.cli("launch", "--gpus", "1", "--", "sleep", "5", check=False)
        assert cp.returncode == 1 and f"pid {foreign.pid}" in cp.stderr and "not a gpudeck run" in cp.stderr
        forced = a.cli_json("launch", "--gpus", "1", "--force", "--", "sleep", "5")
        assert forced["state"] == "running" and forced["preflight"]["forced"] is True
        # --force does not override memory: 141 - 20 GiB free, 130 needed
        cp = a.cli("launch", "--gpus", "1", "--force", "--need-gib", "130", "--", "sleep", "5", check=False)
        assert cp.returncode == 1 and "gpu_memory" in cp.stderr
    finally:
        foreign.kill()
        foreign.wait()
        a.cli("stop", holder, "--grace", "1", check=False)


def test_killing_the_launcher_leaves_orphans_that_reclaim_finds_and_stops(sim_agent: AgentProc) -> None:
    a = sim_agent
    r = a.cli_json("launch", "--", PY, str(PROGS / "ranks.py"), str(ROOT), "2", "--sim-gib", "3", "--seconds", "120")
    rid = r["id"]
    ranks = wait_for(
        lambda: (
            (
                ms := [
                    m
                    for m in next(x for x in a.cli_json("status", "--host", "local")["runs"] if x["id"] == rid)["members"]
                    if m.get("rank") is not None
                ]
            )
            and len(ms) == 2
            and ms
        ),
        20,
        what="2 ranks",
    )
    leader = next(m["pid"] for m in r["members"] if m["role"] == "leader")
    os.kill(leader, signal.SIGKILL)  # like killing torchrun: the ranks are in their own sessions and live on
    wait_for(lambda: run_state(a, rid) == "failed", 15, what="run ended")
    run = next(x for x in a.cli_json("runs") if x["id"] == rid)
    assert run["cause"].startswith("killed by SIGKILL") and run["cause"] and "signal" == a.cli_json("show", rid)["cause_class"]
    left = a.cli_json("reclaim", "local")["leftovers"]
    pids = sorted(lo["pid"] for lo in left if lo["run_id"] == rid)
    assert pids == sorted(m["pid"] for m in ranks)
    assert all(lo["kind"] == "orphan" and lo["rss"] > 0 and lo["cpu_percent"] is not None for lo in left if lo["run_id"] == rid)
    res = a.cli_json("reclaim", *[f"local:{p}" for p in pids], "--grace", "2")[0]
    assert sorted(s["pid"] for s in res["stopped"]) == pids and res["gpu_verified"] and res["freed_bytes"] == 2 * 3 * 2**30
    assert a.cli_json("reclaim", "local")["leftovers"] == []
    # a live run's process is refused without --include-live
    live = a.cli_json("launch", "--", PY, str(PROGS / "ranks.py"), str(ROOT), "1", "--seconds", "60")["id"]
    rank0 = wait_for(
        lambda: [
            m["pid"]
            for m in next(x for x in a.cli_json("status", "--host", "local")["runs"] if x["id"] == live)["members"]
            if m.get("rank") == 0
        ],
        20,
        what="rank",
    )[0]
    cp = a.cli("reclaim", f"local:{rank0}", check=False)
    assert cp.returncode == 1 and f"gpudeck stop {live}" in cp.stderr and "--include-live" in cp.stderr
    cp = a.cli("reclaim", "local:1", check=False)
    assert cp.returncode == 1 and "not a leftover" in cp.stderr


@pytest.mark.parametrize("policy", ["alert", "stop"])
def test_a_rank_that_dies_while_the_run_goes_on_raises_the_alert_within_10_s(sim_agent: AgentProc, policy: str) -> None:
    a = sim_agent
    r = a.cli_json(
        "launch",
        "--name",
        f"crawl-{policy}",
        "--on-rank-death",
        policy,
        "--",
        PY,
        str(PROGS / "ranks.py"),
        str(ROOT),
        "3",
        "--sim-gib",
        "2",
        "--seconds",
        "120",
    )
    rid = r["id"]

    def three_ranks() -> list[dict] | None:  # from one status: the ranks its members list holds are all three
        run = next((x for x in a.cli_json("status", "--host", "local")["runs"] if x["id"] == rid), {})
        ranked = [m for m in run.get("members", []) if m.get("rank") is not None]
        return ranked if sorted({m["rank"] for m in ranked}) == [0, 1, 2] else None

    members = wait_for(three_ranks, 30, what="3 ranks")
    time.sleep(1.0)
    victim = next(m for m in members if m["rank"] == 1)
    t_kill = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    if policy == "alert":
        alert = wait_for(
            lambda: next(
                (
                    al
                    for al in (next((x for x in a.cli_json("status", "--host", "local")["runs"] if x["id"] == rid), {}).get("alerts") or [])
                    if al["kind"] == "rank_exited"
                ),
                None,
            ),
            10,
            what="rank_exited alert",
        )
        assert alert["ts"] - t_kill < 10.0 and alert["rank"] == 1 and str(victim["pid"]) in alert["message"]
        assert alert["severity"] == "critical" and "2 of 3 ranks" in alert["message"]
        assert next(x for x in a.cli_json("runs") if x["id"] == rid)["state"] == "running"  # the run crawls on
        ev = [e for e in _events(a, rid) if e["kind"] == "alert"]
        assert ev and ev[0]["data"]["alert"]["kind"] == "rank_exited"
        assert a.cli_json("history", "alert:rank_exited")[0]["id"] == rid
    else:
        wait_for(lambda: run_state(a, rid) == "stopped", 20, what="the whole run stopped")
        run = next(x for x in a.cli_json("runs") if x["id"] == rid)
        assert "--on-rank-death stop" in run["cause"] and "rank 1" in run["cause"]
        assert a.cli_json("show", rid)["cause_class"] == "rank_died"
        # a SIGKILLed rank can linger as a zombie until init reaps it (PID 1 here is no prompt reaper): it holds nothing
        assert not [m["pid"] for m in members if alive(m["pid"])]
        assert _gpu0_used(a) == 0.0 and all(g["memory_used"] == 0 for g in a.cli_json("status", "--host", "local")["gpus"])


def test_claims_against_what_is_observed(sim_agent: AgentProc) -> None:
    a = sim_agent
    # claimed: 4 GPUs and 1B params; the run holds memory on GPU 0 only and reports 3,066,112 params
    rid = a.cli_json(
        "launch",
        "--name",
        "1b-4gpu",
        "--gpus",
        "0,1,2,3",
        "--claim-params",
        "1B",
        "--",
        PY,
        str(PROGS / "ranks.py"),
        str(ROOT),
        "1",
        "--sim-gib",
        "5",
        "--seconds",
        "60",
    )["id"]
    alerts = wait_for(
        lambda: [
            al
            for al in next(x for x in a.cli_json("status", "--host", "local")["runs"] if x["id"] == rid).get("alerts", [])
            if al["kind"] == "claim_mismatch"
        ],
        20,
        what="claim alerts",
    )
    texts = " | ".join(al["message"] for al in alerts)
    assert "claimed 4 GPUs, observed 1: GPU 0" in texts, texts
    assert "params" in texts
    cp = a.cli("verify", rid, check=False)
    assert cp.returncode == 1 and "MISMATCH" in cp.stdout
    rows = {r["what"]: r for r in json.loads(a.cli("verify", rid, "--json", check=False).stdout)["rows"]}
    assert rows["GPUs"]["claimed"] == 4 and rows["GPUs"]["observed"] == 1 and rows["GPUs"]["ok"] is False
    assert rows["params"]["observed"] == 3_066_112 and rows["params"]["ok"] is False
    assert rows["dataset samples"]["observed"] == 100
    a.cli("stop", rid, "--grace", "2")
    ended = {r["what"]: r for r in json.loads(a.cli("verify", rid, "--json", check=False).stdout)["rows"]}  # recorded at the end
    assert ended["GPUs"]["observed"] == 1


def test_causes_are_classified_from_real_outputs(sim_agent: AgentProc) -> None:
    a = sim_agent
    cases = {
        "oom": [
            PY,
            "-c",
            "import torch; raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB')",
        ],
        "exception": [PY, "-c", "raise ValueError('bad batch')"],
        "signal": ["sh", "-c", "kill -9 $$"],
        "exit_code": ["sh", "-c", "exit 3"],
        "ok": ["true"],
    }
    ids = {k: a.cli_json("launch", "--name", f"cause-{k}", "--", *argv)["id"] for k, argv in cases.items()}
    wait_for(
        lambda: all(r["state"] in ("failed", "succeeded") for r in a.cli_json("runs") if r["id"] in ids.values()),
        60,
        what="all runs to end",
    )
    for k, rid in ids.items():
        row = a.cli_json("show", rid)
        assert row["cause_class"] == k, (k, row["cause"])
    assert [r["id"] for r in a.cli_json("history", "cause:oom")] == [ids["oom"]]
    assert "ValueError: bad batch" in a.cli_json("show", ids["exception"])["cause"]


def _memcg() -> Path | None:
    """A memory cgroup this test may create (v1 memory controller or v2), else None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        parts = line.split(":", 2)
        if "memory" in parts[1].split(","):
            base = Path("/sys/fs/cgroup/memory") / parts[2].lstrip("/")
            if os.access(base, os.W_OK):
                return base
    v2 = Path("/sys/fs/cgroup")
    return (
        v2
        if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text() and os.access(v2, os.W_OK)
        else None
    )


def test_the_host_oom_killer_is_named_as_the_cause(sim_agent: AgentProc) -> None:
    base = _memcg()
    if base is None or subprocess.run(["dmesg"], capture_output=True).returncode != 0:
        pytest.skip("needs a writable memory cgroup and a readable kernel log (root on a cgroup v1/v2 host)")
    cg = base / f"gd-oom-{os.getpid()}"
    cg.mkdir()
    try:
        limit = "memory.limit_in_bytes" if (cg / "memory.limit_in_bytes").exists() else "memory.max"
        (cg / limit).write_text(str(64 * 2**20))
        rid = sim_agent.cli_json(
            "launch", "--name", "hog", "--", "sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec {PY} -c 'x = bytearray(400 * 2**20)'"
        )["id"]
        wait_for(
            lambda: next(r for r in sim_agent.cli_json("runs") if r["id"] == rid)["state"] == "failed", 30, what="the hog to be killed"
        )
        row = sim_agent.cli_json("show", rid)
        assert "host OOM killer" in row["cause"] and row["cause_class"] == "host_oom", row["cause"]
        assert [r["id"] for r in sim_agent.cli_json("history", "cause:host_oom")] == [rid]
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_relaunch_needs_an_explicit_start_and_resume_checks_the_checkpoint(sim_agent: AgentProc, tmp_path: Path) -> None:
    a = sim_agent
    out = tmp_path / "out"
    rid = a.cli_json(
        "launch",
        "--kind",
        "fsdp",
        "--python",
        PY,
        "--fresh",
        "--",
        "--model-config",
        "tiny",
        "--max-steps",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--out",
        str(out),
        "--device",
        "cpu",
        "--corpus-bytes",
        "200000",
        "--no-export",
    )["id"]
    wait_for(lambda: _state(a, rid) in ("succeeded", "failed"), 180, what="tiny fsdp run")
    run = next(r for r in a.cli_json("runs") if r["id"] == rid)
    assert run["state"] == "succeeded", a.cli("tail", rid, "-n", "30").stdout
    assert run["spec"]["start"] == "fresh" and run["spec"]["argv"][-1] == "--fresh"
    cp = a.cli("relaunch", rid, check=False)
    assert cp.returncode == 2 and "--fresh" in cp.stderr and "--resume N" in cp.stderr and "no default" in cp.stderr
    cp = a.cli("relaunch", rid, "--resume", "7", check=False)
    assert cp.returncode == 1 and "resume_checkpoint" in cp.stderr and "step_7" in cp.stderr and "step_2" in cp.stderr
    again = a.cli_json("relaunch", rid, "--resume", "2")
    assert again["state"] == "running" and again["spec"]["parent"] == rid and again["spec"]["argv"][-2:] == ["--resume", "2"]
    wait_for(lambda: _state(a, again["id"]) in ("succeeded", "failed"), 180, what="resumed run")


@pytest.mark.timeout(900)
def test_rollback_refuses_a_changed_environment_and_rebuild_env_recreates_it(sim_agent: AgentProc, tmp_path: Path) -> None:
    a = sim_agent
    venv = tmp_path / "envA"
    # a venv without pip (as uv makes them), filled by this pip through --python: ensurepip took 3.5 s of the test's
    # 17; the rebuild below then also removes the pip and setuptools its fresh venv brings, which the record lacks
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    pip = [PY, "-m", "pip", "--python", py, "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "six==1.16.0"], check=True, timeout=300)
    prog = ["-c", "import six; print('six', six.__version__)"]
    good = a.cli_json("launch", "--name", "good", "--python", py, "--", py, *prog)["id"]
    wait_for(lambda: _state(a, good) == "succeeded", 60, what="good run")
    assert a.cli_json("show", good)["env"]["packages"]["six"] == "1.16.0"

    subprocess.run([*pip, "six==1.17.0"], check=True, timeout=300)  # the environment moves under the run
    bad = a.cli_json("launch", "--name", "bad", "--python", py, "--", py, *prog)["id"]
    wait_for(lambda: _state(a, bad) == "succeeded", 60, what="bad run")
    d = a.cli_json("diff", good, bad)
    changed = [r for r in d["environment"] if r["differs"]]
    assert [(r["key"], r["a"], r["b"]) for r in changed] == [("six (package)", "1.16.0", "1.17.0")], changed
    assert "six (package)" in a.cli("diff", good, bad).stdout

    n_runs = len(a.cli_json("runs"))
    cp = a.cli("rollback", bad, "--to", good, check=False)  # a plain command has no start to choose: not asked for one
    assert cp.returncode == 1 and "no longer matches" in cp.stderr and "--fresh" not in cp.stderr, cp.stderr
    cp = a.cli("rollback", bad, "--to", good, "--fresh", check=False)
    assert (
        cp.returncode == 1 and "no longer matches" in cp.stderr and "six 1.16.0 -> 1.17.0" in cp.stderr and "--rebuild-env" in cp.stderr
    ), cp.stderr
    assert len(a.cli_json("runs")) == n_runs  # nothing started

    cp = a.cli("rollback", bad, "--to", good, "--fresh", "--rebuild-env", "--json", check=False, timeout=900)
    assert cp.returncode == 0, cp.stderr
    assert "matches the recorded fingerprint" in cp.stderr
    new = json.loads(cp.stdout)
    assert new["spec"]["parent"] == bad and new["spec"]["start"] == "fresh"
    assert new["spec"]["python"].startswith(str(a.state_dir / "envs")) and new["spec"]["argv"][0] == new["spec"]["python"]
    wait_for(lambda: _state(a, new["id"]) == "succeeded", 60, what="rolled-back run")
    assert "six 1.16.0" in a.cli("tail", new["id"]).stdout
    row = a.cli_json("show", new["id"])
    assert row["env"]["packages"]["six"] == "1.16.0" and row["env_hash"] == a.cli_json("show", good)["env_hash"]
