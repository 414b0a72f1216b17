"""The console against runs whose name, argv, environment and output are hostile: escape sequences and Rich markup.

Every screen a run can be seen on is opened (Fleet, Runs, each Run screen and its four tabs, History, Diff, Host,
Leftovers); the app must not crash, and the run's strings must show literally (markup shown as text, not applied;
escape sequences as visible escapes), with --env secrets redacted.
"""

from __future__ import annotations

import sys

from rich.text import Text as RichText
from textual.widgets import Static

from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.replica import History
from gpudeck.console.ops.context import Ops
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.diff import DiffScreen
from gpudeck.console.tui.screens.history import HistoryScreen
from gpudeck.console.tui.screens.leftovers import LeftoversScreen
from gpudeck.console.tui.screens.run import RunScreen
from gpudeck.console.tui.screens.runs import RunsScreen
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.agent_harness import AgentProc
from tests.functional.helpers import mounted, open_host, press_for, until

NAMES = [
    "[bold red]red[/]",
    "[/]",
    "[link=https://evil.example]click[/link]",
    "esc\x1b]0;pwned\x07\x1b[2Jname",
    "[",
    "x[/bold]y[@click=app.quit]q",
]
PRINT = "import sys; print(sys.argv[1]); print('[bold]out[/] \\x1b[31mred\\x1b[0m [/]', flush=True); import time; time.sleep(60)"
SIZE = (160, 45)


def _plain(app: GpudeckApp) -> str:
    out = []
    for w in app.screen.query("*"):
        if isinstance(w, Static):
            r = w.render()
            out.append(getattr(r, "plain", str(r)))
            assert "\x1b" not in out[-1], f"raw ESC in {w!r}: {out[-1][:200]!r}"
        if isinstance(w, KeyedTable):
            for key in w.keys():
                for col in w.columns:
                    try:
                        cell = w.get_cell(key, col)
                    except Exception:
                        continue
                    # what DataTable shows: a str cell is read as markup, a Text as it is
                    out.append(RichText.from_markup(cell).plain if isinstance(cell, str) else str(cell))
    return "\n".join(out)


async def test_hostile_names_argv_env_and_output_show_literally_on_every_screen(agent: AgentProc, history: History) -> None:
    ids = []
    for n in NAMES:
        out = agent.cli(
            "launch", "--name", n, "--env", "HF_TOKEN=hf_sekrit", "--env", f"NOTE={n}", "--", sys.executable, "-c", PRINT, f"argv {n}"
        )
        ids.append(out.stdout.strip())
    app = GpudeckApp(Ops.console(Fleet(state_dir=agent.state_dir, interval_s=0.2, history=history)))
    async with app.run_test(size=SIZE) as pilot:
        runs = await press_for(pilot, "r", RunsScreen)
        table = runs.query_one("#runs-table", KeyedTable)
        await until(lambda: len(table.keys()) >= len(NAMES), timeout=30, what="every run in the Runs table")
        shown = _plain(app)
        for n in NAMES:
            safe = n.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
            assert safe in shown, f"{safe!r} is not shown literally on the Runs screen"
        for rid in ids:
            app.open_run("local", rid)
            await until(lambda: mounted(app, RunScreen), what="the run screen")
            for tab in "1234":
                await pilot.press(tab)
                await pilot.pause()
            text = _plain(app)
            assert "\x1b" not in text
            assert "hf_sekrit" not in text, "a --env secret is shown on the Run screen"
            await pilot.press("escape")
            await until(lambda: not isinstance(app.screen, RunScreen), what="back from the run screen")
        hist = await press_for(pilot, "h", HistoryScreen)
        htable = hist.query_one("#history-table", KeyedTable)
        await until(lambda: len(htable.keys()) >= len(NAMES), timeout=30, what="every run in History")
        shown = _plain(app)
        for n in NAMES[:3]:
            assert n in shown, f"{n!r} is not shown literally in History"
        htable.focus()
        await pilot.press("space")
        await pilot.press("space")
        await pilot.press("d")
        await until(lambda: mounted(app, DiffScreen), what="the diff screen")
        await pilot.pause()
        assert "hf_sekrit" not in _plain(app)
        await pilot.press("escape")
        await pilot.press("escape")
        await open_host(app, "local")
        await pilot.pause()
        await press_for(pilot, "L", LeftoversScreen)
        await pilot.pause()
        assert app.is_running
    for rid in ids:
        agent.cli("stop", rid, "--grace", "1", check=False)
