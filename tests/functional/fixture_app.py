"""Runs the console on the fixture fleet (made-up data, no agent): ``python -m tests.functional.fixture_app``.

For looking at the screens by hand, e.g. in tmux; the snapshot tests use the same fixtures.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from tests.functional.fixture_fleet import FixtureFleet


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gd-fixture-") as d:
        GpudeckApp(Ops.console(FixtureFleet(Path(d) / "history.db"))).run()


if __name__ == "__main__":
    main()
