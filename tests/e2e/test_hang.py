"""Hangs and stragglers on CPU with real processes: a real torchrun of fsdp_lm (gloo) and a plain command, under the agent.

- rank 2 of a 4-rank run sleeps before step 6 (GPUDECK_TEST_SLEEP_AT_STEP, outside any collective): the hang alert
  comes, the triage names rank 2 and where it sleeps, all 4 ranks' stacks are stored, the Flight Recorder summary
  says rank 2 is behind in the collectives, the run is still alive;
- rank 1 of a 2-rank run is throttled by a SIGSTOP/SIGCONT duty cycle from the test: a straggler alert names it,
  and clears once the duty cycle ends;
- a plain command that reports steps and then hangs: its stacks come through py-spy, the method stated.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpudeck.agents.observe.procs import alive
from gpudeck.agents.wire.protocol import GetEvents, GetRun
from tests.agent_harness import ROOT, AgentProc, teardown_agent, wait_for
from tests.trainer_harness import fsdp_endless_argv

pytest.importorskip("torch")
pytestmark = pytest.mark.slow
PROGS = Path(__file__).resolve().parent / "progs"


def fsdp_argv(out: Path, nproc: int) -> list[str]:
    return fsdp_endless_argv(out, nproc, "--checkpoint-every", "100000", "--no-final-checkpoint", "--device", "cpu")


def live_run(a: AgentProc, rid: str) -> dict[str, Any] | None:
    run = a.ask(GetRun(run_id=rid)).get("run")
    return run if run and run["state"] in ("starting", "running", "stopping") else None


def alert_of(a: AgentProc, rid: str, kind: str) -> dict[str, Any] | None:
    run = live_run(a, rid) or {}
    return next((al for al in run.get("alerts") or [] if al["kind"] == kind), None)


def events_of(a: AgentProc, rid: str) -> list[dict[str, Any]]:
    return [e for e in a.ask(GetEvents(after_seq=0))["events"] if e.get("run_id") == rid]


def triages(a: AgentProc, rid: str) -> list[dict[str, Any]]:
    return [e["data"]["triage"] for e in events_of(a, rid) if e["kind"] == "triage"]


def test_a_rank_asleep_outside_the_collectives_is_a_hang_triaged_by_name(agent: AgentProc, tmp_path: Path) -> None:
    a = agent
    rid = a.cli_json(
        "launch",
        "--name",
        "hang4",
        "--cwd",
        str(ROOT),
        "--hang-after",
        "4",
        "--env",
        "GPUDECK_TEST_SLEEP_AT_STEP=6:2:600",
        "--",
        *fsdp_argv(tmp_path / "out", 4),
    )["id"]
    hang = wait_for(lambda: alert_of(a, rid, "hang"), timeout=240, interval=0.25, what="the hang alert")
    assert hang["severity"] == "critical" and "after step 5 with 4 ranks alive" in hang["message"], hang
    assert hang["data"]["seconds"] - hang["data"]["threshold_s"] < 10.0  # raised within 10 s of the threshold
    t = wait_for(lambda: triages(a, rid), timeout=60, interval=0.25, what="the stored triage")[0]
    assert t["reason"] == "hang alert" and t["seconds"] < 30
    assert t["culprit"].startswith("rank 2 ") and "maybe_sleep_for_test" in t["culprit"] and "every other rank waits in" in t["culprit"], t
    ranks = {e["rank"]: e for e in t["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    for e in ranks.values():  # every rank's stacks, by the trainers' own handler, said so
        assert e["method"] == "faulthandler" and "SIGUSR2" in e["method_why"] and "no ptrace needed" in e["method_why"]
        assert "fsdp_lm/trainer.py" in e["stacks"] and e["state"] in ("sleeping", "running", "disk-sleep") and e["cpu_percent"] is not None
    assert ranks[2]["in_collective"] is False and all(ranks[r]["in_collective"] for r in (0, 1, 3))
    # torch's Flight Recorder (gloo too, torch >= 2.9), dumped by each rank's own thread on the agent's request
    fr = t["flight_recorder"]
    assert fr.startswith("Flight Recorder (default_pg): rank 2 last completed ") and "ranks 0, 1 and 3 are in seq " in fr, fr
    assert fr.endswith(": rank 2 is behind"), fr
    # the run goes on: nothing was stopped or killed
    run = live_run(a, rid)
    assert run is not None and run["state"] == "running"
    assert all(alive(m["pid"], m["create_time"]) for m in run["members"])
    # on demand, stored as well; `gpudeck show` prints the newest
    cp = a.cli("triage", rid)
    assert "likely culprit: rank 2" in cp.stdout and "stacks by faulthandler" in cp.stdout and "rank 2 is behind" in cp.stdout
    assert len(triages(a, rid)) == 2
    shown = a.cli("show", rid).stdout
    assert "TRIAGE" in shown and "likely culprit: rank 2" in shown and "rank 2 is behind" in shown
    a.cli_json("stop", rid, "--grace", "3")


def test_a_throttled_rank_is_a_straggler_until_the_throttle_ends(agent: AgentProc, tmp_path: Path) -> None:
    a = agent
    rid = a.cli_json("launch", "--name", "straggle", "--cwd", str(ROOT), "--", *fsdp_argv(tmp_path / "out", 2))["id"]

    def rank1() -> int | None:
        run = live_run(a, rid) or {}
        tel = run.get("telemetry") or {}
        if (tel.get("step") or 0) < 3:
            return None
        return next((m["pid"] for m in run.get("members", []) if m.get("rank") == 1), None)

    pid = wait_for(rank1, timeout=180, interval=0.25, what="rank 1 stepping")
    stop = threading.Event()

    def duty_cycle() -> None:  # stopped two thirds of the time
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.2)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)

    th = threading.Thread(target=duty_cycle, daemon=True)
    th.start()
    try:
        al = wait_for(lambda: alert_of(a, rid, "straggler"), timeout=120, interval=0.25, what="the straggler alert")
    finally:
        stop.set()
        th.join()
        os.kill(pid, signal.SIGCONT)
    assert al["rank"] == 1 and al["pid"] == pid and al["message"].startswith("rank 1 on ") and "(cpu)" in al["message"], al
    assert al["data"]["ratio"] >= 1.3
    wait_for(lambda: alert_of(a, rid, "straggler") is None, timeout=120, interval=0.25, what="the straggler alert cleared")
    events = events_of(a, rid)
    assert any(e["kind"] == "alert_cleared" and e["data"]["alert"]["kind"] == "straggler" for e in events)
    a.cli_json("stop", rid, "--grace", "20")


def test_a_plain_command_that_hangs_is_triaged_with_py_spy(agent: AgentProc) -> None:
    a = agent
    rid = a.cli_json("launch", "--name", "plain-hang", "--hang-after", "2", "--", sys.executable, str(PROGS / "hang_plain.py"))["id"]
    wait_for(lambda: alert_of(a, rid, "hang"), timeout=60, interval=0.25, what="the hang alert")
    t = wait_for(lambda: triages(a, rid), timeout=60, interval=0.25, what="the stored triage")[0]
    (e,) = [x for x in t["ranks"] if "hang_plain.py" in x["stacks"]] or t["ranks"][:1]
    assert "not a gpudeck trainer" in e["method_why"]
    if e["method"] == "py-spy":  # where ptrace is permitted (root here, or ptrace_scope 0/1 for the agent's children)
        assert "ptrace permitted" in e["method_why"] and "wait_for_the_lock_forever" in e["stacks"]
        assert "wait_for_the_lock_forever" in t["culprit"]
    else:
        assert e["method"] == "none" and "py-spy" in e["method_why"] and t["missing"]
    assert "not a gpudeck trainer" in t["flight_recorder"]
    assert live_run(a, rid)["state"] == "running"  # type: ignore[index]
    a.cli_json("stop", rid, "--grace", "2")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop CAP_SYS_PTRACE")
def test_a_plain_command_py_spy_may_not_read_is_triaged_saying_what_is_missing_and_why(tmp_path: Path) -> None:
    """A real refusal: the agent runs without CAP_SYS_PTRACE (setpriv drops it from its bounding and inheritable sets)
    and the command makes itself non-dumpable (prctl PR_SET_DUMPABLE 0), so the kernel refuses py-spy's ptrace."""
    a = AgentProc(tmp_path / "home", prefix=("setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"))
    a.start()
    try:
        argv = [sys.executable, str(PROGS / "hang_plain.py")]
        rid = a.cli_json("launch", "--name", "no-ptrace", "--hang-after", "2", "--env", "HANG_PLAIN_NONDUMPABLE=1", "--", *argv)["id"]
        wait_for(lambda: alert_of(a, rid, "hang"), timeout=60, interval=0.25, what="the hang alert")
        t = wait_for(lambda: triages(a, rid), timeout=60, interval=0.25, what="the stored triage")[0]
        (e,) = t["ranks"]
        assert e["method"] == "none" and not e.get("stacks") and e["state"] in ("sleeping", "running"), e
        why = e["method_why"]
        assert "not a gpudeck trainer" in why and "py-spy dump failed: Error: " in why and "Permission denied" in why, why
        assert "lacks CAP_SYS_PTRACE" in why and "not dumpable" in why and "PR_SET_DUMPABLE" in why, why
        assert t["missing"] == [f"pid {e['pid']} on {e['host']}: no stacks ({why})"], t["missing"]
        assert t["culprit"].startswith("no stacks could be gathered: pid "), t["culprit"]
        shown = a.cli("show", rid).stdout
        assert "MISSING pid" in shown and "lacks CAP_SYS_PTRACE" in shown, shown
        assert live_run(a, rid)["state"] == "running"  # type: ignore[index]
        a.cli_json("stop", rid, "--grace", "2")
    finally:
        teardown_agent(a)


def test_on_hang_stop_triages_first_then_stops_the_run(agent: AgentProc) -> None:
    a = agent
    argv = [sys.executable, str(PROGS / "hang_plain.py")]
    rid = a.cli_json("launch", "--name", "hang-stop", "--hang-after", "2", "--on-hang", "stop", "--", *argv)["id"]
    wait_for(lambda: a.ask(GetRun(run_id=rid))["run"]["state"] == "stopped", timeout=90, interval=0.25, what="the run stopped")
    run = a.ask(GetRun(run_id=rid))["run"]
    assert "--on-hang stop" in run["cause"] and run["cause"].startswith("stopped by gpudeck: no step for"), run["cause"]
    assert a.cli_json("show", rid)["cause_class"] == "hang"
    kinds = [e["kind"] for e in events_of(a, rid)]
    assert "triage" in kinds and kinds.index("triage") < max(i for i, k in enumerate(kinds) if k == "run_state")
    cp = a.cli("launch", "--on-hang", "panic", "--", "true", check=False)
    assert cp.returncode == 2 and "on hang: 'panic' is not a choice; choose triage, alert or stop" in cp.stderr
