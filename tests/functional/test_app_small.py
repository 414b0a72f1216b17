"""Smaller things: the palette names each command once, the screenshot is saved where it can be and says where,
the light theme's 'changed' colour passes WCAG AA (4.5:1) on its background, and the console's one time format."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from rich.style import Style
from textual.color import Color
from textual.command import CommandList, CommandPalette

from gpudeck.console.ops.context import Ops
from gpudeck.console.present import views
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.widgets.diff import DIFF_STYLE
from tests.functional.fixture_fleet import FixtureFleet
from tests.functional.helpers import until


def luminance(rgb: tuple[int, int, int]) -> float:
    """WCAG relative luminance."""

    def lin(c: int) -> float:
        v = c / 255
        return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


async def test_the_light_themes_changed_colour_passes_wcag_aa(tmp_path: Path) -> None:
    app = GpudeckApp(Ops.console(FixtureFleet(tmp_path / "h.db")))
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.press("ctrl+t")
        assert app.theme == "textual-light"
        color = Style.parse(DIFF_STYLE).color
        assert color is not None
        changed = color.get_truecolor(app.ansi_theme)  # what 'yellow' becomes on this theme
        theme = app.current_theme
        for name in ("background", "surface", "panel"):
            bg = Color.parse(getattr(theme, name)).rgb
            ratio = contrast((changed.red, changed.green, changed.blue), bg)
            assert ratio >= 4.5, f"'changed' {changed.hex} on {name} {bg}: {ratio:.2f}:1"


async def test_the_palette_lists_each_command_once(tmp_path: Path) -> None:
    app = GpudeckApp(Ops.console(FixtureFleet(tmp_path / "h.db")))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+p")
        palette = await until(lambda: isinstance(app.screen, CommandPalette) and app.screen, what="the palette")
        commands = palette.query_one(CommandList)
        await until(lambda: commands.option_count > 5, what="the commands listed")
        await pilot.pause(0.3)
        titles = [str(commands.get_option_at_index(i).prompt).split("\n")[0].strip() for i in range(commands.option_count)]
        assert len(titles) == len(set(titles)), sorted(t for t in titles if titles.count(t) > 1)
        assert titles.count("Quit") == 1 and "Screenshot" in titles


async def test_the_screenshot_creates_its_folder_or_falls_back_to_the_state_dir_and_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpudeck_home: Path
) -> None:
    downloads = tmp_path / "no" / "Downloads"  # does not exist yet: created
    monkeypatch.setattr("gpudeck.console.tui.app.platformdirs", types.SimpleNamespace(user_downloads_dir=lambda: str(downloads)))
    app = GpudeckApp(Ops.console(FixtureFleet(tmp_path / "h.db")))
    async with app.run_test(size=(100, 30)) as pilot:
        app.action_screenshot()
        assert app.last_screenshot is not None and app.last_screenshot.parent == downloads and app.last_screenshot.exists()
        await pilot.pause()
        assert any(str(downloads) in str(n.message) for n in app._notifications)
        blocked = tmp_path / "a-file"
        blocked.write_text("")  # a folder cannot be made under a file (even by root): the state dir takes it
        monkeypatch.setattr("gpudeck.console.tui.app.platformdirs", types.SimpleNamespace(user_downloads_dir=lambda: str(blocked / "sub")))
        app.action_screenshot()
        await pilot.pause()
        shot = app.last_screenshot
        assert shot is not None and shot.parent.name == "screenshots" and gpudeck_home in shot.parents and shot.exists()


def test_times_show_the_date_when_not_today_and_ages_read_short(monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime as dt
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    now = dt.datetime(2026, 11, 30, 12, 0, 0, tzinfo=dt.UTC).timestamp()
    monkeypatch.setattr("gpudeck.console.core.fmt.time", types.SimpleNamespace(time=lambda: now))
    assert views.stamp(now - 3600) == "11:00:00"
    assert views.stamp(now - 2 * 86400 + 9 * 3600 + 22 * 60) == "Nov 28 21:22"
    assert views.stamp(now - 400 * 86400) == "2025-10-26"
    assert views.age(now - 3 * 3600 - 5) == "3h ago" and views.age(now - 12) == "12s ago" and views.age(now - 5 * 86400) == "5d ago"
    assert views.stamp_age(now - 3 * 3600) == "09:00:00 (3h ago)"
    assert views.stamp(None) == "-" and views.age(None) == "-"
