"""Who a socket peer is (a run's process or the operator) and the connection budget: real processes with a real run
tag, one that cleared its environment under a tagged parent, and plain ones."""

from __future__ import annotations

import os
import subprocess
import time

import psutil

from gpudeck.agents.server.peers import OPERATOR_RESERVE, PER_PID, PER_RUN, ConnBudget, Peer, PeerFinder


def _child_of(pid: int) -> int:
    """The child of ``pid`` once it runs ``sleep``: until `env -i` has exec'd it, the forked child still carries its
    parent's environment (tag included), and the test would see a tagged process, not a cleared one."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for kid in psutil.Process(pid).children():
            try:
                if kid.cmdline()[:1] == ["sleep"]:
                    return kid.pid
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)
    raise AssertionError("no sleep child appeared")


def test_a_peer_is_placed_by_cgroup_tag_member_or_a_tagged_parent() -> None:
    tagged = subprocess.Popen(["sleep", "60"], env={**os.environ, "GPUDECK_RUN_ID": "r-tag"})
    # a run's process that cleared its environment (env -i) is still its tagged parent's child
    shell = subprocess.Popen(["sh", "-c", "env -i sleep 60; true"], env={**os.environ, "GPUDECK_RUN_ID": "r-env"})
    plain = subprocess.Popen(["sleep", "60"], env={k: v for k, v in os.environ.items() if k != "GPUDECK_RUN_ID"})
    grouped = subprocess.Popen(["sleep", "60"])
    try:
        cleared = _child_of(shell.pid)
        finder = PeerFinder(lambda pid: "r-cg" if pid == grouped.pid else None, dict)
        assert finder.peer(tagged.pid, 0) == Peer(pid=tagged.pid, uid=0, run_id="r-tag", how="tag")
        got = finder.peer(cleared, 0)
        assert got.run_id == "r-env" and got.how == f"parent {shell.pid} (its tag)", got
        assert finder.peer(plain.pid, 0).run_id is None  # the operator's
        assert finder.peer(grouped.pid, 0).how == "cgroup"
        again = PeerFinder(lambda pid: None, lambda: {plain.pid: "r-mem"})
        assert again.peer(plain.pid, 0).run_id == "r-mem" and again.peer(plain.pid, 0).how == "member"
        assert finder.peer(999_999_999, 0).run_id is None  # gone (or never was): holds nothing
    finally:
        for p in (tagged, shell, plain, grouped):
            p.kill()
            p.wait()


def test_the_budget_caps_a_process_a_run_and_all_runs_and_never_the_operator() -> None:
    b = ConnBudget(cap=200)
    assert b.reserve == OPERATOR_RESERVE
    assert ConnBudget(cap=40).reserve == 10  # a quarter of a small cap
    op = Peer(pid=1, uid=0)
    for _ in range(500):
        assert b.refusal(op, "h") is None  # the operator is limited by the cap alone (and idle eviction)
    one = Peer(pid=10, uid=0, run_id="r-a", how="tag")
    for _ in range(PER_PID):
        assert b.refusal(one, "h") is None
        b.add(one)
    assert "the most one process of a run may" in (b.refusal(one, "h") or "")
    for i in range(PER_RUN - PER_PID):
        b.add(Peer(pid=11 + i, uid=0, run_id="r-a"))
    assert "the most one run may" in (b.refusal(Peer(pid=99, uid=0, run_id="r-a"), "h") or "")
    b.remove(one)
    assert b.refusal(one, "h") is None and b.by_pid[one.pid] == PER_PID - 1
    n = 1000
    while b.runs_total < 200 - OPERATOR_RESERVE:
        b.add(Peer(pid=n, uid=0, run_id=f"r-{n // 4}"))
        n += 1
    why = b.refusal(Peer(pid=n, uid=0, run_id="r-new"), "h") or ""
    assert f"runs hold {200 - OPERATOR_RESERVE} of the agent's 200 connections" in why and b.refused == 3
