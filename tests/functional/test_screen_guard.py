"""The one guard in console/tui/screens/base.py: work that outlives its screen ends quietly; on a shown screen a missing
widget is still a bug that surfaces."""

from __future__ import annotations

import asyncio

import pytest
from textual import work
from textual.app import App, ComposeResult
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Static

from gpudeck.console.tui.screens.base import Guarded
from tests.functional.helpers import until


class Late(Message):
    pass


class Probe(Guarded, Screen):
    def __init__(self, gate: asyncio.Event) -> None:
        super().__init__()
        self.gate = gate
        self.ran: list[str] = []

    def compose(self) -> ComposeResult:
        yield Static("probe", id="here")

    @work(exclusive=True, group="probe")
    async def late_worker(self) -> None:
        await self.gate.wait()
        self.ran.append("worker")
        self.query_one("#gone", Static)

    @work(thread=True, group="probe-thread")
    def late_thread(self) -> None:
        import time

        while not self.gate.is_set():
            time.sleep(0.01)
        self.ran.append("thread")
        self.query_one("#gone", Static)

    def on_late(self, _m: Late) -> None:
        self.ran.append("message")
        self.query_one("#gone", Static)

    def tick(self) -> None:
        if self.gate.is_set():
            self.ran.append("timer")
            self.query_one("#gone", Static)


class ProbeApp(App):
    pass


async def test_work_that_outlives_its_screen_ends_quietly() -> None:
    app = ProbeApp()
    gate = asyncio.Event()
    async with app.run_test() as pilot:
        probe = Probe(gate)
        await app.push_screen(probe)
        probe.late_worker()
        probe.late_thread()
        probe.set_interval(0.02, probe.tick)
        app.pop_screen()
        await pilot.pause()
        probe.post_message(Late())
        gate.set()
        # a thread worker cannot be cancelled with its screen: it runs on, and queries after the pop
        await until(lambda: "thread" in probe.ran, what="the thread worker to query after the pop")
        await pilot.pause(0.1)
        assert app.is_running and app._exception is None  # type: ignore[attr-defined]


async def test_a_missing_widget_on_a_shown_screen_is_still_an_error() -> None:
    app = ProbeApp()
    gate = asyncio.Event()
    gate.set()
    with pytest.raises(Exception) as exc:
        async with app.run_test() as pilot:
            probe = Probe(gate)
            await app.push_screen(probe)
            probe.late_worker()
            await pilot.pause(0.5)
    assert "NoMatches" in repr(exc.value) or isinstance(exc.value, NoMatches) or "gone" in str(exc.value)


class Witness(Static):
    """Records, as it is taken down, whether its screen already counts as gone (the window a late worker meets)."""

    def __init__(self, seen: list[bool]) -> None:
        super().__init__("witness", id="witness")
        self.seen = seen

    def on_unmount(self) -> None:
        self.seen.append(self.screen.screen_gone())  # type: ignore[attr-defined]  # Guarded's, on the Probe screen


class WitnessProbe(Probe):
    def __init__(self, gate: asyncio.Event, seen: list[bool]) -> None:
        super().__init__(gate)
        self.seen = seen

    def compose(self) -> ComposeResult:
        yield Witness(self.seen)


async def test_while_the_app_shuts_down_its_screens_count_as_gone() -> None:
    """At shutdown Textual prunes each screen's widgets while the screen is still on the stack: a worker that queries
    then must end quietly (under a 4x-oversubscribed suite, the Run screen's refresh worker met that window)."""
    app = ProbeApp()
    seen: list[bool] = []
    async with app.run_test() as pilot:
        probe = WitnessProbe(asyncio.Event(), seen)
        await app.push_screen(probe)
        await pilot.pause()
        assert not probe.screen_gone()
    assert seen == [True], seen
