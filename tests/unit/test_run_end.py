"""How a run's end is decided: only from evidence that was checked; an unknown said to be unknown, dated by the last evidence."""

from __future__ import annotations

import time
from pathlib import Path

from gpudeck.agents.runs import states
from gpudeck.agents.runs.ending import ExitFacts, decide, missing_exit_record, torchrun_first_failure
from gpudeck.agents.wire.protocol import LaunchSpec, Member, RunInfo

ROOT_CAUSE = """[rank0]: Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
gpudeck.trainers.fsdp_lm FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_20:58:01
  host      : nodeb
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def _run(**spec: object) -> RunInfo:
    return RunInfo(
        id="r-1",
        host="h",
        state="running",
        spec=LaunchSpec(argv=["x"], **spec),  # type: ignore[arg-type]
        members=[Member(pid=999999, create_time=1.0, role="leader")],
        started=time.time() - 100,
    )


def _facts(**kw: object) -> ExitFacts:
    base: dict = dict(record=None, shim_returncode=None, output_tail="", output_reason=None, telemetry_evidence="")
    base.update(kw)
    return ExitFacts(**base)


def test_a_killed_shims_code_is_not_the_runs_and_no_full_disk_is_guessed() -> None:
    """The shim SIGKILLed (-9 from its wait) says nothing of the command: lost, with what is known, never 'exit code -9'."""
    t_last = time.time() - 30
    end = decide(
        _run(),
        _facts(
            shim_returncode=-9,
            shim_gone="its shim (pid 77, the parent of the run's command) was killed (SIGKILL)",
            last_evidence=(t_last, "its last telemetry record"),
        ),
    )
    assert end.state == "lost" and end.exit_code is None and end.evidence == states.MEMBERS_GONE
    assert end.cause.startswith("exit status unknown: its shim (pid 77") and "-9" not in end.cause
    assert "state dir full" not in end.cause
    assert end.ended == t_last and end.ended_by == "its last telemetry record" and "the last evidence" in end.cause


def test_without_any_evidence_the_end_says_when_it_was_found() -> None:
    end = decide(_run(), _facts(agent_was_down=True))
    assert end.state == "lost" and end.ended_by == "when the agent found it ended (no earlier evidence)"
    assert "while the agent was down" in end.cause


def test_a_shim_that_exited_without_exit_json_gives_its_code_with_what_was_checked(tmp_path: Path) -> None:
    tail = "gpudeck-shim: could not write /x/exit.json (No space left on device); the run ended with {...}\n"
    why = missing_exit_record(str(tmp_path), tail)
    assert "the shim reported 'No space left on device'" in why and "MiB" in why and "inodes free now" in why
    end = decide(_run(), _facts(shim_returncode=3, missing_record=why))
    assert end.state == "failed" and end.exit_code == 3 and end.evidence == states.SHIM_EXIT
    assert "exit.json could not be written (the code is the shim's own): the shim reported" in end.cause
    assert "is the agent's state dir full?" not in end.cause


def test_torchruns_first_failure_is_read_from_the_output_bounded() -> None:
    assert torchrun_first_failure(ROOT_CAUSE) == (1, 4242)
    assert torchrun_first_failure("Root Cause (first observed failure):\n" + "x" * 5000 + "rank : 1\nexitcode : 1 (pid: 2)") is None
    assert torchrun_first_failure("") is None


def test_a_ranks_death_before_the_end_raises_the_alert_whatever_ended_first() -> None:
    """The health tick never saw the rank gone (the node ended first): torchrun's report names it; the alert goes with the end."""
    end = decide(_run(nnodes=2, node_rank=1), _facts(record={"returncode": 1}, output_tail=ROOT_CAUSE))
    assert end.state == "failed" and end.rank_death is not None and end.rank_death[:2] == (1, 4242)
    assert "rank 1 died first (pid 4242" in end.cause
    seen = decide(_run(nnodes=2, node_rank=1), _facts(record={"returncode": 1}, first_gone=(1, 55, 10.0)))
    assert seen.rank_death == (1, 55, 10.0)
    # one rank, one node: the rank's death is the run's end itself, said in the cause; no alert
    assert decide(_run(), _facts(record={"returncode": 1}, first_gone=(0, 55, 10.0))).rank_death is None
    # an operator's stop ended it: no rank alert
    assert decide(_run(nnodes=2), _facts(record={"returncode": 1}, first_gone=(1, 55, 10.0), stopped_cause="stopped")).rank_death is None
