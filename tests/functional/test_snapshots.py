"""Screen snapshots with fixture data (pytest-textual-snapshot): what an operator sees, pinned."""

from __future__ import annotations


import pytest

from console.app import GpudeckApp
from tests.functional.fixture_fleet import FixtureFleet

SIZE = (150, 36)


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """UTC, and 'now' for the console's relative times ('5m00s ago') fixed at T0 + 300 s."""
    import time
    import types

    from tests.functional.fixture_fleet import T0

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.setattr("console.fmt.time", types.SimpleNamespace(time=lambda: T0 + 300.0))


def make_app() -> GpudeckApp:
    return GpudeckApp(FixtureFleet())


def test_fleet_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def ready(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=ready)


def test_host_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def open_host(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.pause()
        pilot.app.open_host("gpu1")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=open_host)


def test_runs_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def open_runs(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("r")
        await pilot.pause(0.3)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=open_runs)


def test_run_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def open_run(pilot) -> None:  # type: ignore[no-untyped-def]
        pilot.app.open_run("gpu1", "r-1b2c3d4e")
        await pilot.pause(0.5)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=open_run)


def test_launch_dialog(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def open_launch(pilot) -> None:  # type: ignore[no-untyped-def]
        from textual.widgets import Input

        await pilot.press("l")
        await pilot.pause()
        # the default is this venv's python, whose path differs per checkout: pin it for the picture
        pilot.app.screen.query_one("#python", Input).value = "/opt/venv/bin/python3"
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=(150, 50), run_before=open_launch)


async def test_help_and_palette_open() -> None:
    from textual.widgets import HelpPanel

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert app.screen.query(HelpPanel)
        await pilot.press("ctrl+p")
        await pilot.pause()
        from textual.command import CommandPalette

        assert isinstance(app.screen, CommandPalette)
