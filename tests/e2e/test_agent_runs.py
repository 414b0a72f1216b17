"""End-to-end tests of the agent with real processes, a real socket and a real journal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from gpudeck.agents.observe.procs import alive, create_time_of
from tests.agent_harness import AgentProc, journal_add_member, run_state, wait_for

PROGS = Path(__file__).parent / "progs"


def read_pids(path: Path) -> dict[str, int]:
    return {ln.split()[0]: int(ln.split()[1]) for ln in path.read_text().splitlines() if ln.strip()}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_ends_whole_tree_and_names_what_needed_kill(agent: AgentProc, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    run = agent.cli_json("launch", "--name", "tree", "--", sys.executable, str(PROGS / "tree.py"), str(pidfile))
    rid = run["id"]
    pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), what="the process tree")
    # every process is a member, wherever it went (own session; re-parented to init)
    assert psutil.Process(pids["orphan"]).ppid() != pids["main"]
    assert os.getsid(pids["stubborn"]) != os.getsid(pids["main"])

    def all_members() -> bool:
        snap = agent.cli_json("status", "--host", "local")
        run = next((r for r in snap["runs"] if r["id"] == rid), None)
        got = {m["pid"] for m in run["members"]} if run else set()
        return set(pids.values()) <= got

    wait_for(all_members, what="the agent to find every member by its tag")
    grace = 2.0
    t0 = time.monotonic()
    res = agent.cli_json("stop", rid, "--grace", str(grace))
    elapsed = time.monotonic() - t0
    # the time is bench/containment.py's to measure (a loaded test machine stretches it); the outcome is ours
    print(f"\nstop of a tree with a TERM-deaf member took {elapsed:.2f} s (grace {grace} s)")
    for role, pid in pids.items():
        assert gone(pid), f"{role} {pid} survived the stop"
    assert res["needed_kill"] == [pids["stubborn"]]
    hows = {p["pid"]: p["how"] for p in res["stopped"]}
    assert hows[pids["stubborn"]] == "SIGKILL"
    assert hows[pids["main"]] in ("SIGTERM", "zombie")
    assert hows[pids["orphan"]] in ("SIGTERM", "zombie")
    assert not res.get("survivors")
    runs = {r["id"]: r for r in agent.cli_json("runs")}
    assert runs[rid]["state"] == "stopped"
    assert "stopped by operator" in runs[rid]["cause"] and "needed SIGKILL" in runs[rid]["cause"]


def test_run_outcomes_have_causes(agent: AgentProc) -> None:
    ok = agent.cli_json("launch", "--", sys.executable, "-c", "print('fine')")["id"]
    bad = agent.cli_json("launch", "--", sys.executable, "-c", "import sys; sys.exit(3)")["id"]
    boom = agent.cli_json("launch", "--", sys.executable, "-c", "raise RuntimeError('CUDA out of memory. Tried to allocate 2 GiB')")["id"]
    killed = agent.cli_json("launch", "--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")["id"]

    def done() -> dict | None:
        runs = {r["id"]: r for r in agent.cli_json("runs")}
        if all(runs[i]["state"] not in ("starting", "running") for i in (ok, bad, boom, killed)):
            return runs
        return None

    runs = wait_for(done, timeout=20, what="all four runs to end")
    assert runs[ok]["state"] == "succeeded" and runs[ok]["exit_code"] == 0
    assert runs[bad]["state"] == "failed" and runs[bad]["exit_code"] == 3 and runs[bad]["cause"] == "exit code 3"
    assert runs[boom]["state"] == "failed" and "CUDA out of memory" in runs[boom]["cause"]
    assert runs[killed]["state"] == "failed" and runs[killed]["signal"] == "SIGKILL"
    assert agent.cli("tail", ok).stdout == "fine\n"


def test_failed_launch_is_recorded_and_says_what_to_do(agent: AgentProc) -> None:
    cp = agent.cli("launch", "--", "/no/such/trainer", check=False)
    assert cp.returncode != 0
    assert "does not exist" in cp.stderr and "recorded as failed" in cp.stderr
    runs = agent.cli_json("runs")
    assert runs[0]["state"] == "failed" and runs[0]["cause"].startswith("launch failed:")
    cp = agent.cli("launch", "--", "no-such-command-xyz", check=False)
    assert cp.returncode != 0 and "not on PATH" in cp.stderr
    if agent.cli_json("status", "--host", "local").get("gpu_error"):
        cp = agent.cli("launch", "--gpus", "0", "--", "true", check=False)
        assert cp.returncode != 0 and "no usable GPU" in cp.stderr
    cp = agent.cli("launch", "--gpus", "999", "--", "true", check=False)
    assert cp.returncode != 0 and "GPU" in cp.stderr
    cp = agent.cli("launch", check=False)
    assert cp.returncode == 2 and "needs a command" in cp.stderr
    cp = agent.cli("stop", "r-nonexistent", check=False)
    assert cp.returncode == 1 and "gpudeck runs" in cp.stderr


def test_launch_request_id_is_idempotent(agent: AgentProc) -> None:
    a = agent.cli_json("launch", "--request-id", "abc-1", "--", "sleep", "30")
    b = agent.cli_json("launch", "--request-id", "abc-1", "--", "sleep", "30")
    assert a["id"] == b["id"] and b["duplicate"] is True
    live = [r for r in agent.cli_json("runs") if r["state"] == "running"]
    assert len(live) == 1


def test_a_request_id_reused_with_another_command_is_refused(agent: AgentProc) -> None:
    a = agent.cli_json("launch", "--request-id", "abc-2", "--", "sleep", "30")
    cp = agent.cli("launch", "--request-id", "abc-2", "--", "sleep", "31", check=False)
    assert cp.returncode == 1 and "request id: 'abc-2' was already used for another launch (sleep 30)" in cp.stderr, cp.stderr
    assert a["id"] not in cp.stdout  # not answered with the first run
    assert [r["id"] for r in agent.cli_json("runs")] == [a["id"]]


def test_arguments_are_never_given_to_a_shell(agent: AgentProc, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    rid = agent.cli_json("launch", "--", "echo", f"; touch {marker}", "$(id)")["id"]
    wait_for(lambda: run_state(agent, rid) == "succeeded", what="echo to finish")
    assert agent.cli("tail", rid).stdout == f"; touch {marker} $(id)\n"
    assert not marker.exists()


def test_agent_kill9_runs_survive_and_are_readopted(agent: AgentProc, tmp_path: Path) -> None:
    long = agent.cli_json("launch", "--name", "long", "--", "sleep", "300")["id"]
    # the short run ends only when told to, after the agent is gone: a fixed sleep raced the kill on a busy machine
    go = tmp_path / "go"
    short = agent.cli_json(
        "launch",
        "--name",
        "short",
        "--",
        sys.executable,
        "-c",
        f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\nraise SystemExit(4)",
    )["id"]
    snap = agent.cli_json("status", "--host", "local")
    leader = next(m for r in snap["runs"] if r["id"] == long for m in r["members"] if m["role"] == "leader")
    agent.kill9()
    go.touch()
    # the short run ends while no agent watches; its shim leaves the exit status behind
    wait_for(lambda: (agent.state_dir / "runs" / short / "exit.json").exists(), timeout=20, what="the short run to end")
    assert alive(leader["pid"], leader["create_time"]), "the run died with the agent"
    agent.start()
    runs = {r["id"]: r for r in agent.cli_json("runs")}
    assert runs[long]["state"] == "running"
    assert runs[short]["state"] == "failed" and runs[short]["exit_code"] == 4
    assert "ended while the agent was down" in runs[short]["cause"]
    res = agent.cli_json("stop", long, "--grace", "2")
    assert res["state"] == "stopped"
    assert not alive(leader["pid"], leader["create_time"])


def test_run_whose_shim_vanished_is_lost_with_what_is_known(agent: AgentProc) -> None:
    rid = agent.cli_json("launch", "--", "sleep", "300")["id"]
    run = next(r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid)
    agent.kill9()
    for m in run["members"]:
        os.kill(m["pid"], signal.SIGKILL)  # shim and leader die together: no exit status anywhere
    t_kill = time.time()
    time.sleep(1.5)
    agent.start()
    r = next(r for r in agent.cli_json("runs") if r["id"] == rid)
    assert r["state"] == "lost"
    assert "exit status unknown" in r["cause"] and "is gone" in r["cause"] and r["exit_code"] is None, r["cause"]
    # no agent watched the end: it is dated by the run's last evidence (here the last write to its output.log, at its
    # start), said in the cause, never by when the restarted agent noticed
    assert r["ended"] <= t_kill and "the last evidence: the last write to its output.log" in r["cause"], r["cause"]


def test_pid_reuse_is_never_signalled(agent: AgentProc) -> None:
    from gpudeck.agents.observe.procs import signal_exact

    victim = subprocess.Popen(["sleep", "60"])
    try:
        ct = create_time_of(victim.pid)
        assert ct is not None
        # the recorded create_time differs: the pid now names another process
        assert signal_exact(victim.pid, ct - 5.0, signal.SIGKILL) is False
        time.sleep(0.2)
        assert victim.poll() is None
        # a journal whose run records that pid with another create_time: stop leaves it alone
        rid = agent.cli_json("launch", "--", "sleep", "300")["id"]
        agent.kill9()
        real = journal_add_member(agent.state_dir, rid, {"pid": victim.pid, "create_time": ct - 5.0, "role": "worker"})
        agent.start()
        res = agent.cli_json("stop", rid, "--grace", "1")
        assert victim.poll() is None, "a reused pid was signalled"
        assert victim.pid not in [p["pid"] for p in res["stopped"] if p["how"] != "already_gone"]
        for m in real:
            assert not alive(m["pid"], m["create_time"])
    finally:
        victim.kill()
        victim.wait()


def test_tail_follow_streams_until_the_run_ends(agent: AgentProc) -> None:
    rid = agent.cli_json(
        "launch", "--", sys.executable, "-c", "import time\nfor i in range(5):\n    print('tick', i, flush=True); time.sleep(0.3)"
    )["id"]
    cp = agent.cli("tail", rid, "-f", "-n", "-1", timeout=30)
    assert [ln for ln in cp.stdout.splitlines()] == [f"tick {i}" for i in range(5)]


def test_stop_of_an_ended_run_reports_and_touches_nothing(agent: AgentProc) -> None:
    rid = agent.cli_json("launch", "--", "true")["id"]
    wait_for(lambda: run_state(agent, rid) == "succeeded", what="true to end")
    res = agent.cli_json("stop", rid)
    assert res["state"] == "succeeded" and "already ended" in res["message"]


def test_orphan_of_a_killed_leader_is_stale_and_stop_reclaims_it(agent: AgentProc, tmp_path: Path) -> None:
    """Failure 2 on CPU: the leader dies alone; its worker lives on, still attributed to the run."""
    pidfile = tmp_path / "pids"
    rid = agent.cli_json("launch", "--", sys.executable, str(PROGS / "tree.py"), str(pidfile))["id"]
    pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), what="the tree")
    wait_for(
        lambda: len(next(r for r in agent.cli_json("status", "--host", "local")["runs"] if r["id"] == rid)["members"]) >= 4, what="members"
    )
    os.kill(pids["main"], signal.SIGKILL)
    r = wait_for(
        lambda: next((r for r in agent.cli_json("runs") if r["id"] == rid and r["state"] == "failed"), None), what="the run to fail"
    )
    assert r["signal"] == "SIGKILL"
    assert psutil.pid_exists(pids["orphan"]) and psutil.pid_exists(pids["stubborn"])
    res = agent.cli_json("stop", rid, "--grace", "1")
    assert "already ended" in res["message"]
    assert {p["pid"] for p in res["stopped"]} >= {pids["orphan"], pids["stubborn"]}
    assert gone(pids["orphan"]) and gone(pids["stubborn"])


def test_snapshot_lists_every_live_member_with_its_process_facts(agent: AgentProc, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    rid = agent.cli_json("launch", "--", sys.executable, str(PROGS / "tree.py"), str(pidfile))["id"]
    pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), what="the tree")

    def rows() -> dict[int, dict] | None:
        procs = {p["pid"]: p for p in agent.cli_json("status", "--host", "local")["processes"] if p.get("run_id") == rid}
        return procs if set(pids.values()) <= set(procs) else None

    procs = wait_for(rows, what="every member in the snapshot's process list")
    main = procs[pids["main"]]
    assert main["status"] in ("sleeping", "running") and main["rss"] > 0 and main["user"]
    assert main["cmdline"][1].endswith("tree.py")
    assert procs[pids["stubborn"]]["sid"] != main["sid"]
    assert procs[pids["orphan"]]["ppid"] != pids["main"]


def test_runs_caught_between_record_and_start_are_settled_by_evidence(agent: AgentProc) -> None:
    """The agent dies after recording a launch: a started process is adopted, a missing one is recorded as interrupted."""
    import time as _time

    from gpudeck.agents.storage.journal import Journal
    from gpudeck.agents.wire.protocol import LaunchSpec, RunInfo

    agent.kill9()
    j = Journal(agent.state_dir / "journal.db", "h")
    for rid in ("r-started0", "r-missing0"):
        j.create_run(
            RunInfo(
                id=rid,
                host="h",
                state="starting",
                spec=LaunchSpec(argv=["sleep", "300"]),
                created=_time.time(),
                run_dir=str(agent.state_dir / "runs" / rid),
            )
        )
    j.close()
    worker = subprocess.Popen(["sleep", "300"], env={**os.environ, "GPUDECK_RUN_ID": "r-started0"}, start_new_session=True)
    try:
        agent.start()
        runs = {r["id"]: r for r in agent.cli_json("runs")}
        assert runs["r-missing0"]["state"] == "failed" and "launch interrupted" in runs["r-missing0"]["cause"]
        assert runs["r-started0"]["state"] == "running"
        assert worker.pid in {m["pid"] for m in runs["r-started0"]["members"]}
        res = agent.cli_json("stop", "r-started0", "--grace", "2")
        assert res["state"] == "stopped" and worker.wait(5) == -signal.SIGTERM
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_launch_whose_run_id_has_a_folder_already_is_refused_and_leaves_that_folder_alone(agent: AgentProc) -> None:
    """A run folder the journal does not know (left by an epoch whose journal was moved aside) and a launch given that
    run id: the failing launch used to remove the folder (its spec.json and output.log lost). Now it is refused,
    typed, saying what to do, and the folder is kept."""
    import asyncio

    import pytest

    from gpudeck.agents.wire.client import AgentClient
    from gpudeck.agents.wire.errors import AgentError
    from gpudeck.agents.wire.protocol import Launch, LaunchSpec

    rid = "r-01d0e90c"
    folder = agent.state_dir / "runs" / rid
    folder.mkdir(mode=0o700)
    (folder / "output.log").write_text("the old epoch's output\n")

    async def launch() -> object:
        c = await AgentClient.connect_unix(state_dir=agent.state_dir, autostart=False)
        try:
            return await c.request(Launch(request_id="reuse-1", spec=LaunchSpec(argv=["true"], run_id=rid, cwd="/")))
        finally:
            await c.close()

    with pytest.raises(AgentError) as exc:
        asyncio.run(launch())
    print(f"\nrefused: {exc.value.message}")
    assert "exists already" in exc.value.message and "nothing was started" in exc.value.message
    assert (folder / "output.log").read_text() == "the old epoch's output\n"
