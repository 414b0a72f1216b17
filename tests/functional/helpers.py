"""Provides helpers for the console's functional tests: wait for a condition while the app runs, read a widget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from rich.text import Text
from textual.widget import Widget

T = TypeVar("T")


async def until(pred: Callable[[], T], timeout: float = 60.0, what: str = "condition") -> T:
    """Poll ``pred`` until it returns something truthy (and return that), or fail saying what did not happen."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        v = pred()
        if v:
            return v
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


def mounted(app, cls):  # type: ignore[no-untyped-def]
    """The app's top screen if it is a mounted ``cls``, else None (for ``until``)."""
    screen = app.screen
    return screen if isinstance(screen, cls) and screen.is_mounted else None


def text_of(widget: Widget) -> str:
    """What a Static shows, as plain text."""
    r = widget.render()
    return r.plain if isinstance(r, Text) else str(r)


async def open_host(app, host: str = "gpu1"):  # type: ignore[no-untyped-def]
    """Open ``host``'s screen and wait until it is mounted; returns the screen."""
    from gpudeck.console.tui.screens.host import HostScreen

    app.open_host(host)
    return await until(lambda: mounted(app, HostScreen), what=f"the host screen of {host}")


async def open_launch(pilot, **fields: str):  # type: ignore[no-untyped-def]
    """Press l, wait for the launch dialog, fill ``fields`` (widget id -> value; ``resume_step`` is ``#resume-step``)."""
    from textual.widgets import Input, Select

    from gpudeck.console.tui.screens.launch import LaunchDialog

    await pilot.press("l")
    dialog = await until(lambda: mounted(pilot.app, LaunchDialog), what="the launch dialog")
    for wid, value in fields.items():
        dialog.query_one(f"#{wid.replace('_', '-')}", Input | Select).value = value  # type: ignore[arg-type]
    return dialog


async def press_for(pilot, key: str, cls):  # type: ignore[no-untyped-def]
    """Press ``key`` and wait for a ``cls`` screen on top; returns it."""
    await pilot.press(key)
    return await until(lambda: mounted(pilot.app, cls), what=f"{cls.__name__} after {key!r}")
