"""One figure, one definition: the CLI (show, history, diff), the Diff screen and the History screen show the same values.

A run whose steps report tokens/s 100, 300, 250 and finally 900 (median 275,
last 900), whose last step seen is 98 but whose trainer reported final_step
100, and whose peak memory was 61.2 GiB, is read from a real history file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpudeck.agents.protocol import LaunchSpec, RunInfo
from gpudeck.console.formats import format_history, format_show
from gpudeck.console.history import History
from gpudeck.console.ops.figures import run_figures
from gpudeck.console.rundiff import diff_runs
from gpudeck.console.screens.history import history_cells
from gpudeck.console.views import history_rows, run_diff
from tests.functional.fixture_fleet import history_events

T0 = 1_790_000_000.0
RID, OTHER = "r-f1900001", "r-f1900002"


def _run(rid: str) -> RunInfo:
    return RunInfo(
        id=rid,
        host="gpu1",
        state="succeeded",
        spec=LaunchSpec(argv=["python3", "-m", "gpudeck.trainers.fsdp_lm", "--fresh"], kind="fsdp"),
        name="fig",
        created=T0,
        started=T0 + 1,
        ended=T0 + 3601,
        cause="exit code 0",
        exit_code=0,
    )


@pytest.fixture
def history(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = History(tmp_path / "history.db")
    run = _run(RID)
    step = lambda s, tps: (
        T0 + 10 + s,
        "telemetry",
        {"record": {"type": "step", "rank": 0, "step": s, "loss": 2.0, "tokens_per_s": tps, "mem_peak_gib": 61.2 if s == 50 else 40.0}},
    )
    extra = [
        step(10, 100.0),
        step(50, 300.0),
        step(90, 250.0),
        step(98, 900.0),
        (T0 + 3000, "telemetry", {"record": {"type": "done", "final_step": 100}}),
    ]
    h.cursor("gpu1", "e")
    h.submit("gpu1", "e", history_events(run, 1, None, extra) + history_events(_run(OTHER), 100)).result(30)
    yield h
    h.close()


def test_every_view_shows_the_same_figures(history: History) -> None:
    row = history.find(RID)
    metrics = history.metrics("gpu1", RID)
    fig = run_figures(row, metrics)
    assert (fig.tokens_per_s, fig.last_step, fig.peak_mem_gib, fig.elapsed_s) == (275.0, 100, 61.2, 3600.0)  # not the last 900, not step 98
    # the CLI's show
    show = format_show(row, [], fig)
    assert (
        re.search(r"tokens/s median\s+275\b", show)
        and re.search(r"last step\s+100\b", show)
        and "61.20 GiB" in show
        and re.search(r"elapsed\s+1h00m", show)
    )
    # the CLI's history listing (the history's rows carry the median)
    listing = format_history(history.query(f"id:{RID}"))
    assert " 275 " in listing and " 100 " in listing and "1h00m" in listing and " 900 " not in listing
    # the CLI's diff and the Diff screen's diff (the screen reads the metrics too)
    other = history.find(OTHER)
    for d in (diff_runs(row, other, metrics, []), run_diff(row, other, metrics, [])):
        out = {r.key: r.a for r in d.outcome}
        assert (
            out["tokens/s (median)"] == "275"
            and out["last step"] == "100"
            and out["peak memory GiB"] == "61.2"
            and out["elapsed"] == "1h00m"
        )
        assert out["cause class"] == (fig.cause_class or "-")
    # the History screen's row
    cells = history_cells(next(r for r in history_rows(history.path, "") if r.id == RID))
    assert (cells["tps"], cells["step"], cells["elapsed"]) == ("275", "100", "1h00m")
