"""One figure, one definition: the CLI (show, history, diff), the Diff screen and the History screen show the same values.

A run whose steps report tokens/s 100, 300, 250 and finally 900 (median 275,
last 900), whose last step seen is 98 but whose trainer reported final_step
100, and whose peak memory was 61.2 GiB, is read from a real history file;
a second run died of CUDA OOM (cause class ``oom``). Each figure is read back
from what every view prints or shows:

==================  ========  ===========  ========  ===========  ==============
figure              CLI show  CLI history  CLI diff  Diff screen  History screen
==================  ========  ===========  ========  ===========  ==============
median tokens/s     yes       yes          yes       yes          yes
last / final step   yes       yes          yes       yes          yes
peak memory         yes       -            yes       yes          -
elapsed             yes       yes          yes       yes          yes
cause class         yes       -            yes       yes          -
==================  ========  ===========  ========  ===========  ==============

(``-``: that view has no column for the figure.) The Runs screen's row of an ended run shows the same tokens/s and
step (it showed the last value the history kept: 900, step 98).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from pathlib import Path

import pytest

from gpudeck.agents.wire.protocol import LaunchSpec, RunInfo
from gpudeck.console.cli.main import main
from gpudeck.console.core.fmt import duration
from gpudeck.console.history.replica import History
from gpudeck.console.ops.context import Ops
from gpudeck.console.ops.figures import RunFigures, run_figures
from gpudeck.console.ops.readings import find_runs
from gpudeck.console.present.formats import format_history, format_show
from gpudeck.console.present.rundiff import diff_runs
from gpudeck.console.present.views import run_diff, run_row_from_history
from gpudeck.console.tui.app import GpudeckApp
from gpudeck.console.tui.screens.diff import DiffScreen
from gpudeck.console.tui.screens.history import HistoryScreen, history_cells
from gpudeck.console.tui.screens.runs import run_cells
from gpudeck.console.tui.widgets.keyed_table import KeyedTable
from tests.functional.fixture_fleet import FixtureFleet, history_events
from tests.functional.helpers import mounted, press_for, until

T0 = 1_790_000_000.0
RID, OTHER, OOM = "r-f1900001", "r-f1900002", "r-f1900003"
FIGURES = ("tokens/s", "step", "peak GiB", "elapsed", "cause class")


def _run(rid: str, state: str = "succeeded", cause: str = "exit code 0", started: float = T0 + 1, ended: float = T0 + 3601) -> RunInfo:
    return RunInfo(
        id=rid,
        host="gpu1",
        state=state,  # type: ignore[arg-type]
        spec=LaunchSpec(argv=["python3", "-m", "gpudeck.trainers.fsdp_lm", "--fresh"], kind="fsdp"),
        name="fig",
        created=started - 1,
        started=started,
        ended=ended,
        cause=cause,
        exit_code=0 if state == "succeeded" else 1,
    )


def _step(s: int, tps: float, peak: float = 40.0, t0: float = T0) -> tuple[float, str, dict]:
    return (
        t0 + 10 + s,
        "telemetry",
        {"record": {"type": "step", "rank": 0, "step": s, "loss": 2.0, "tokens_per_s": tps, "mem_peak_gib": peak}},
    )


def fill(h: History, seq0: int = 1) -> None:
    """The three runs, on gpu1 (epoch ``e``), from ``seq0`` on."""
    extra = [_step(10, 100.0), _step(50, 300.0, 61.2), _step(90, 250.0), _step(98, 900.0)]
    extra.append((T0 + 3000, "telemetry", {"record": {"type": "done", "final_step": 100}}))
    oom = _run(OOM, "failed", "exit code 1 (CUDA out of memory)", T0 + 5000, T0 + 5120)
    events = history_events(_run(RID), seq0, None, extra) + history_events(_run(OTHER), seq0 + 100)
    events += history_events(oom, seq0 + 200, None, [_step(5, 1000.0, 79.5, T0 + 5000), _step(7, 1200.0, 79.9, T0 + 5000)])
    h.submit("gpu1", "e", events).result(30)


@pytest.fixture
def history(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = History(tmp_path / "history.db")
    h.cursor("gpu1", "e")
    fill(h)
    yield h
    h.close()


def test_every_view_shows_the_same_figures(history: History) -> None:
    row = history.find(RID)
    metrics = history.metrics("gpu1", RID)
    fig = run_figures(row, metrics)
    assert (fig.tokens_per_s, fig.last_step, fig.peak_mem_gib, fig.elapsed_s) == (275.0, 100, 61.2, 3600.0)  # not the last 900, not step 98
    # the CLI's show
    show = format_show(row, [], fig)
    assert (
        re.search(r"tokens/s median\s+275\b", show)
        and re.search(r"last step\s+100\b", show)
        and "61.20 GiB" in show
        and re.search(r"elapsed\s+1h00m", show)
    )
    # the CLI's history listing (the history's rows carry the median)
    listing = format_history(history.query(f"id:{RID}"))
    assert " 275 " in listing and " 100 " in listing and "1h00m" in listing and " 900 " not in listing
    # the CLI's diff and the Diff screen's diff (the screen reads the metrics too)
    other = history.find(OTHER)
    for d in (diff_runs(row, other, metrics, []), run_diff(row, other, metrics, [])):
        out = {r.key: r.a for r in d.outcome}
        assert (
            out["tokens/s (median)"] == "275"
            and out["last step"] == "100"
            and out["peak memory GiB"] == "61.2"
            and out["elapsed"] == "1h00m"
        )
        assert out["cause class"] == (fig.cause_class or "-")
    # the History screen's row
    cells = history_cells(next(r for r in find_runs(history.path, "") if r.id == RID))
    assert (cells["tps"], cells["step"], cells["elapsed"]) == ("275", "100", "1h00m")
    # the Runs screen's row of the ended run, from the same history read (it showed the last 900 and step 98)
    runs = run_cells(run_row_from_history(next(r for r in find_runs(history.path, "") if r.id == RID)))
    assert (str(runs["tps"]).strip(), runs["step"]) == ("275", "100"), runs


# ----------------------------------------------------------------------------- every view, as printed and as shown


def _num(text: str) -> float | str:
    """A figure as a view writes it, as a value: '1,100' -> 1100.0, '61.20 GiB' -> 61.2, '1h00m' stays text."""
    t = text.strip().removesuffix("GiB").strip().replace(",", "")
    try:
        return round(float(t), 2)
    except ValueError:
        return t


def _expected(fig: RunFigures) -> dict[str, float | str]:
    return {
        "tokens/s": _num(f"{fig.tokens_per_s:,.0f}") if fig.tokens_per_s is not None else "-",
        "step": float(fig.last_step) if fig.last_step is not None else "-",
        "peak GiB": round(fig.peak_mem_gib, 2) if fig.peak_mem_gib is not None else "-",
        "elapsed": duration(fig.elapsed_s) if fig.elapsed_s is not None else "-",
        "cause class": fig.cause_class or "-",
    }


def _cli(home: Path, *argv: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("GPUDECK_HOME", str(home))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(list(argv)) == 0, argv
    return buf.getvalue()


def _columns(table: str, row_id: str) -> dict[str, str]:
    """A CLI table's row, by header (the columns are left-aligned under their headers)."""
    head, *rows = table.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", head)]
    names = head.split()
    line = next(r for r in rows if r.startswith(row_id))
    return {n: line[a:b].strip() for n, a, b in zip(names, starts, [*starts[1:], None])}


