"""The wide tables at 100 and 200 columns (the least important columns fold first), filtered and sorted.

Same pinned clock and fixture data as test_snapshots.py; update with ``--snapshot-update`` and look at the report.
"""

from __future__ import annotations

import types
from pathlib import Path

import msgspec
import pytest
from textual.widgets import Button

from gpudeck.agents.wire.protocol import LaunchSpec, PreflightResult, Snapshot
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ConfirmDialog
from gpudeck.console.tui.screens.history import HistoryScreen
from gpudeck.console.tui.screens.leftovers import LeftoversScreen
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.functional.fixture_fleet import GIB, GOOD, T0, FixtureFleet, fixture_preflight, fixture_snapshot
from tests.functional.helpers import mounted, open_host, press_for, until
from tests.functional.test_snapshots import fixed_clock, preflight_llama, settle  # noqa: F401  (fixed_clock: an autouse fixture)


@pytest.fixture
def app(tmp_path: Path) -> GpudeckApp:
    return GpudeckApp(Ops.console(FixtureFleet(tmp_path / "history.db")))


WIDTHS = [pytest.param((100, 32), id="100"), pytest.param((200, 40), id="200")]


@pytest.mark.parametrize("size", WIDTHS)
def test_fleet_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(app, terminal_size=size, run_before=settle)


@pytest.mark.parametrize("size", WIDTHS)
def test_fleet_filtered_and_sorted(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def filtered(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("slash", *"gpu", "enter", "greater_than_sign", "greater_than_sign")  # filter, then sort by STATE
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=filtered)


@pytest.mark.parametrize("size", WIDTHS)
def test_runs_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def open_runs(pilot) -> None:  # type: ignore[no-untyped-def]
        screen = await press_for(pilot, "r", RunsScreen)
        await until(lambda: GOOD in screen.query_one("#runs-table", KeyedTable).keys(), what="the history's runs")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=open_runs)


@pytest.mark.parametrize("size", WIDTHS)
def test_history_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def open_history(pilot) -> None:  # type: ignore[no-untyped-def]
        screen = await press_for(pilot, "h", HistoryScreen)
        await until(lambda: screen.query_one("#history-table", KeyedTable).row_count >= 3, what="the history")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=open_history)


@pytest.mark.parametrize("size", WIDTHS)
def test_host_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def host(pilot) -> None:  # type: ignore[no-untyped-def]
        await open_host(pilot.app)
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=host)


@pytest.mark.parametrize("size", WIDTHS)
def test_leftovers_at_width(snap_compare, app, size) -> None:  # type: ignore[no-untyped-def]
    async def leftovers(pilot) -> None:  # type: ignore[no-untyped-def]
        pilot.app.push_screen(LeftoversScreen("gpu1"))
        screen = await until(lambda: mounted(pilot.app, LeftoversScreen), what="the leftovers screen")
        await until(lambda: screen.query_one("#leftovers-table", KeyedTable).row_count == 3, what="the leftovers")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=leftovers)


# ----------------------------------------------------------------------------- reclaim-and-launch's confirmation


def holders_preflight(spec: LaunchSpec) -> PreflightResult:
    """The fixture's verdict with the GPU-holder check naming two processes of the operator (ada) on GPU 1: a stale
    one of an ended run and a foreign one, as an agent's pre-flight details them (so "Reclaim these and launch" is offered)."""
    result = fixture_preflight(spec)
    holders = [
        {
            "pid": 3301,
            "gpu": 1,
            "attribution": "STALE",
            "user": "ada",
            "used_bytes": 21 * GIB,
            "run_id": "r-1b2c3d4e",
            "run_ended": T0 - 5100,
            "cmdline": ["python", "-m", "gpudeck.trainers.dflash", "--target", "llama-1b"],
        },
        {"pid": 999, "gpu": 1, "attribution": "FOREIGN", "user": "ada", "used_bytes": 3 * GIB, "cmdline": ["jupyter-kernel"]},
    ]
    message = "GPU 1 is held by pid 3301 (STALE: run r-1b2c3d4e, failed 1h25m ago, 21.0 GiB) and pid 999 (FOREIGN, ada, 3.0 GiB) (fixture)"
    checks = [
        msgspec.structs.replace(c, message=message, details={"holders": holders}) if c.name == "gpu_holders" else c for c in result.checks
    ]
    return msgspec.structs.replace(result, checks=checks)


def holders_snapshot() -> Snapshot:
    """gpu1's snapshot (what the plan reads the holders' ages from), its foreign process ada's as well."""
    snap = fixture_snapshot()
    gpus = [
        msgspec.structs.replace(g, processes=[msgspec.structs.replace(p, user="ada") if p.pid == 999 else p for p in g.processes])
        for g in snap.gpus
    ]
    return msgspec.structs.replace(snap, gpus=gpus)


@pytest.mark.parametrize("size", WIDTHS)
def test_reclaim_and_launch_confirmation_at_width(snap_compare, app, size, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Launch dialog's first action after pre-flight named the operator's own holders: the one confirmation, listing
    exactly the pids that go (user, run, GiB per GPU, age, what each is, its command)."""
    monkeypatch.setenv("LOGNAME", "ada")  # the operator (getpass reads LOGNAME first)
    monkeypatch.setenv("USER", "ada")
    monkeypatch.setattr("gpudeck.console.ops.holders.time", types.SimpleNamespace(time=lambda: T0 + 300.0))  # the ages
    fleet = app.ops.fleet
    monkeypatch.setattr(fleet, "preflight", lambda host, spec: _answer(fleet, host, spec))
    monkeypatch.setattr(fleet, "snapshot", _snapshot)
    fleet.links["gpu1"].status.snapshot = holders_snapshot()

    async def confirm(pilot) -> None:  # type: ignore[no-untyped-def]
        dialog = await preflight_llama(pilot)
        await until(lambda: "Reclaim these and launch" in str(dialog.query_one("#launch", Button).label), what="the reclaim offer")
        await pilot.press("ctrl+s")
        await until(lambda: mounted(pilot.app, ConfirmDialog), what="the reclaim confirmation")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=confirm)


async def _answer(fleet: FixtureFleet, host: str, spec: LaunchSpec) -> PreflightResult:
    fleet.preflighted.append((host, spec))
    return holders_preflight(spec)


async def _snapshot(host: str) -> Snapshot:
    return holders_snapshot()
