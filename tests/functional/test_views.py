"""The console's view models: what rows and diffs say, computed from fixture snapshots and history rows."""

from __future__ import annotations

import time

import msgspec
import pytest

from gpudeck.agents.wire.protocol import LaunchSpec
from gpudeck.console.core.records import RunRecord
from gpudeck.console.ops.readings import find_runs
from gpudeck.console.ops.relaunch import with_python
from gpudeck.console.present.views import (
    RunRow,
    argv_flags,
    argv_rows,
    core_changes,
    host_figures,
    merge_rows,
    python_of,
    row_label,
    run_diff,
    run_from_record,
    run_row_from_history,
    run_row_from_info,
)
from tests.functional.fixture_fleet import GOOD, LIVE, FixtureFleet, fixture_runs, fixture_snapshot


def test_host_figures_count_gpus_and_put_stale_holders_and_critical_alerts_first() -> None:
    fig = host_figures(fixture_snapshot())
    assert (fig.gpus, fig.busy, fig.runs) == (4, 3, 1)
    assert fig.used == 108 * 2**30 and fig.total == 564 * 2**30
    assert fig.alerts[0] == "2 stale GPU holder(s) 26.0 GiB"  # STALE 21 + NO SUCH PROCESS 5; FOREIGN is not an alert
    assert fig.alerts[1] == "llama-1b: rank exited" and fig.critical


def test_a_multi_node_run_is_one_row_and_live_beats_recorded() -> None:
    live = run_row_from_info(fixture_runs()[0])
    recorded = run_row_from_history(RunRecord(id=LIVE, host="gpu9", state="lost", kind="fsdp", created=1.0))
    rows = merge_rows([recorded, live])
    assert list(rows) == [LIVE]
    assert rows[LIVE].hosts == ("gpu9", "gpu1") and rows[LIVE].state == "running" and rows[LIVE].live


def test_a_run_on_many_hosts_merges_in_one_pass_in_first_seen_order() -> None:
    """issue 33: one id on 2,000 hosts (live rows, then the recorded one) is one row, hosts in first-seen order without
    repeats, the first live row's figures; ids seen once come back as the very rows given."""
    live = [RunRow(id="big", hosts=(f"s{i:04d}",), state="running", step=i, live=True) for i in range(2000)]
    lone = RunRow(id="lone", hosts=("a", "a"), state="failed")
    recorded = RunRow(id="big", hosts=("s0007", "zz"), state="lost")
    t0 = time.perf_counter()
    rows = merge_rows([recorded, *live, lone, live[3]])
    took = time.perf_counter() - t0
    assert list(rows) == ["big", "lone"] and rows["lone"] is lone
    assert rows["big"].hosts == ("s0007", "zz", *(f"s{i:04d}" for i in range(2000) if i != 7))
    assert rows["big"].live and rows["big"].state == "running" and rows["big"].step == 0
    assert took < 1.0  # a hang limit, not a speed test (linear: a few ms here)


def test_argv_flags_and_argv_rows_show_which_argument_changed() -> None:
    assert argv_flags(["python", "-m", "x", "--lr", "3e-4", "--fresh", "--out=/ckpt"]) == {
        "argv[0]": "python",
        "argv[1]": "-m",
        "argv[2]": "x",
        "--lr": "3e-4",
        "--fresh": "on",
        "--out": "/ckpt",
    }
    rows = argv_rows(["py", "--lr", "3e-4", "--fresh"], ["py", "--lr", "1e-4", "--resume", "5"])
    assert [(r.key, r.a, r.b) for r in rows] == [("--lr", "3e-4", "1e-4"), ("--fresh", "on", "-"), ("--resume", "-", "5")]


def test_a_live_run_compares_like_a_recorded_one() -> None:
    live = fixture_runs()[0]
    rec = RunRecord.from_info(live)
    diff = run_diff(rec, msgspec.structs.replace(rec, id="r-other", argv=[*live.spec.argv[:-1], "--resume", "10"]))
    assert [r.key for r in diff.config if r.differs] == ["command", "--fresh", "--resume"]
    back = run_from_record(rec)
    assert back is not None and (back.id, back.state, back.spec, back.env) == (live.id, live.state, live.spec, live.env)