LABELS = {
    "tokens/s": "tokens/s (median)",
    "step": "last step",
    "peak GiB": "peak memory GiB",
    "elapsed": "elapsed",
    "cause class": "cause class",
}


def _cli_figures(home: Path, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], dict[str, float | str]]:
    """What `gpudeck show`, `history` and `diff` print for the two runs (the real command line on the history file)."""
    seen: dict[tuple[str, str], dict[str, float | str]] = {}
    for rid in (RID, OOM):
        show = _cli(home, "show", rid, "--no-sync", monkeypatch=monkeypatch)

        def field(label: str, text: str = show) -> str:
            m = re.search(rf"^  {re.escape(label)}\s+(.+)$", text, re.M)
            return m.group(1) if m else "-"

        seen[("CLI show", rid)] = {
            "tokens/s": _num(field("tokens/s median")),
            "step": _num(field("last step")),
            "peak GiB": _num(field("peak memory")),
            "elapsed": field("elapsed"),
            "cause class": field("cause class"),
        }
        cols = _columns(_cli(home, "history", "--no-sync", f"id:{rid}", monkeypatch=monkeypatch), rid)
        seen[("CLI history", rid)] = {"tokens/s": _num(cols["TOK/S"]), "step": _num(cols["STEP"]), "elapsed": cols["ELAPSED"]}
    diff = _cli(home, "diff", RID, OOM, "--all", "--no-sync", monkeypatch=monkeypatch)
    for name, label in LABELS.items():
        line = next(ln for ln in diff.splitlines() if re.match(rf"^[* ] {re.escape(label)}\s{{2}}", ln))
        a, b = re.split(r"\s{2,}", line[2:].strip())[1:3]
        seen.setdefault(("CLI diff", RID), {})[name] = _num(a)
        seen.setdefault(("CLI diff", OOM), {})[name] = _num(b)

    return seen


