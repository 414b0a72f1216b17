"""Parity: the Runs screen and `gpudeck runs --json` list the same run ids for the same fixture fleet, both through
console/ops: with the history, the screen reads it by ``readings.runs_changed_since`` and ``runs --no-sync`` by
``readings.query_history``; without one, the screen asks the agents by ``resolve.fleet_runs``, as ``gpudeck runs`` does.

The CLI runs through its real entry point with the fixture fleet in place of the one it would build, and with the
fixture history at the path it opens (``GPUDECK_HOME``).
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
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.functional.fixture_fleet import FixtureFleet
from tests.functional.helpers import mounted, until

SIZE = (180, 50)


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The CLI's home: every fleet it makes is a fixture fleet; its history is the fixture history."""
    monkeypatch.setenv("GPUDECK_HOME", str(tmp_path))
    monkeypatch.setattr("gpudeck.console.ops.context.Fleet", lambda *_a, **_kw: FixtureFleet())
    return tmp_path


def _cli_ids(*args: str) -> set[str]:
    out = io.StringIO()
    with redirect_stdout(out):
        cli_main(list(args))
    doc: Any = json.loads(out.getvalue())
    rows = doc["runs"] if isinstance(doc, dict) else doc  # a host that did not answer: {"runs": [...], "unreachable": [...]}
    return {r["id"] for r in rows}


async def _screen_ids(fleet: FixtureFleet, expect: int) -> set[str]:
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        app.action_show_runs()
        screen = await until(lambda: mounted(app, RunsScreen), what="the runs screen")
        table = screen.query_one("#runs-table", KeyedTable)
        await until(lambda: table.total_rows >= expect, what=f"{expect} runs listed")
        await pilot.pause()
        return {str(k) for k in table.keys()}


async def test_the_runs_screen_lists_what_runs_json_lists_from_the_agents(home: Path) -> None:
    cli = await asyncio.to_thread(_cli_ids, "runs", "--json")
    assert cli  # the fixture's gpu1 answers with its runs
    assert await _screen_ids(FixtureFleet(), len(cli)) == cli


async def test_the_runs_screen_lists_what_runs_no_sync_json_lists_from_the_history(home: Path) -> None:
    fleet = FixtureFleet(home / "history.db")  # the fixture history, where the CLI opens it
    cli = await asyncio.to_thread(_cli_ids, "runs", "--no-sync", "--json")
    assert cli
    assert await _screen_ids(fleet, len(cli)) == cli
