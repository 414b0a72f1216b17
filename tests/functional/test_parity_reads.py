"""Parity: `gpudeck triage` and the Run screen's Triage (T), `gpudeck tail` and the Run screen's output, `gpudeck metrics`
and the Run screen's loss and tokens/s reach the same result for the same fixture fleet, each through the one entry
point of console/ops.

Both front-ends hold an :class:`~gpudeck.console.ops.context.Ops`; the spies here wrap the shared operation (the
``Ops`` method, or the readings function under it) and record every call with the front-end that made it: a front-end
that stopped going through it (asked the fleet itself, or read the output another way) leaves its list empty and the
test fails, as it does when the two show different rows. The CLI runs through its real entry point with the fixture
fleet in place of the one ``Ops.request`` would build.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Static

from gpudeck.agents.wire.protocol import OutputChunk, RankEvidence, Triage, TriageReply
from gpudeck.console.cli.main import main as cli_main
from gpudeck.console.ops import readings
from gpudeck.console.ops.context import Ops
from gpudeck.console.ops.resolve import Resolved
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.widgets.output_view import OutputView
from tests.functional.fixture_fleet import LIVE, T0, FixtureFleet
from tests.functional.helpers import mounted, text_of, until

SIZE = (180, 50)


def fixture_triage(run_id: str) -> Triage:
    return Triage(
        run_id=run_id,
        ts=T0 - 30,
        reason="on demand",
        culprit="rank 2 (pid 4414) waits in all_reduce; ranks 0, 1, 3 wait for it (fixture)",
        seconds=1.5,
        ranks=[
            RankEvidence(
                rank=0,
                pid=4412,
                state="sleeping",
                cpu_percent=0.5,
                gpu=0,
                gpu_util=0,
                method="py-spy",
                method_why="the rank is alive (fixture)",
                where="all_reduce in distributed_c10d.py:2501 (fixture)",
                stacks="Thread 4412 (idle): MainThread\n    all_reduce (distributed_c10d.py:2501)\n    train_step (trainer.py:210)",
                in_collective=True,
            ),
            RankEvidence(
                rank=2,
                pid=4414,
                state="disk-sleep",
                cpu_percent=0.0,
                method="py-spy",
                method_why="the rank is alive (fixture)",
                where="load_batch in data.py:88 (fixture)",
            ),
        ],
        missing=["the Flight Recorder is off (fixture)"],
    )


class TriageFleet(FixtureFleet):
    """The fixture fleet, answering a triage of any run."""

    async def triage(self, host: str, run_id: str) -> TriageReply:
        self._host(host)
        return TriageReply(triage=fixture_triage(run_id))


@pytest.fixture
def cli_fleet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every fleet the CLI's Ops.request makes is a fixture fleet."""
    monkeypatch.setenv("GPUDECK_HOME", str(tmp_path))
    monkeypatch.setattr("gpudeck.console.ops.context.Fleet", lambda *_a, **_kw: TriageFleet())


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli_main(list(args))
    return rc, out.getvalue()


def _nodes(found: Resolved) -> list[tuple[str, str]]:
    return [(h, r.id) for h, r in found.nodes]


async def _run_screen(app: GpudeckApp, host: str, run_id: str) -> RunScreen:
    app.open_run(host, run_id)
    return await until(lambda: (s := mounted(app, RunScreen)) is not None and s.run is not None and s or None, what="the run screen")


async def test_triage_shows_the_same_evidence_in_both_through_ops_triage(
    cli_fleet: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[str, list[tuple[str, str]]]] = []
    real = Ops.triage

    async def spy(self: Ops, found: Resolved) -> Any:
        asked.append((who, _nodes(found)))
        return await real(self, found)

    monkeypatch.setattr(Ops, "triage", spy)
    who = "cli"
    rc, text = await asyncio.to_thread(_cli, "triage", LIVE, "--host", "gpu1")
    assert rc == 0, text
    rc, doc = await asyncio.to_thread(_cli, "triage", LIVE, "--host", "gpu1", "--json")
    cli = json.loads(doc)
    assert rc == 0 and [t["host"] for t in cli["triages"]] == ["gpu1"] and cli["failed"] == []
    who = "screen"
    app = GpudeckApp(Ops.console(TriageFleet(tmp_path / "h.db")))
    async with app.run_test(size=SIZE) as pilot:
        screen = await _run_screen(app, "gpu1", LIVE)
        await pilot.press("T")
        box = screen.query_one("#triage-text", Static)
        await until(lambda: "likely culprit" in text_of(box) or "no triage" in text_of(box), what="the triage")
        shown = text_of(box)
    assert asked == [("cli", [("gpu1", LIVE)]), ("cli", [("gpu1", LIVE)]), ("screen", [("gpu1", LIVE)])]
    assert shown.strip() == text.strip()  # the same formatted evidence (ops.triage.format_triage), line for line
    assert "rank 2 (pid 4414) waits in all_reduce" in shown


