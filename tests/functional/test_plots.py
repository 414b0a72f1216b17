"""Line plots with axes (textual-plotext): loss and tokens/s by step in the Run screen, both runs overlaid in the
Diff screen, a host's GPU memory over the last minutes in the Host screen."""

from __future__ import annotations

import re
from pathlib import Path

from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.diff import DiffScreen
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.widgets.plots import MetricPlot, thin
from tests.functional.fixture_fleet import GOOD, LIVE, FixtureFleet
from tests.functional.helpers import mounted, open_host, until

SIZE = (160, 50)


async def test_run_screen_plots_loss_and_tokens_per_second_by_step(tmp_path: Path) -> None:
    app = GpudeckApp(Ops.console(FixtureFleet(tmp_path / "history.db")))
    async with app.run_test(size=SIZE) as pilot:
        app.open_run("gpu1", LIVE)
        screen = await until(lambda: mounted(app, RunScreen), what="the run screen")
        loss = screen.query_one("#loss-plot", MetricPlot)
        tps = screen.query_one("#tps-plot", MetricPlot)
        await until(lambda: loss.lines and tps.lines, what="both plots drawn")
        assert list(loss.lines[0].x)[:3] == [1.0, 2.0, 3.0] and len(loss.lines[0].x) == 120  # the step on x
        await pilot.pause()
        drawn = "\n".join(loss.render().plain.splitlines())  # type: ignore[union-attr]
        assert "step" in drawn and "120" in drawn  # the x axis, labelled, with its ticks


async def test_diff_screen_overlays_both_runs(tmp_path: Path) -> None:
    fleet = FixtureFleet(tmp_path / "history.db")
    assert fleet.history is not None
    a, b = fleet.history.find(LIVE, "gpu1"), fleet.history.find(GOOD, "gpu1")
    ma, mb = fleet.history.metrics("gpu1", LIVE), fleet.history.metrics("gpu1", GOOD)
    assert ma and mb
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        app.push_screen(DiffScreen(a, b, ma, mb))
        diff = await until(lambda: mounted(app, DiffScreen), what="the diff screen")
        await pilot.pause()
        plot = diff.query_one("#diff-loss", MetricPlot)
        assert [s.label[:1] for s in plot.lines] == ["A", "B"]  # two lines, one per run, with a legend


async def test_host_screen_plots_gpu_memory_over_time(tmp_path: Path) -> None:
    fleet = FixtureFleet(tmp_path / "history.db")
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE):
        host = await open_host(app)
        plot = host.query_one("#host-mem-plot", MetricPlot)
        await until(lambda: plot.lines, what="the memory plot")
        assert [s.label for s in plot.lines] == ["GPU 0", "GPU 1", "GPU 2", "GPU 3"]
        assert plot.lines[0].y[-1] == 79.0  # GiB used on GPU 0 now


def test_thin_keeps_the_ends_and_the_limit() -> None:
    xs = list(range(10_000))
    tx, ty = thin(xs, [float(x) for x in xs], limit=100)
    assert len(tx) == 100 and tx[0] == 0 and tx[-1] == 9_999


async def test_the_host_memory_plot_ends_at_now(tmp_path: Path) -> None:
    """The first sample alone: plotext centred it, and the x axis ran a minute into the future."""
    app = GpudeckApp(Ops.console(FixtureFleet(tmp_path / "history.db")))
    async with app.run_test(size=SIZE) as pilot:
        host = await open_host(app)
        plot = host.query_one("#host-mem-plot", MetricPlot)
        await until(lambda: plot.lines, what="the memory plot")
        await pilot.pause()
        lines = plot.render().plain.splitlines()  # type: ignore[union-attr]
        axis = next(i for i, line in enumerate(lines) if line.lstrip().startswith("└"))
        ticks = [float(t) for t in re.findall(r"-?\d+\.\d+", lines[axis + 1])]
        assert ticks and max(ticks) == 0.0 and min(ticks) < 0, lines[axis + 1]
