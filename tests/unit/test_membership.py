"""Parentage at the tag level: new processes are placed by reading only them and their ancestors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpudeck.agents.observe.procs import create_time_of
from gpudeck.agents.safety.membership import TreeWatch, descendants, partial_tree, proc_tree


def test_a_grandchild_that_cleared_its_environment_is_found_below_its_root_from_a_partial_tree() -> None:
    watch = TreeWatch()
    assert len(watch.scan()) > 1, "the first scan reads the whole host"
    code = "import os, sys, time\nif os.fork() == 0:\n    os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)'], {})\ntime.sleep(30)"
    root = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        found: dict = {}
        while time.monotonic() < deadline:
            ct = create_time_of(root.pid)
            found = descendants(watch.scan() | partial_tree({root.pid}), {root.pid: ct or 0.0}, set()) if ct else {}
            if found:
                break
            time.sleep(0.05)
        assert len(found) == 1
        (child,) = found
        assert "GPUDECK_RUN_ID" not in open(f"/proc/{child}/environ", "rb").read().decode(errors="replace")
        # later scans read only what is new: the settled host costs nothing
        assert len(watch.scan()) < len(proc_tree())
        assert os.getpid() not in descendants(proc_tree(), {root.pid: create_time_of(root.pid) or 0.0}, set())
    finally:
        for pid in found:
            os.kill(pid, 9)
        root.kill()
        root.wait()


def test_a_root_whose_pid_was_reused_has_no_descendants() -> None:
    tree = proc_tree()
    me = os.getpid()
    assert descendants(tree, {os.getppid(): tree[os.getppid()].create_time - 100.0}, set()) == {}
    assert me in descendants(tree, {os.getppid(): tree[os.getppid()].create_time}, set())


def test_an_ended_run_may_linger_by_its_tag_a_live_member_or_its_shims_session() -> None:
    from gpudeck.agents.observe.procs import StatLine
    from gpudeck.agents.safety.membership import may_linger, session_marks
    from gpudeck.agents.wire.protocol import LaunchSpec, Member, RunInfo

    def st(ppid: int, sid: int, ct: float) -> StatLine:
        return StatLine(status="sleeping", ppid=ppid, pgid=sid, sid=sid, cpu_seconds=0.0, create_time=ct, rss=0)

    run = RunInfo(
        id="r-1",
        host="h",
        state="succeeded",
        spec=LaunchSpec(argv=["sh"]),
        members=[Member(pid=100, create_time=10.0, role="shim"), Member(pid=101, create_time=11.0, role="leader")],
    )
    # the shim and leader are gone; an env-cleared child (no tag) is still in the shim's session
    tree = {1: st(0, 1, 1.0), 555: st(1, 100, 12.0)}
    assert may_linger(run, tree, tagged=False, marks=session_marks(tree))
    stranger = {1: st(0, 1, 1.0), 556: st(1, 556, 12.0)}
    assert not may_linger(run, stranger, tagged=False, marks=session_marks(stranger))
    assert may_linger(run, stranger, tagged=True, marks=session_marks(stranger))
    reused = {1: st(0, 1, 1.0), 101: st(1, 101, 99.0)}  # pid 101 now names another process: not the leader
    assert not may_linger(run, reused, tagged=False, marks=set())
    alive = {1: st(0, 1, 1.0), 101: st(1, 100, 11.0)}
    assert may_linger(run, alive, tagged=False, marks=set())
