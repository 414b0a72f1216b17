"""The run registry: the one writer of run state, every change from one declared table, journaled with its evidence."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gpudeck.agents.runs import states
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.runs.registry import RunRegistry
from gpudeck.agents.safety.containment import Containment
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.protocol import Event, LaunchSpec, Member, RunInfo, StopResult


def _registry(tmp_path: Path) -> tuple[RunRegistry, list[Event], list[dict]]:
    journal = Journal(tmp_path / "journal.db", "h")
    events: list[Event] = []
    indexed: list[dict] = []
    reg = RunRegistry(journal, "h", Containment("tests: no cgroup"), events.append, indexed.append)
    return reg, events, indexed


def _new_run(reg: RunRegistry, state: str = "starting") -> RunInfo:
    run = RunInfo(id="r-0000abcd", host="h", state=state, spec=LaunchSpec(argv=["true"]), created=time.time())  # type: ignore[arg-type]
    asyncio.run(reg.create(run, states.LAUNCHED))
    reg.add(LiveRun(info=run))
    return run


def test_a_declared_transition_is_applied_and_journaled_with_its_evidence(tmp_path: Path) -> None:
    reg, events, indexed = _registry(tmp_path)
    run = _new_run(reg)
    members = [Member(pid=1, create_time=1.0, role="leader")]
    assert reg.transition(run, "running", states.SPAWNED, {"pid": 1}, started=time.time(), members=members)
    assert run.state == "running"
    ev = reg.journal.last_event(run.id, "run_state")
    assert ev is not None and ev.data["state"] == "running" and ev.data["evidence"] == states.SPAWNED
    assert indexed[-1] == {run.id: members}  # the attribution index follows the members
    assert reg.transition(run, "succeeded", states.EXIT_RECORD, {"cause": "exit code 0"}, cause="exit code 0", ended=time.time())
    assert reg.get(run.id) is None and reg.run_state(run.id) == "ended"
    ev = reg.journal.last_event(run.id, "run_state")
    assert ev is not None and ev.data["evidence"] == states.EXIT_RECORD and ev.data["cause_class"] == "ok"
    assert [e.kind for e in events][-2:] == ["run_state", "run_state"]


def test_an_undeclared_transition_is_refused_as_a_bug_and_not_applied(tmp_path: Path) -> None:
    reg, events, _ = _registry(tmp_path)
    run = _new_run(reg)
    n = len(events)
    # a run never succeeds on the evidence of an operator's stop, and an ended run never comes back
    assert not reg.transition(run, "succeeded", states.STOP_VERIFIED)
    assert run.state == "starting" and len(events) == n and reg.get(run.id) is not None
    assert "undeclared transition starting -> succeeded" in reg.refused[-1]
    reg.transition(run, "failed", states.LAUNCH_ERROR, cause="launch failed: x", ended=time.time())
    assert not reg.transition(run, "running", states.ADOPTED)
    assert run.state == "failed" and reg.journal.get_run(run.id).state == "failed"  # type: ignore[union-attr]


def test_update_never_changes_a_state(tmp_path: Path) -> None:
    reg, _, _ = _registry(tmp_path)
    run = _new_run(reg)
    try:
        reg.update(run, None, state="running")
    except ValueError as exc:
        assert "transition" in str(exc)
    else:
        raise AssertionError("update changed a state")


def test_every_row_of_the_table_names_known_states_and_evidence() -> None:
    known_states = {states.NEW, "starting", "running", "stopping", "succeeded", "failed", "stopped", "lost", "preflight_failed"}
    evidence = {v for k, v in vars(states).items() if k.isupper() and isinstance(v, str) and k != "NEW"}
    for t in states.TRANSITIONS:
        assert t.source in known_states and t.target in known_states and t.evidence in evidence, t
    assert len(set(states.TRANSITIONS)) == len(states.TRANSITIONS)
    assert all(t.source not in ("succeeded", "failed", "stopped", "lost", "preflight_failed") for t in states.TRANSITIONS)


def test_a_later_stop_with_a_shorter_grace_cuts_the_one_under_way_and_only_that_counts_as_cut(tmp_path: Path) -> None:
    reg, _, _ = _registry(tmp_path)

    async def go() -> tuple[float | None, bool, bool, float | None]:
        release = asyncio.Event()

        async def stop_body() -> StopResult:
            await release.wait()
            return StopResult(run_id="r-1", state="stopped")

        first = reg.stop_once("r-1", stop_body, grace_ends=100.0)
        reg.grace_end("r-1", 99.0)  # the stop's own (resumed) end: earlier, but not a later request
        cut_by_own = reg.grace_cut("r-1")
        again = reg.stop_once("r-1", stop_body, grace_ends=10.0)  # `stop --grace 0`-like: joins, and cuts the grace
        assert again is first
        end, cut = reg.grace_end("r-1"), reg.grace_cut("r-1")
        release.set()
        await first
        await asyncio.sleep(0)
        return end, cut_by_own, cut, reg.grace_end("r-1")

    end, cut_by_own, cut, after = asyncio.run(go())
    assert (end, cut_by_own, cut, after) == (10.0, False, True, None)
