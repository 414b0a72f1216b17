"""Unit tests of containment detection, a real cgroup's life cycle, and the exit-cause rules that read its figures."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpudeck.agents.runs.ending import ExitFacts, decide
from gpudeck.agents.safety.containment import (
    CgroupFs,
    Containment,
    RunGroup,
    agent_key,
    cgroup2_mount,
    detect,
    own_cgroup,
)
from gpudeck.agents.wire.errors import BadRequest
from gpudeck.agents.wire.protocol import LaunchSpec, Member, RunInfo

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
UNIFIED = "25 1 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
BIND = "25 1 0:22 /some/sub /mnt/cg rw - cgroup2 cgroup2 rw\n"


def test_the_cgroup2_mount_is_found_wherever_it_is_mounted() -> None:
    assert cgroup2_mount(HYBRID) == "/sys/fs/cgroup/unified"
    assert cgroup2_mount(UNIFIED) == "/sys/fs/cgroup"
    assert cgroup2_mount("35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n") is None
    assert cgroup2_mount(BIND) is None, "a bind mount of a sub-tree is not the hierarchy's root"


def test_a_bad_forced_level_names_the_variable_and_the_choices(tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="GPUDECK_CONTAINMENT='jail'.*auto, cgroupfs or tag"):
        detect(tmp_path, forced="jail")


def test_forcing_the_systemd_level_is_refused_naming_what_is_accepted(tmp_path: Path) -> None:
    # the level is detected and reported, not built: asking for it is refused like any unknown value, never
    # accepted and quietly run at the tag level
    with pytest.raises(
        BadRequest,
        match=r"GPUDECK_CONTAINMENT='systemd' cannot be used: gpudeck's systemd-scope level is not built .*give auto, cgroupfs or tag",
    ):
        detect(tmp_path, forced="systemd")


def test_forcing_tag_says_so_in_the_label(tmp_path: Path) -> None:
    c = detect(tmp_path, forced="tag")
    assert c.level == "tag" and not c.has_groups
    assert c.label == "tag + ancestry only: forced by GPUDECK_CONTAINMENT=tag"
    assert c.create("r-00000000") is None and c.groups() == {}


def test_agents_of_different_state_dirs_get_different_groups(tmp_path: Path) -> None:
    assert agent_key(tmp_path / "a") != agent_key(tmp_path / "b")
    assert agent_key(tmp_path / "a") == agent_key(tmp_path / "a")


@pytest.fixture
def cgfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = detect(tmp_path / "runs", forced="cgroupfs")
    if not isinstance(c, CgroupFs):
        pytest.skip(f"no cgroupfs containment here: {c.reason}")
    yield c
    for g in c.groups().values():
        g.kill()
        deadline = time.monotonic() + 5
        while g.populated() and time.monotonic() < deadline:
            time.sleep(0.02)
        g.remove()
    c.release()


def test_a_real_group_holds_what_is_forked_inside_it_and_one_kill_ends_all(cgfs: CgroupFs) -> None:
    g = cgfs.create("r-0000aaaa")
    assert g.pids() == [] and not g.populated()
    # the child joins before exec, as the shim's child does; its own children are born inside
    code = "import os, time\nfor _ in range(3):\n    os.fork() or time.sleep(60)\ntime.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], preexec_fn=lambda: open(g.procs_file, "w").write("0"))
    deadline = time.monotonic() + 10
    while len(g.pids()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(g.pids()) == 4 and g.populated()
    assert own_cgroup(p.pid) == "/" + os.path.relpath(g.path, cgfs.mount)
    assert cgfs.group_of_pid(p.pid) == "r-0000aaaa" and cgfs.group_of_pid(os.getpid()) is None
    assert g.remove() is not None, "a populated group cannot be removed"
    assert g.kill() in ("cgroup.kill", "freeze+SIGKILL")
    p.wait(5)
    deadline = time.monotonic() + 5
    while g.populated() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not g.populated() and g.pids() == []
    f = g.figures()
    assert f.cpu_seconds is not None and f.cpu_seconds >= 0
    if f.memory_peak_bytes is None:
        assert f.note, "a missing figure comes with the reason"
    assert g.remove() is None and not g.path.exists()
    assert cgfs.groups() == {}


def test_groups_are_listed_by_run_id(cgfs: CgroupFs) -> None:
    cgfs.create("r-0000bbbb")
    cgfs.create("r-0000cccc")
    assert set(cgfs.groups()) == {"r-0000bbbb", "r-0000cccc"}
    assert isinstance(cgfs.group("r-0000bbbb"), RunGroup) and cgfs.group("r-0000dddd") is None


def _run() -> RunInfo:
    return RunInfo(
        id="r-1",
        host="h",
        state="running",
        spec=LaunchSpec(argv=["x"]),
        members=[Member(pid=999999, create_time=1.0, role="leader")],
        started=time.time(),
    )


def _facts(**kw: object) -> ExitFacts:
    base = dict(
        record={"returncode": None, "signal": "SIGKILL", "ended": 1.0},
        shim_returncode=None,
        output_tail="",
        output_reason=None,
        telemetry_evidence="",
    )
    base.update(kw)
    return ExitFacts(**base)  # type: ignore[arg-type]


def test_a_sigkilled_run_whose_group_counted_an_oom_kill_is_a_host_oom() -> None:
    end = decide(_run(), _facts(group_oom_kills=2))
    assert end.state == "failed" and "killed by SIGKILL" in end.cause
    assert "host OOM killer: the run's cgroup counted 2 OOM kill(s) (memory.events oom_kill)" in end.cause


def test_exit_causes_from_the_record_the_shim_and_nothing() -> None:
    assert decide(_run(), _facts(record={"returncode": 0, "ended": 5.0})).state == "succeeded"
    end = decide(_run(), _facts(record=None, shim_returncode=3))
    assert end.state == "failed" and end.exit_code == 3 and "exit.json could not be written" in end.cause
    lost = decide(_run(), _facts(record=None, telemetry_evidence="last step reported: 7"))
    assert lost.state == "lost" and "last step reported: 7" in lost.cause
    stopped = decide(_run(), _facts(record={"returncode": 1}, stopped_cause="stopped by operator"))
    assert stopped.state == "stopped" and stopped.cause.startswith("stopped by operator (exit code 1")


def test_the_tag_level_has_no_groups() -> None:
    c = Containment("why")
    assert c.group("r-1") is None and c.group_of_pid(os.getpid()) is None and c.label == "tag + ancestry only: why"
