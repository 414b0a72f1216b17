"""Parity: `gpudeck verify`, `gpudeck reclaim HOST` (its leftovers) and `gpudeck stop` reach the same result as the
Run screen's claims, the Leftovers screen and the Stop dialog, for the same fixture fleet.

Both front-ends go through console/ops (``readings.verify_run``, ``readings.host_leftovers``, ``stop.stop_run``);
the CLI runs through its real entry point with the fixture fleet in place of the one it would build.
"""

from __future__ import annotations

import asyncio
import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from gpudeck.console.cli.main import main as cli_main
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ConfirmDialog, ResultDialog
from gpudeck.console.tui.screens.leftovers import LeftoversScreen
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.functional.fixture_fleet import LIVE, FixtureFleet
from tests.functional.helpers import mounted, open_host, press_for, until

SIZE = (180, 50)


class CountingFleet(FixtureFleet):
    """The fixture fleet, remembering the stops asked of it."""

    def __init__(self, history_path: Path | None = None) -> None:
        super().__init__(history_path)
        self.stops: list[tuple[str, str, float]] = []

    async def stop(self, host: str, run_id: str, grace_s: float = 30.0):  # type: ignore[no-untyped-def]
        self.stops.append((host, run_id, grace_s))
        return await super().stop(host, run_id, grace_s)


@pytest.fixture
def cli_fleets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[CountingFleet]:
    """Every fleet the CLI makes is a fixture fleet (the list holds them)."""
    monkeypatch.setenv("GPUDECK_HOME", str(tmp_path))
    made: list[CountingFleet] = []

    def fleet(*_a: Any, **_kw: Any) -> CountingFleet:
        made.append(CountingFleet())
        return made[-1]

    monkeypatch.setattr("gpudeck.console.ops.context.Fleet", fleet)
    return made


def _cli(*args: str) -> tuple[int, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli_main(list(args))
    return rc, json.loads(out.getvalue())


async def test_verify_shows_the_same_claims_in_both(cli_fleets: list[CountingFleet], tmp_path: Path) -> None:
    rc, cli = await asyncio.to_thread(_cli, "verify", LIVE, "--json")
    assert rc == 1 and cli["host"] == "gpu1"  # a mismatch: exit 1
    app = GpudeckApp(Ops.console(CountingFleet(tmp_path / "h.db")))
    async with app.run_test(size=SIZE):
        app.open_run("gpu1", LIVE)
        run = await until(lambda: mounted(app, RunScreen), what="the run screen")
        claims = run.query_one("#claims-table", KeyedTable)
        await until(lambda: claims.row_count == len(cli["rows"]), what="the claims")
        marks = {"✓": True, "✗": False}
        screen = [(k.split(":", 1)[1], marks.get(str(claims.get_cell(k, "ok")).strip())) for k in claims.keys()]
    assert screen == [(r["what"], r.get("ok")) for r in cli["rows"]]


async def test_leftovers_are_the_same_in_both(cli_fleets: list[CountingFleet], tmp_path: Path) -> None:
    rc, cli = await asyncio.to_thread(_cli, "reclaim", "gpu1", "--json")
    assert rc == 0
    app = GpudeckApp(Ops.console(CountingFleet(tmp_path / "h.db")))
    async with app.run_test(size=SIZE) as pilot:
        await open_host(app)
        screen = await press_for(pilot, "L", LeftoversScreen)
        table = screen.query_one("#leftovers-table", KeyedTable)
        await until(lambda: table.row_count == len(cli["leftovers"]), what="the leftovers")
        assert sorted(table.keys()) == sorted(str(lo["pid"]) for lo in cli["leftovers"])


async def test_stop_asks_the_same_of_the_agent_and_shows_the_same_result(cli_fleets: list[CountingFleet], tmp_path: Path) -> None:
    rc, cli = await asyncio.to_thread(_cli, "stop", LIVE, "--host", "gpu1", "--json")  # the fixture lists LIVE on sim1 too
    assert rc == 0
    [asked] = [s for f in cli_fleets for s in f.stops]
    fleet = CountingFleet(tmp_path / "h.db")
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        app.open_run("gpu1", LIVE)
        await until(lambda: (s := mounted(app, RunScreen)) is not None and s.run is not None, what="the run")
        await press_for(pilot, "s", ConfirmDialog)
        await pilot.press("y")
        result = await until(lambda: mounted(app, ResultDialog), what="the stop result")
        assert f"pid {cli['stopped'][0]['pid']}" in str(result.body) or str(cli["stopped"][0]["pid"]) in str(result.body)
    assert fleet.stops == [asked]  # the same host, run and grace


async def test_reclaim_asks_the_same_of_the_agent(cli_fleets: list[CountingFleet], tmp_path: Path) -> None:
    app = GpudeckApp(Ops.console(fleet := CountingFleet(tmp_path / "h.db")))
    async with app.run_test(size=SIZE) as pilot:
        await open_host(app)
        screen = await press_for(pilot, "L", LeftoversScreen)
        table = screen.query_one("#leftovers-table", KeyedTable)
        await until(lambda: table.row_count == 3, what="three leftovers")
        await pilot.press("a", "x")  # every leftover marked, then reclaimed
        await until(lambda: mounted(app, ConfirmDialog), what="the reclaim confirmation")
        await pilot.press("y")
        await until(lambda: mounted(app, ResultDialog), what="the reclaim result")
    [(host, pids, include_live)] = fleet.reclaimed
    rc, cli = await asyncio.to_thread(_cli, "reclaim", *(f"{host}:{p}" for p in pids), "--json")
    assert rc == 0 and [r["host"] for r in cli] == [host]
    assert [f.reclaimed for f in cli_fleets] == [[(host, pids, include_live)]]  # the same pids of the same host, once