async def test_the_cli_the_diff_screen_and_the_history_screen_show_the_same_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = FixtureFleet(tmp_path / "history.db")
    assert fleet.history is not None
    fill(fleet.history, seq0=1000)  # after the fixture's own runs on gpu1
    want = {rid: _expected(run_figures(fleet.history.find(rid), fleet.history.metrics("gpu1", rid))) for rid in (RID, OOM)}
    assert want[RID]["tokens/s"] == 275.0 and want[RID]["step"] == 100.0 and want[RID]["peak GiB"] == 61.2
    assert want[OOM]["cause class"] == "oom" and want[OOM]["tokens/s"] == 1100.0 and want[OOM]["elapsed"] == "2m00s"
    # the CLI: show, history, diff (in a thread: the command line runs its own event loop)
    seen = await asyncio.to_thread(_cli_figures, tmp_path, monkeypatch)

    # the console: the History screen's rows, then the Diff screen of the two runs marked there
    app = GpudeckApp(Ops.console(fleet))
    async with app.run_test(size=(200, 50)) as pilot:
        screen = await press_for(pilot, "h", HistoryScreen)
        table = screen.query_one("#history-table", KeyedTable)
        screen.query_one("#history-filter").value = "name:fig"  # type: ignore[attr-defined]
        await pilot.press("slash", "enter")
        await until(lambda: sorted(table.keys()) == [f"gpu1/{r}" for r in (RID, OTHER, OOM)], what="the three runs named fig")
        for rid in (RID, OOM):
            cell = lambda col, rid=rid: str(table.get_cell(f"gpu1/{rid}", col))
            seen[("History screen", rid)] = {"tokens/s": _num(cell("tps")), "step": _num(cell("step")), "elapsed": cell("elapsed")}
        table.focus()
        table.move_cursor(row=table.get_row_index(f"gpu1/{RID}"))
        await pilot.press("space")
        table.move_cursor(row=table.get_row_index(f"gpu1/{OOM}"))
        await pilot.press("space", "d")
        shown = await until(lambda: mounted(app, DiffScreen), what="the diff screen")
        rows = shown.query_one("#diff-table", KeyedTable)
        await until(lambda: "outcome:cause class" in rows.keys(), what="the diff's outcome")
        a_is_rid = shown.a.id == RID
        for name, label in LABELS.items():
            a, b = (str(rows.get_cell(f"outcome:{label}", c)) for c in ("a", "b"))
            seen.setdefault(("Diff screen", RID), {})[name] = _num(a if a_is_rid else b)
            seen.setdefault(("Diff screen", OOM), {})[name] = _num(b if a_is_rid else a)

    for (view, rid), got in seen.items():
        assert got == {k: want[rid][k] for k in got}, (view, rid)
    views = {v for v, _ in seen}
    assert views == {"CLI show", "CLI history", "CLI diff", "Diff screen", "History screen"}
    for name in FIGURES:  # every figure is compared in at least the CLI and one screen
        assert sum(name in got for (v, _), got in seen.items() if v.startswith("CLI")) >= 2
        assert any(name in got for (v, _), got in seen.items() if v.endswith("screen"))
