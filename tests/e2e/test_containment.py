"""End-to-end tests of run containment at each level: real agents, real processes, real cgroups (as root).

The cgroupfs level runs where the test machine has a writable cgroup v2 (found from
/proc/self/mountinfo); the tag + ancestry level always runs; the systemd scope
level skips with the reason this host has no systemd manager.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpudeck.agents.observe.procs import alive, create_time_of
from gpudeck.agents.safety.containment import (
    CgroupFs,
    agent_key,
    cgroup2_mount,
    detect,
    systemd_unavailable,
)
from gpudeck.agents.wire.errors import BadRequest
from tests.agent_harness import AgentProc, journal_add_member, kill_pids, teardown_agent, wait_for
from tests.e2e.test_agent_runs import gone, read_pids

PROGS = Path(__file__).parent / "progs"
ESCAPE = str(PROGS / "escape.py")
PY = sys.executable


def _cgroupfs_reason() -> str | None:
    probe = Path("/tmp") / f"gd-probe-{os.getpid()}"
    got = detect(probe, forced="cgroupfs")
    if isinstance(got, CgroupFs):
        try:
            got.base.rmdir()
        except OSError:
            pass
        return None
    return got.reason


CGROUPFS_SKIP = _cgroupfs_reason()
LEVELS = [
    pytest.param("cgroupfs", marks=pytest.mark.skipif(CGROUPFS_SKIP is not None, reason=f"no cgroupfs containment here: {CGROUPFS_SKIP}")),
    "tag",
]


def _base(home: Path) -> Path | None:
    mount = cgroup2_mount()
    return Path(mount) / "gpudeck" / agent_key(home / "agent" / "runs") if mount else None


@pytest.fixture(params=LEVELS)
def level(request: pytest.FixtureRequest, gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("GPUDECK_CONTAINMENT", request.param)
    return request.param


@pytest.fixture
def cagent(level: str, gpudeck_home: Path) -> Iterator[AgentProc]:
    a = AgentProc(gpudeck_home).start()
    yield a
    teardown_agent(a)
    base = _base(gpudeck_home)
    if base is not None and base.is_dir():
        for d in sorted(base.iterdir(), reverse=True):
            if d.is_dir():
                kill_pids([int(x) for x in (d / "cgroup.procs").read_text().split()])
                time.sleep(0.1)
                try:
                    d.rmdir()
                except OSError:
                    pass
        try:
            base.rmdir()
        except OSError:
            pass


def _run(a: AgentProc, rid: str) -> dict:
    snap = a.cli_json("status", "--host", "local")
    run = next((r for r in snap["runs"] if r["id"] == rid), None)
    if run is None:
        run = next(r for r in a.cli_json("runs") if r["id"] == rid)
    return run


def _members(a: AgentProc, rid: str) -> set[int]:
    return {m["pid"] for m in _run(a, rid).get("members", [])}


def _launch(a: AgentProc, tmp_path: Path, *modes: str) -> tuple[str, dict[str, int], Path]:
    pidfile = tmp_path / "pids"
    rid = a.cli_json("launch", "--", PY, ESCAPE, str(pidfile), *modes)["id"]
    pids = wait_for(lambda: pidfile.exists() and read_pids(pidfile), timeout=30, what="the run's processes")
    return rid, pids, pidfile


def test_each_run_says_its_containment_and_the_agent_logs_the_level(cagent: AgentProc, level: str) -> None:
    rid = cagent.cli_json("launch", "--", "sleep", "60")["id"]
    c = wait_for(lambda: _run(cagent, rid).get("containment"), what="the run's containment")
    if level == "cgroupfs":
        assert c["level"] == "cgroupfs" and c["label"] == "cgroup (cgroupfs)"
        group = Path(c["group"])
        assert group.is_dir() and group.parent == _base(cagent.home)
        leader = next(m for m in _run(cagent, rid)["members"] if m["role"] == "leader")
        assert leader["pid"] in [int(x) for x in (group / "cgroup.procs").read_text().split()], "the first process is in the group"
        # the kernel's figures where present, the reason where not
        wait_for(lambda: _run(cagent, rid)["containment"].get("cpu_seconds") is not None, what="the group's cpu.stat")
        c = _run(cagent, rid)["containment"]
        if c.get("memory_peak_bytes") is None:
            assert "memory controller" in c["figures_note"] or "memory.peak" in c["figures_note"]
    else:
        assert c["level"] == "tag" and c["label"].startswith("tag + ancestry only: ") and "GPUDECK_CONTAINMENT=tag" in c["label"]
    assert f"containment: {c['label']}" in cagent.log()
    res = cagent.cli_json("stop", rid, "--grace", "2")
    assert res["containment"] == c["label"]
    if level == "cgroupfs":
        assert "emptied (populated 0)" in res["group_note"] and "removed" in res["group_note"]
        assert not Path(c["group"]).exists()


def test_stop_leaves_nothing_of_an_env_clearing_double_forking_sigterm_ignoring_run(cagent: AgentProc, level: str, tmp_path: Path) -> None:
    rid, pids, _ = _launch(cagent, tmp_path, "envclear", "daemon", "daemon-envclear", "deaf")
    # the daemons left the leader's session and tree; two of them carry no tag at all
    assert os.getsid(pids["daemon"]) != os.getsid(pids["main"])
    assert "GPUDECK_RUN_ID" not in psutil.Process(pids["envclear"]).environ()
    assert "GPUDECK_RUN_ID" not in psutil.Process(pids["daemon_envclear"]).environ()
    wait_for(lambda: set(pids.values()) <= _members(cagent, rid), timeout=20, what="every process to be a member")
    run = _run(cagent, rid)
    by_pid = {m["pid"]: m for m in run["members"]}
    # the kernel (or the ancestry) found it, not the tag; whether it shows as untagged depends on whether the agent
    # first read it before or after its exec into `env -i` (a fresh-clone CI run read it before), so that is printed
    assert by_pid[pids["envclear"]]["found_by"] == ("cgroup" if level == "cgroupfs" else "ancestry")
    print(
        f"\nenv-clearing member: tagged={by_pid[pids['envclear']].get('tagged', True)}; untagged in the group: {(run.get('containment') or {}).get('untagged')}"
    )
    res = cagent.cli_json("stop", rid, "--grace", "1")
    for role, pid in pids.items():
        assert gone(pid), f"{role} {pid} survived the stop at the {level} level: {res['message']}"
    assert not res.get("survivors")
    assert set(res["needed_kill"]) >= {pids["deaf"], pids["daemon_envclear"]}
    hows = {p["pid"]: p["how"] for p in res["stopped"]}
    assert hows[pids["deaf"]] == "SIGKILL"


def test_a_process_forked_during_the_grace_is_still_stopped(cagent: AgentProc, level: str, tmp_path: Path) -> None:
    rid, pids, pidfile = _launch(cagent, tmp_path, "fork-on-term")
    wait_for(lambda: pids["main"] in _members(cagent, rid), what="the leader")
    res = cagent.cli_json("stop", rid, "--grace", "2")
    late = read_pids(Path(str(pidfile) + ".late"))["late"]
    assert gone(late), f"the process forked during the grace ({late}) survived: {res['message']}"
    assert late in res["needed_kill"], res
    assert {p["pid"]: p["how"] for p in res["stopped"]}.get(late) == "SIGKILL"


def test_an_env_cleared_process_forked_during_the_grace_is_stopped_through_the_group(cagent: AgentProc, level: str, tmp_path: Path) -> None:
    rid, pids, pidfile = _launch(cagent, tmp_path, "fork-on-term-envclear")
    wait_for(lambda: pids["main"] in _members(cagent, rid), what="the leader")
    res = cagent.cli_json("stop", rid, "--grace", "2")
    late = read_pids(Path(str(pidfile) + ".late"))["late"]
    try:
        if level == "cgroupfs":
            assert gone(late), res["message"]
            assert late in res["needed_kill"]
        else:
            # the leader left before a re-scan saw its env-cleared child, which init now owns: no tag, no parentage.
            # the tag level cannot promise this one, and the result says why
            if not gone(late):
                assert "cannot be found" in res["group_note"] and "cgroup" in res["group_note"]
    finally:
        kill_pids([late])


def test_a_daemon_left_behind_by_a_finished_run_is_a_leftover_of_its_group(cagent: AgentProc, level: str, tmp_path: Path) -> None:
    rid, pids, _ = _launch(cagent, tmp_path, "daemon-envclear", "leader-exits")
    daemon = pids["daemon_envclear"]
    try:
        wait_for(lambda: _run(cagent, rid)["state"] == "succeeded", timeout=20, what="the run to end")
        listed = {lo["pid"]: lo for lo in cagent.cli_json("reclaim", "local")["leftovers"]} if level == "cgroupfs" else {}
        if level == "cgroupfs":
            # no tag, not a descendant of anything of the run: the kernel still says whose it is
            assert listed[daemon]["kind"] == "orphan" and listed[daemon]["run_id"] == rid, listed
            res = cagent.cli_json("stop", rid, "--grace", "1")
            assert "already ended" in res["message"] and gone(daemon)
            assert not (_base(cagent.home) / rid).exists(), "the ended run's emptied group is removed"
    finally:
        kill_pids([daemon])


def test_pid_reuse_during_a_stop_a_stranger_is_neither_signalled_nor_blamed(
    level: str, gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUDECK_SIMULATE_GPUS", "2:H200:141")
    a = AgentProc(gpudeck_home).start()
    # a stranger (no tag, not in any run) holding GPU memory, as a process given a member's old pid would
    stranger = subprocess.Popen([PY, "-c", "import time\nwhile True: time.sleep(1)"], env={**a.env, "GPUDECK_SIM_GPU_MEM": "0:7"})
    try:
        rid = a.cli_json("launch", "--gpus", "1", "--", "sleep", "300")["id"]
        wait_for(lambda: _run(a, rid)["state"] == "running", what="the run")
        wait_for(
            lambda: any(p["pid"] == stranger.pid for p in a.cli_json("status", "--host", "local")["gpus"][0]["processes"]),
            what="the stranger on GPU 0",
        )
        ct = create_time_of(stranger.pid)
        assert ct is not None
        a.kill9()
        # the run once had a member with this pid: it exited, and the pid went to the stranger
        journal_add_member(a.state_dir, rid, {"pid": stranger.pid, "create_time": ct - 30.0, "role": "worker", "found_by": "tag"})
        a.start()
        res = a.cli_json("stop", rid, "--grace", "1")
        assert stranger.poll() is None, "the stranger was signalled"
        assert stranger.pid not in [p["pid"] for p in res["stopped"] if p["how"] != "already_gone"]
        assert not res.get("still_on_gpu") and res["gpu_verified"] is True, f"the stranger was blamed: {res['gpu_note']}"
        assert res["gpu_note"].startswith("verified on the SIMULATED GPUs") and "NVML here" in res["gpu_note"]  # never "through NVML"
    finally:
        stranger.kill()
        stranger.wait()
        teardown_agent(a)
        base = _base(gpudeck_home)
        if base is not None:
            try:
                base.rmdir()
            except OSError:
                pass


def test_containment_survives_an_agent_kill9_and_the_stop_goes_through_the_group(cagent: AgentProc, level: str, tmp_path: Path) -> None:
    rid, pids, _ = _launch(cagent, tmp_path, "envclear", "daemon")
    wait_for(lambda: set(pids.values()) <= _members(cagent, rid), timeout=20, what="every member")
    before = _run(cagent, rid)["containment"]
    cagent.kill9()
    cagent.start()
    after = wait_for(lambda: _run(cagent, rid).get("containment"), what="the re-adopted run's containment")
    assert after["label"] == before["label"] and after.get("group") == before.get("group")
    res = cagent.cli_json("stop", rid, "--grace", "1")
    for role, pid in pids.items():
        assert gone(pid), f"{role} survived the stop after the restart"
    if level == "cgroupfs":
        assert "emptied (populated 0)" in res["group_note"] and not Path(before["group"]).exists()


def test_agent_kill9_mid_stop_the_restarted_agent_counts_the_grace_already_spent(cagent: AgentProc, level: str, tmp_path: Path) -> None:
    import asyncio

    from gpudeck.agents.wire.errors import AgentUnavailable
    from gpudeck.agents.wire.protocol import Stop

    rid, pids, _ = _launch(cagent, tmp_path, "deaf")
    wait_for(lambda: set(pids.values()) <= _members(cagent, rid), timeout=20, what="every member")
    grace = 8.0  # 3 s spent before the kill, 5 s left: a restarted agent that waited a new full grace is told apart

    async def begin_and_die() -> None:
        c = await cagent.client()
        stop = asyncio.ensure_future(c.request(Stop(run_id=rid, grace_s=grace), timeout=90))
        await asyncio.to_thread(wait_for, lambda: _journal_state(cagent, rid) == "stopping", 20.0, 0.05, "the stop to begin")
        await asyncio.sleep(3.0)  # SIGTERM sent and ignored by the deaf child; 3 s of the grace spent
        cagent.kill9()
        with pytest.raises(AgentUnavailable):
            await stop
        await c.close()

    asyncio.run(begin_and_die())
    assert not gone(pids["deaf"]), "the run died with the agent"
    cagent.start()
    row = wait_for(
        lambda: _journal_state(cagent, rid) == "stopped" and _journal_row(cagent, rid),
        timeout=60,
        what="the restarted agent to finish the stop",
    )
    left = {role: pid for role, pid in pids.items() if not gone(pid)}
    assert not left, f"{left} outlived the finished stop: {row['cause']}; agent log: {cagent.log()}"
    assert "finished by a restarted agent" in row["cause"], row["cause"]
    db = sqlite3.connect(cagent.state_dir / "journal.db")
    ends = [json.loads(d) for (d,) in db.execute("SELECT data FROM events WHERE run_id=? AND kind='run_state'", (rid,))]
    db.close()
    stop = [e for e in ends if e.get("state") == "stopped"][-1]["stop"]
    assert stop["resumed_after_s"] >= 3.0, stop
    # the time already spent counted: it did not wait a new full grace (the grace left is in the cause)
    left = float(row["cause"].split("(")[1].split(" s of the")[0])
    assert left <= grace - 3.0 + 0.5, row["cause"]


def _journal_row(a: AgentProc, rid: str) -> dict:
    db = sqlite3.connect(a.state_dir / "journal.db")
    db.row_factory = sqlite3.Row
    try:
        r = db.execute("SELECT * FROM runs WHERE id=?", (rid,)).fetchone()
        return dict(r) if r else {}
    finally:
        db.close()


def _journal_state(a: AgentProc, rid: str) -> str | None:
    return _journal_row(a, rid).get("state")


def test_another_uids_tagged_process_is_reported_and_never_signalled(cagent: AgentProc, level: str) -> None:
    rid = cagent.cli_json("launch", "--", "sleep", "300")["id"]
    run = wait_for(lambda: (r := _run(cagent, rid))["state"] == "running" and r, what="the run")
    env = {"PATH": os.environ["PATH"], "GPUDECK_RUN_ID": rid, "GPUDECK_RUN_DIR": run["run_dir"]}
    nobody = 65534
    other = subprocess.Popen(["sleep", "300"], env=env, user=nobody, cwd="/")  # nobody may not run the venv's python
    try:

        def reported() -> list:
            c = _run(cagent, rid).get("containment") or {}
            return [r for r in c.get("outside", []) + c.get("other_uid", []) if r["pid"] == other.pid]

        got = wait_for(reported, timeout=20, what="the other uid's tagged process to be reported")
        assert "reported" in got[0]["why"]
        res = cagent.cli_json("stop", rid, "--grace", "1")
        time.sleep(0.3)
        assert other.poll() is None, "another uid's process was signalled"
        assert other.pid in [r["pid"] for r in res.get("reported", [])]
        assert other.pid not in [p["pid"] for p in res["stopped"]]
    finally:
        other.kill()
        other.wait()


def test_unknown_groups_are_reported_never_deleted_and_ended_runs_groups_are_removed(
    gpudeck_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if CGROUPFS_SKIP is not None:
        pytest.skip(f"no cgroupfs containment here: {CGROUPFS_SKIP}")
    monkeypatch.setenv("GPUDECK_CONTAINMENT", "cgroupfs")
    a = AgentProc(gpudeck_home).start()
    base = _base(gpudeck_home)
    assert base is not None
    stranger = None
    try:
        rid = a.cli_json("launch", "--", "sleep", "1.5")["id"]
        wait_for(lambda: (base / rid).is_dir(), what="the run's group")
        a.kill9()
        wait_for(lambda: not (base / rid / "cgroup.procs").read_text().split(), timeout=20, what="the run to end while the agent is down")
        unknown = base / "r-0badc0de"
        unknown.mkdir()
        stranger = subprocess.Popen(["sleep", "300"])
        (unknown / "cgroup.procs").write_text(str(stranger.pid))
        a.start()
        assert not (base / rid).exists(), "the ended run's empty group was not removed"
        assert unknown.is_dir() and stranger.poll() is None, "an unknown group was touched"
        db = sqlite3.connect(a.state_dir / "journal.db")
        notes = [json.loads(d) for (d,) in db.execute("SELECT data FROM events WHERE kind='agent_started'")][-1]["adopted"]
        db.close()
        assert any("unknown cgroup" in n and "r-0badc0de" in n and "left as it is" in n for n in notes), notes
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait()
        teardown_agent(a)
        try:
            (base / "r-0badc0de").rmdir()
            base.rmdir()
        except OSError:
            pass


def test_the_systemd_scope_level_says_why_it_is_not_used() -> None:
    why = systemd_unavailable()
    if os.path.isdir("/run/systemd/system"):
        pytest.skip(f"a systemd manager runs here; the systemd scope level is not built: {why}")
    assert "no running systemd manager" in why
    with pytest.raises(BadRequest, match=r"GPUDECK_CONTAINMENT='systemd' cannot be used: .*no running systemd manager"):
        detect(Path("/tmp/gd-probe-systemd"), forced="systemd")


# a run of three processes (the command and two children that inherit its tag), each beating into the run's telemetry
THREE = (
    "import json, os, subprocess, sys, time\n"
    "BEAT = 'import json, os, time\\nwhile True:\\n"
    '    open(os.environ["GPUDECK_TELEMETRY"], "a").write(json.dumps({"type": "heartbeat", "ts": time.time()}) + "\\\\n")\\n'
    "    time.sleep(0.2)'\n"
    "kids = [subprocess.Popen([sys.executable, '-c', BEAT]) for _ in range(2)]\n"
    "exec(BEAT)\n"
)


def _events(a: AgentProc, rid: str) -> list[dict]:
    return json.loads(a.cli("show", rid, "--json").stdout)["events"]


def _three(a: AgentProc) -> tuple[str, dict, list[dict]]:
    """Launch THREE; its id, shim member and the three others, once every one is a member."""
    rid = a.cli_json("launch", "--", PY, "-c", THREE)["id"]
    run = wait_for(
        lambda: (r := _run(a, rid)) and len([m for m in r.get("members", []) if m.get("role") != "shim"]) >= 3 and r,
        timeout=30,
        what="the run's three processes as members",
    )
    shim = next(m for m in run["members"] if m.get("role") == "shim")
    return rid, shim, [m for m in run["members"] if m.get("role") != "shim"]


def test_a_run_whose_shim_is_killed_stays_live_and_stop_ends_it_through_its_members(cagent: AgentProc, level: str) -> None:
    """Only the shim (the parent of the run's command) is SIGKILLed: the run's processes go on, so the run does too."""
    rid, shim, others = _three(cagent)
    os.kill(shim["pid"], signal.SIGKILL)
    lost = wait_for(lambda: [e for e in _events(cagent, rid) if e["kind"] == "shim_lost"], timeout=30, what="the shim_lost note")
    note = lost[0]["data"]["note"]
    assert "was killed (SIGKILL)" in note and lost[0]["data"]["members"] == 3, note
    assert ("in its group" in note) == (level == "cgroupfs")
    time.sleep(3)  # several ticks later: still live, still supervised
    run = _run(cagent, rid)
    assert run["state"] == "running", run.get("cause")
    assert all(alive(m["pid"], m["create_time"]) for m in others)
    assert rid in {r["id"] for r in cagent.cli_json("status", "--host", "local")["runs"]}
    res = cagent.cli_json("stop", rid, "--grace", "2")
    assert res["state"] == "stopped"
    for m in others:
        assert gone(m["pid"]), f"pid {m['pid']} survived the stop"
    if level == "cgroupfs":
        assert "emptied (populated 0)" in res["group_note"]
    row = next(r for r in cagent.cli_json("runs") if r["id"] == rid)
    assert row["state"] == "stopped" and "SIGKILL" in row["cause"] and "exit status is not known" in row["cause"], row["cause"]
    ends = [e for e in _events(cagent, rid) if e["kind"] == "run_state" and e["data"]["state"] == "stopped"]
    assert ends and ends[0]["data"]["evidence"] == "stop_verified"


def test_agent_and_shim_killed_while_the_members_run_the_restarted_agent_adopts_and_supervises_it(cagent: AgentProc, level: str) -> None:
    """The agent and the shim die while the ranks run: the restarted agent judges by the members (the group, or tag +
    ancestry), not by the dead shim; and when the members end, the lost run's end is dated by its last evidence."""
    rid, shim, others = _three(cagent)
    cagent.kill9()
    os.kill(shim["pid"], signal.SIGKILL)
    wait_for(lambda: gone(shim["pid"]), what="the shim to die")
    cagent.start()
    time.sleep(3)  # several ticks of the new agent
    run = _run(cagent, rid)
    assert run["state"] == "running", run.get("cause")
    kinds = [e["kind"] for e in _events(cagent, rid)]
    assert "run_adopted" in kinds and "shim_lost" in kinds, kinds
    assert not [e for e in _events(cagent, rid) if e["kind"] == "run_state" and e["data"]["state"] == "lost"]
    # the run's processes end with no exit status anywhere: lost, ended when it was last seen alive, labelled
    for m in others:
        os.kill(m["pid"], signal.SIGKILL)
    t_kill = time.time()
    row = wait_for(
        lambda: (r := next(x for x in cagent.cli_json("runs") if x["id"] == rid))["state"] != "running" and r, timeout=30, what="the end"
    )
    assert row["state"] == "lost" and "exit status unknown" in row["cause"], row
    end = next(e for e in _events(cagent, rid) if e["kind"] == "run_state" and e["data"]["state"] == "lost")
    assert end["data"]["evidence"] == "members_gone" and end["data"]["ended_by"], end
    assert t_kill - 3.0 <= row["ended"] <= t_kill + 1.0, (row["ended"] - t_kill, end["data"]["ended_by"])
    assert "the last evidence" in row["cause"]