async def test_tail_and_the_run_screen_show_the_same_output_through_readings_run_output(
    cli_fleet: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[tuple[str, str, str, bool]] = []
    real = readings.run_output

    def spy(fleet: Any, host: str, run_id: str, offset: int = 0, follow: bool = True) -> AsyncIterator[OutputChunk]:
        reads.append((who, host, run_id, follow))
        return real(fleet, host, run_id, offset=offset, follow=follow)

    monkeypatch.setattr(readings, "run_output", spy)  # under Ops.output (the screen) and Ops.tail (the CLI) alike
    who = "cli"
    rc, text = await asyncio.to_thread(_cli, "tail", LIVE, "--host", "gpu1", "-n", "-1")
    assert rc == 0
    cli_lines = text.splitlines()
    assert len(cli_lines) == 40 and cli_lines[0].startswith("step     0 loss")
    who = "screen"
    app = GpudeckApp(Ops.console(TriageFleet(tmp_path / "h.db")))
    async with app.run_test(size=SIZE):
        screen = await _run_screen(app, "gpu1", LIVE)
        view = screen.query_one("#run-log", OutputView)
        await until(lambda: view.line_count >= len(cli_lines), what="the output")
        shown = [view.line(i) for i in range(view.line_count)]
    assert [r[:3] for r in reads] == [("cli", "gpu1", LIVE), ("screen", "gpu1", LIVE)]
    assert [ln for ln in shown if ln] == cli_lines


async def test_metrics_shows_the_same_figures_as_the_run_screen_through_ops_metrics(
    cli_fleet: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[str, str, str, int]] = []
    real = Ops.metrics

    async def spy(self: Ops, host: str, run_id: str, max_points: int = 200) -> readings.StepSeries:
        asked.append((who, host, run_id, max_points))
        return await real(self, host, run_id, max_points)

    monkeypatch.setattr(Ops, "metrics", spy)
    who = "cli"
    rc, text = await asyncio.to_thread(_cli, "metrics", LIVE, "--host", "gpu1")
    assert rc == 0, text
    rc, doc = await asyncio.to_thread(_cli, "metrics", LIVE, "--host", "gpu1", "--json")
    cli = json.loads(doc)
    assert rc == 0 and cli["source"] == "agent" and len(cli["steps"]) == 120
    who = "screen"
    app = GpudeckApp(Ops.console(TriageFleet(tmp_path / "h.db")))
    async with app.run_test(size=SIZE):
        screen = await _run_screen(app, "gpu1", LIVE)
        loss, tps = screen.query_one("#loss-label", Static), screen.query_one("#tps-label", Static)
        await until(lambda: "step" in text_of(loss) and "step" in text_of(tps), what="the metrics labels")
        shown = [text_of(loss), text_of(tps)]
    # the CLI asked twice (text, --json); the screen at least once (its refresh may ask again on a slow machine)
    assert [a[:3] for a in asked[:2]] == [("cli", "gpu1", LIVE), ("cli", "gpu1", LIVE)]
    assert asked[2:] and all(a[:3] == ("screen", "gpu1", LIVE) for a in asked[2:]), asked
    assert {a[3] for a in asked} == {200}  # the same number of points asked
    lines = text.strip().splitlines()
    assert lines[1:] == shown  # the same figures, written the same way (present.views.series_summary)
    assert lines[1].startswith("loss step 120: ") and lines[2].startswith("tokens/s step 120: ")
