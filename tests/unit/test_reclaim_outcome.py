"""How a stop or a reclaim reports a process it ended, with real processes: one that exited on SIGTERM and waits for
its parent's wait is stopped by SIGTERM (not a `zombie` leftover), and an orphan's own advice is never repeated back."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from gpudeck.agents.observe.procs import create_time_of, status_of
from gpudeck.agents.runs import stop
from gpudeck.agents.runs.reclaim import reclaim_message
from gpudeck.agents.wire.protocol import Leftover, Member, StoppedProcess, StopResult


def test_an_orphan_ended_by_sigterm_whose_parent_has_not_reaped_it_is_stopped_by_sigterm() -> None:
    # this test is the parent and does not wait: after the SIGTERM the process stays a zombie until it does
    p = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"up"
        ct = create_time_of(p.pid)
        assert ct is not None
        m = Member(pid=p.pid, create_time=ct, role="leftover", cmdline=["python"])
        t = asyncio.run(stop.terminate([m], 5.0))
        assert status_of(p.pid, ct) == "zombie", "the parent reaped it: the case is not made"
        result = StopResult(run_id=None, state="reclaimed")
        stop.classify(result, [m], t)
        assert [(s.pid, s.how, s.status) for s in result.stopped] == [(p.pid, "SIGTERM", "zombie")] and not result.survivors
        lo = Leftover(
            pid=p.pid,
            create_time=ct,
            kind="orphan",
            run_id="r-0rphan00",
            note=f"left by run r-0rphan00; `gpudeck reclaim h:{p.pid}` stops it",
        )
        msg = reclaim_message(result, {p.pid: lo})
        assert msg.startswith("stopped 1 process(es)") and "reclaim h:" not in msg and "zombie" not in msg, msg
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_zombie_holders_advice_is_kept() -> None:
    # a zombie GPU holder (never signalled: signals do nothing to it): its note says what frees the memory
    result = StopResult(run_id=None, state="reclaimed", stopped=[StoppedProcess(pid=41, how="zombie", status="zombie")])
    lo = Leftover(pid=41, kind="zombie", ppid=40, note="has exited; its GPU memory is released when its parent (pid 40) reaps it")
    assert "pid 41: has exited; its GPU memory is released when its parent (pid 40) reaps it" in reclaim_message(result, {41: lo})


def test_a_reclaims_verification_names_the_processes_it_stopped_not_the_run() -> None:
    from gpudeck.agents.runs.reclaim import verified_words
    from gpudeck.agents.wire.protocol import Leftover

    one = verified_words([Leftover(pid=4412, kind="orphan", run_id="r-1")])
    assert one == "the 1 process reclaimed (pid 4412) holds no GPU memory"
    many = verified_words([Leftover(pid=p, kind="orphan", run_id="r-1") for p in range(100, 120)])
    assert many.startswith("the 20 processes reclaimed (pids 100, 101,") and "… 4 more) hold no GPU memory" in many
    assert "the run" not in one + many
