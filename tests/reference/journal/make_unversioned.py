"""Provides how ``journal-unversioned.db`` was made: the journal as gpudeck wrote it before its schema carried a
version (commit 68f3ea7, ``PRAGMA user_version`` 0). Kept to say what the file holds; the file itself is the
reference (running this with later code makes a later journal, not that one).

    python -m tests.reference.journal.make_unversioned tests/reference/journal/journal-unversioned.db
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.protocol import LaunchSpec, Member, RunInfo

T0 = 1_764_800_000.0  # fixed times: the file's content does not depend on when it was made


def make(path: Path) -> None:
    """Two runs (one ended, one live with members) and the events today's agent writes for them."""
    j = Journal(path, "ref-host")
    j.append("agent_started", None, {"pid": 4242, "version": "0.1.0", "gpu_error": None, "adopted": []})
    spec = LaunchSpec(argv=["python", "-c", "print('r-ended')"], name="ended-run", env={"K": "v"}, gpus=[0])
    j.create_run(RunInfo(id="r-ended", host="ref-host", state="starting", spec=spec, name="ended-run", created=T0))
    j.update_run("r-ended", "run_state", {"state": "running", "pid": 100, "started": T0 + 1}, state="running", started=T0 + 1)
    j.update_run(
        "r-ended",
        "run_state",
        {"state": "succeeded", "ended": T0 + 60, "exit_code": 0, "cause": "exit code 0"},
        state="succeeded",
        ended=T0 + 60,
        exit_code=0,
        cause="exit code 0",
    )
    live = LaunchSpec(argv=["torchrun", "--nproc-per-node", "2", "train.py"], name="live-run", gpus=[0, 1])
    j.create_run(RunInfo(id="r-live", host="ref-host", state="starting", spec=live, name="live-run", created=T0 + 100))
    members = [Member(pid=200 + i, create_time=T0 + 101, role="rank", rank=i, first_seen=T0 + 102) for i in range(2)]
    j.update_run("r-live", "run_state", {"state": "running", "pid": 200, "started": T0 + 101}, state="running", started=T0 + 101)
    j.update_run("r-live", None, None, members=members)
    j.append("telemetry", "r-live", {"offset": 0, "record": {"step": 1, "loss": 2.5}})
    j.flush()
    j.close()


if __name__ == "__main__":
    make(Path(sys.argv[1]))
