"""Run-controlled strings in the console's dialogs: escaped as the tables escape them, one row where a row is expected,
bounded; and the Relaunch form launches the recorded values when its fields are left as shown."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import TypeVar

import msgspec
import pytest
from textual.app import App
from textual.geometry import Region
from textual.widgets import Input

from gpudeck.agents.wire.protocol import LaunchSpec, RunInfo, StoppedProcess, StopResult
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.dialogs import ConfirmDialog, ResultDialog
from gpudeck.console.tui.screens.launch import FIELD_LIMIT, LaunchDialog
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.functional.fixture_fleet import T0, FixtureFleet
from tests.functional.helpers import mounted, press_for, until

T = TypeVar("T")
SIZE = (160, 50)
TITLE = "t\x1b]2;PWNED-TITLE\x07"
RED = "evil\x1b[31mRED"
HOSTILE = "r-0badc0de"
ARGV = ["python", "train.py", "--note", "line one\nline two\nline three", "--tag", RED]


class HostileFleet(FixtureFleet):
    """The fixture fleet plus one run whose name, argv and stop result carry escape sequences and line breaks."""

    def __init__(self, history_path: Path | None = None, name: str = TITLE) -> None:
        super().__init__(history_path)
        self.hostile = RunInfo(
            id=HOSTILE,
            host="gpu1",
            state="failed",
            name=name,
            spec=LaunchSpec(argv=list(ARGV), name=name, python="/opt/venv/bin/python3"),
            created=T0 - 60,
            started=T0 - 60,
            ended=T0 - 30,
            cause=f"exit code 1: {RED}\nsecond line",
        )

    async def runs(self, host: str, limit: int = 1000) -> list[RunInfo]:
        return [*await super().runs(host, limit), self.hostile] if host == "gpu1" else []

    async def run(self, host: str, run_id: str) -> RunInfo:
        return self.hostile if run_id == HOSTILE else await super().run(host, run_id)

    async def stop(self, host: str, run_id: str, grace_s: float = 30.0) -> StopResult:
        res = await super().stop(host, run_id, grace_s)
        return msgspec.structs.replace(
            res, message=f"stopped {TITLE}\nnext", stopped=[StoppedProcess(pid=4412, cmdline=ARGV, how="SIGTERM")]
        )


def drawn(app: App) -> list[str]:
    """Every line every widget of the top screen draws, as the terminal would get it (segments' text)."""
    lines = []
    for w in app.screen.query("*"):
        if not w.display or w.size.area == 0:
            continue
        for strip in w.render_lines(Region(0, 0, w.size.width, w.size.height)):
            lines.append("".join(seg.text for seg in strip))
    return lines


def assert_terminal_safe(lines: list[str]) -> None:
    for line in lines:
        bad = [c for c in line if unicodedata.category(c) == "Cc"]
        assert not bad, f"a control character reaches the terminal: {line!r}"


async def on_hostile_run(pilot, key: str, dialog: type[T]) -> T:  # type: ignore[no-untyped-def]
    """Open Runs, highlight the hostile run, press ``key`` and wait for ``dialog``."""
    runs = await press_for(pilot, "r", RunsScreen)
    table = runs.query_one("#runs-table", KeyedTable)
    await until(lambda: HOSTILE in table.keys(), what="the hostile run in the Runs table")
    table.move_cursor_to_key(HOSTILE)
    table.focus()
    await pilot.press(key)
    return await until(lambda: mounted(pilot.app, dialog), what=f"{dialog.__name__} after {key!r}")


@pytest.mark.parametrize("name", [TITLE, RED])
async def test_relaunch_shows_a_hostile_name_and_argv_escaped_on_one_row_and_launches_the_recorded_ones(tmp_path: Path, name: str) -> None:
    fleet = HostileFleet(name=name)
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await on_hostile_run(pilot, "R", LaunchDialog)
        await pilot.pause()
        assert_terminal_safe(drawn(app))
        name_field, args_field = dialog.query_one("#name", Input), dialog.query_one("#args", Input)
        assert name_field.value == name.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
        assert "\n" not in args_field.value and "line one\\x0aline two" in args_field.value
        # the args field is one row inside the dialog: nothing of it is drawn over the table under the dialog
        assert args_field.size.height == 1 and dialog.query_one("#launch-dialog").region.contains_region(args_field.region)
        # left as shown, the fields stand for the recorded values, byte for byte
        spec = dialog.plan().spec
        assert spec.name == name
        assert spec.argv[-len(ARGV) + 1 :] == ARGV[1:]


async def test_an_edited_field_is_launched_as_typed_and_a_cut_one_is_refused(tmp_path: Path) -> None:
    # the python path: a field with no limit of its own (a run's name has one, 256 characters, so a longer recorded
    # name is refused as such, below)
    long_python = "/opt/" + "p" * (FIELD_LIMIT + 50)
    fleet = HostileFleet()
    fleet.hostile = msgspec.structs.replace(fleet.hostile, spec=msgspec.structs.replace(fleet.hostile.spec, python=long_python))
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await on_hostile_run(pilot, "R", LaunchDialog)
        field = dialog.query_one("#python", Input)
        assert len(field.value) == FIELD_LIMIT and field.value.endswith("…")
        assert dialog.plan().spec.python == long_python  # untouched: the recorded value
        field.value = field.value[:-2] + "x…"
        with pytest.raises(Exception, match="shown cut"):
            dialog.plan()
        field.value = "/usr/bin/python3"
        assert dialog.plan().spec.python == "/usr/bin/python3"


async def test_a_recorded_name_past_the_name_limit_is_refused_until_it_is_shortened(tmp_path: Path) -> None:
    fleet = HostileFleet(name="n" * 300)
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await on_hostile_run(pilot, "R", LaunchDialog)
        with pytest.raises(Exception, match="at most 256 characters"):
            dialog.plan()
        dialog.query_one("#name", Input).value = "plain"
        assert dialog.plan().spec.name == "plain"


async def test_stop_confirm_and_result_dialogs_escape_and_bound_what_the_run_controls(tmp_path: Path) -> None:
    fleet = HostileFleet()
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=SIZE) as pilot:
        await on_hostile_run(pilot, "s", ConfirmDialog)
        await pilot.pause()
        assert_terminal_safe(drawn(app))
        await pilot.press("y")
        await until(lambda: mounted(app, ResultDialog), what="the stop result")
        await pilot.pause()
        lines = drawn(app)
        assert_terminal_safe(lines)
        assert any("stopped t\\x1b]2;PWNED-TITLE\\x07\\x0anext" in line for line in lines)
