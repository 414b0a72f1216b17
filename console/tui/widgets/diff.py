"""Provides the look of a run diff (console/present/rundiff.py's): differences highlighted, the ones that break known-good
setups (torch, CUDA, driver, NCCL) in red."""

from __future__ import annotations

import os

from rich.table import Table
from rich.text import Text

from gpudeck.console.core.sanitize import one_line
from gpudeck.console.present.rundiff import Row, RunDiff
from gpudeck.console.present.views import core_changes, diff_sections, row_label
from gpudeck.console.tui.widgets.cells import literal

LABEL_LIMIT = 80  # characters of a run's label (name and id) in a diff's headings
CORE_STYLE = "bold red"
DIFF_STYLE = "bold yellow"


def diff_marker(row: Row) -> Text:
    """● for a core difference, • for any other, blank when equal."""
    if not row.differs:
        return Text(" ")
    return Text("●", style=CORE_STYLE) if row.core else Text("•", style=DIFF_STYLE)


def from_difference(a: str, b: str, context: int = 16) -> tuple[str, str]:
    """Two long values that share a long beginning, shown from a little before where they differ ('…' marks the cut)."""
    same = len(os.path.commonprefix([a, b]))
    if a == b or same <= 2 * context:
        return a, b
    return "…" + a[same - context :], "…" + b[same - context :]


def diff_cells(section: str, row: Row, focus: bool = False) -> dict[str, object]:
    """One diff row as table cells; ``focus``: differing values start near where they differ (for one-line cells)."""
    style = (CORE_STYLE if row.core else DIFF_STYLE) if row.differs else "dim"
    a, b = from_difference(row.a, row.b) if focus else (row.a, row.b)
    return {
        "mark": diff_marker(row),
        "section": Text(section, style="dim"),
        "key": Text(row_label(row) if section == "environment" else row.key, style="bold" if row.core else ""),
        "a": Text(a, style=style),
        "b": Text(b, style=style),
    }


def diff_rows(diff: RunDiff, only_differences: bool = False, focus: bool = False) -> dict[str, dict[str, object]]:
    """Every row of the diff as cells, keyed ``section:key``, in reading order."""
    return {
        f"{section}:{r.key}": diff_cells(section, r, focus)
        for section, rows in diff_sections(diff)
        for r in rows
        if r.differs or not only_differences
    }


def diff_table(diff: RunDiff, a_label: str, b_label: str, only_differences: bool = False, limit: int | None = None) -> Table:
    """A rich table of the diff (for dialogs); ``only_differences`` keeps the rows that differ."""
    t = Table(show_header=True, header_style="bold", box=None, expand=True, pad_edge=False)
    t.add_column("", width=1)
    t.add_column("", style="dim", no_wrap=True)
    t.add_column("", no_wrap=True)
    t.add_column(Text(one_line(a_label, LABEL_LIMIT)), overflow="fold")  # run names: text, never markup, one row
    t.add_column(Text(one_line(b_label, LABEL_LIMIT)), overflow="fold")
    rows = list(diff_rows(diff, only_differences).values())
    for c in rows[:limit] if limit else rows:
        t.add_row(*(literal(c[k]) for k in ("mark", "section", "key", "a", "b")))  # type: ignore[arg-type]
    if limit and len(rows) > limit:
        t.add_row("", "", Text(f"... {len(rows) - limit} more", style="dim"), "", "")
    return t


def diff_summary(diff: RunDiff) -> Text:
    """One line: how many rows differ (as many as the table marks), the core ones by name, and why the environment could
    not be compared."""
    n = diff.differences  # configuration and environment: what decides whether a setup still works
    outcome = sum(r.differs for r in diff.outcome)
    core = core_changes(diff)
    # every row the table marks is counted (the outcome's too), and the count says which are which
    t = Text(f"{n + outcome} difference(s)", style="bold")
    if outcome:
        t.append(f" ({n} in configuration and environment, {outcome} in outcome)", style="bold")
    if core:
        t.append(f"; environment changes that matter: {', '.join(row_label(r) for r in core)}", style=CORE_STYLE)
    elif n and not diff.env_note.startswith("no environment"):
        t.append("; torch, CUDA, driver, NCCL, cuDNN and transformers are the same", style="green")
    elif not n:
        t.append(": the runs are configured alike", style="green")
    if diff.env_note:
        t.append(f"\n{diff.env_note}", style="yellow" if diff.env_note.startswith("no environment") else "dim")
    return t
