"""Parity: the Roll back dialog's diff and `gpudeck diff` show the same rows and figures for the same two runs.

The finding that started this: for two runs that both ran on `local`, the dialog showed `tokens/s (median) 1,702`
(the last step's value) and a `host vm | local` difference (the agent's hostname against the fleet's name), while
History -> Diff and `gpudeck diff` showed the median and no host difference. Both now read the pair through
``ops.compare``; this test drives the real CLI entry point and the real screen (Pilot) over one history file.
"""

from __future__ import annotations

import asyncio
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from rich.console import Console

from gpudeck.agents.wire.protocol import Event, LaunchSpec, RunInfo, RunTelemetry
from gpudeck.console.cli.main import main as cli_main
from gpudeck.console.history.replica import History
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ChoiceDialog
from gpudeck.console.tui.screens.picker import RunPicker
from gpudeck.console.tui.screens.run import RunScreen
from tests.functional.fixture_fleet import T0, FixtureFleet, env_fixture, fixture_link, fixture_snapshot, history_events
from tests.functional.helpers import mounted, press_for, until

SIZE = (180, 50)
CUR, GOOD = "r-0000b0b0", "r-0000a0a0"
CUR_TPS = [120.0, 180.6, 1702.0]  # median 180.6; the last step's 1,702 is what the dialog used to show
GOOD_TPS = [76.79, 70.0, 81.66]  # median 76.79; the last 81.66


def _spec(lr: str) -> LaunchSpec:
    argv = ["/opt/venv/bin/python3", "-m", "gpudeck.trainers.fsdp_lm", "--model-config", "tiny", "--lr", lr, "--fresh"]
    return LaunchSpec(argv=argv, kind="fsdp", gpus=[0], start="fresh", python="/opt/venv/bin/python3")


def _run(rid: str, lr: str, started: float, tps: list[float], host: str = "vm") -> RunInfo:
    """A run as its agent reports it: ``host`` is the agent's own hostname, not the fleet's name (`local`)."""
    return RunInfo(
        id=rid,
        host=host,
        state="succeeded",
        name=f"tiny-{lr}",
        spec=_spec(lr),
        created=started,
        started=started,
        ended=started + 600,
        cause="exit code 0",
        exit_code=0,
        telemetry=RunTelemetry(step=len(tps) * 10, loss=2.0, tokens_per_s=tps[-1]),
        env=env_fixture(),
    )


def _events(run: RunInfo, seq0: int, tps: list[float]) -> list[Event]:
    assert run.started is not None
    steps = [
        (
            run.started + 10 * (i + 1),
            "telemetry",
            {"record": {"type": "step", "rank": 0, "step": 10 * (i + 1), "loss": 2.0, "tokens_per_s": t}},
        )
        for i, t in enumerate(tps)
    ]
    return history_events(run, seq0, run.env, steps)


class LocalPair(FixtureFleet):
    """`local` up, holding the two runs; the history holds them as synced from `local`."""

    def __init__(self, history_path: Path) -> None:
        super().__init__(None)
        self.history = History(history_path)
        self.cur = _run(CUR, "3e-4", T0 - 3600, CUR_TPS)
        self.good = _run(GOOD, "1e-4", T0 - 7200, GOOD_TPS)
        self.history.submit("local", "e", [*_events(self.good, 1, GOOD_TPS), *_events(self.cur, 100, CUR_TPS)]).result(30)
        self.links = {"local": fixture_link("local", "up", snapshot=fixture_snapshot())}

    def _host(self, host: str) -> None:
        assert host == "local", host

    async def runs(self, host: str, limit: int = 1000) -> list[RunInfo]:
        return [self.cur, self.good]

    async def run(self, host: str, run_id: str) -> RunInfo:
        return next(r for r in (self.cur, self.good) if r.id == run_id)


def _cli_diff(*args: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["diff", "--no-sync", "--json", *args]) == 0
    return json.loads(out.getvalue())


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUDECK_HOME", str(tmp_path))
    return tmp_path


async def test_the_rollback_dialog_and_gpudeck_diff_show_the_same_rows_and_figures(home: Path) -> None:
    fleet = LocalPair(home / "history.db")
    cli = await asyncio.to_thread(_cli_diff, CUR, GOOD)  # the real entry point (its own event loop)
    outcome = {r["key"]: (r["a"], r["b"]) for r in cli["outcome"]}
    assert outcome["tokens/s (median)"] == ("180.6", "76.79")  # the median of the recorded steps, both sides
    assert not any(r["key"] == "host" and r["differs"] for r in cli["config"])
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        app.open_run("local", CUR)
        await until(lambda: (s := mounted(app, RunScreen)) is not None and s.run is not None, what="the run")
        await press_for(pilot, "b", RunPicker)
        choice = await press_for(pilot, "enter", ChoiceDialog)
        console = Console(width=200, record=True)
        console.print(choice.body)
        shown = console.export_text()
    tps_line = next(ln for ln in shown.splitlines() if "tokens/s" in ln)
    assert "180.6" in tps_line and "76.79" in tps_line and "1,702" not in tps_line and "81.66" not in tps_line, shown
    assert not any(ln.split()[1:2] == ["host"] for ln in shown.splitlines() if ln.split()), shown  # both ran on `local`
    # every row `gpudeck diff` marks as differing is in the dialog, with the same two values
    for section in ("config", "environment", "outcome"):
        for row in cli[section]:
            if row["differs"] and max(len(row["a"]), len(row["b"])) <= 40:  # a long command folds in the dialog's cell
                line = next((ln for ln in shown.splitlines() if f" {row['key']} " in f" {ln} "), None)
                assert line is not None and row["a"] in line and row["b"] in line, (row, shown)