def test_history_rows_use_the_query_language_and_the_diff_reads_full_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = FixtureFleet(tmp_path / "h.db")
    try:
        assert {r.id for r in find_runs(fleet.history.path, "kind:fsdp")} == {LIVE, GOOD}
        failed = find_runs(fleet.history.path, "state:failed")
        assert [r.cause for r in failed] == ["exit code 1 (CUDA out of memory)"]
        assert failed[0].env is None  # the light rows never carry the environment
        from gpudeck.console.ops.errors import QueryRefused

        with pytest.raises(QueryRefused, match="unknown filter"):
            find_runs(fleet.history.path, "colour:red")
        diff = run_diff(fleet.history.find(LIVE, "gpu1"), fleet.history.find(GOOD, "gpu1"))
        assert [row_label(r) for r in core_changes(diff)] == [
            "torch",
            "torch CUDA build",
            "driver",
            "NCCL",
        ]  # what changed among the core fields is read first
        assert any(r.key == "--lr" and r.differs for r in diff.config)
        assert run_diff(fleet.history.find(LIVE, "gpu1"), fleet.history.find("r-00aa11bb", "gpu1")).env_note.startswith(
            "no environment fingerprint recorded for r-00aa11bb"
        )
    finally:
        fleet.history.close()


def test_python_of_reads_the_fingerprint_then_the_spec_then_argv() -> None:
    spec = LaunchSpec(argv=["/old/bin/python", "-m", "gpudeck.trainers.fsdp_lm"], kind="fsdp")
    assert python_of(spec) == "/old/bin/python"
    assert python_of(msgspec.structs.replace(spec, python="/spec/python")) == "/spec/python"
    assert python_of(spec, fixture_runs()[0].env) == "/opt/venv/bin/python3"
    assert with_python(spec.argv, "/good/bin/python")[0] == "/good/bin/python"


def test_a_long_value_in_a_diff_cell_starts_near_where_it_differs() -> None:
    from gpudeck.console.tui.widgets.diff import from_difference

    a, b = (
        "python -m gpudeck.trainers.fsdp_lm --model-config llama-1b --lr 3e-4",
        "python -m gpudeck.trainers.fsdp_lm --model-config llama-1b --lr 1e-4",
    )
    assert from_difference(a, b) == ("…g llama-1b --lr 3e-4", "…g llama-1b --lr 1e-4")  # 16 characters before the first difference
    assert from_difference("short a", "short b") == ("short a", "short b")


def test_history_rows_after_reads_everything_once_then_only_the_runs_an_event_changed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The Runs screen reads the whole history once, then only what changed (by event number, not by the hosts'
    clocks): a run on another host whose event carries an older time still comes, with every node of its id."""
    from gpudeck.agents.wire.protocol import Event
    from gpudeck.console.ops.readings import runs_changed_since

    fleet = FixtureFleet(tmp_path / "h.db")
    assert fleet.history is not None
    try:
        everything, mark = runs_changed_since(fleet.history.path, "limit:100000", None)
        assert {r.id for r in everything} == {r.id for r in find_runs(fleet.history.path, "limit:100000")} and mark > 0
        assert runs_changed_since(fleet.history.path, "", mark) == ([], mark)  # nothing new: nothing read
        # the same run id recorded on a second host (a multi-node run), its event stamped long ago
        fleet.history.cursor("gpu9", "e9")
        ev = Event(seq=1, ts=1.0, kind="run_created", run_id=LIVE, data={"state": "starting", "spec": {"argv": ["x"], "kind": "fsdp"}})
        fleet.history.submit("gpu9", "e9", [ev]).result(30)
        changed, mark2 = runs_changed_since(fleet.history.path, "", mark)
        assert mark2 > mark
        assert sorted((r.host, r.id) for r in changed) == [("gpu1", LIVE), ("gpu9", LIVE)]
        assert runs_changed_since(fleet.history.path, "", mark2) == ([], mark2)
    finally:
        fleet.history.close()
