"""Provides what the CLI and the console read from a host about a run or its leftovers, each read once: a run's claims
checked (verify), its step metrics (the agent's, else the history's), its output (and a multi-node run's, merged by
whole lines), a host's leftovers, and the history's runs as the Runs and History tables list them (light columns)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import LeftoverList, OutputChunk, RunInfo, VerifyReply
from gpudeck.console.core.records import RunRecord
from gpudeck.console.fleet.fleet import Fleet
from gpudeck.console.history.query import Compiled, QueryError, compile_query
from gpudeck.console.history.replica import History, add_tokens_median, read_runs
from gpudeck.console.ops.errors import OpsError, QueryRefused


async def verify_run(fleet: Fleet, host: str, run_id: str) -> VerifyReply:
    """A run's claims against what its agent observes (raises AgentError when the host does not answer)."""
    return await fleet.verify(host, run_id)


async def current_run(fleet: Fleet, host: str, run_id: str) -> RunInfo | RunRecord:
    """A run as its agent knows it now, else as the history recorded it (a record: the caller shapes it); raises
    :class:`OpsError` saying why neither could be read."""
    try:
        return await fleet.run(host, run_id)
    except AgentError as exc:
        why = exc.message
    if fleet.history is not None:
        try:
            return await asyncio.to_thread(fleet.history.find, run_id, host)
        except Exception as exc:  # not recorded, or the file cannot be read: say why
            why = f"{why}; history: {exc}"
    raise OpsError(why)


async def host_leftovers(fleet: Fleet, host: str, include_live: bool = False) -> LeftoverList:
    """A host's leftovers (stale and foreign GPU holders; members of live runs too with ``include_live``)."""
    return await fleet.leftovers(host, include_live=include_live)


def run_output(fleet: Fleet, host: str, run_id: str, offset: int = 0, follow: bool = True) -> AsyncIterator[OutputChunk]:
    """A run's output from a byte offset (negative: from the end), following it while the run lives when ``follow``."""
    return fleet.output(host, run_id, offset=offset, follow=follow)


@dataclass(frozen=True)
class StepSeries:
    """A run's step metrics, index-aligned (None where a step did not report the figure), and where they came from."""

    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)
    source: str = "agent"  # agent | history | none


async def run_metrics(fleet: Fleet, host: str, run_id: str, max_points: int = 200) -> StepSeries:
    """A run's step metrics from its agent; from the history when the agent cannot be asked (the host is down, or it
    no longer has the run)."""
    try:
        m = await fleet.metrics(host, run_id, max_points=max_points)
        return StepSeries(list(m.steps), list(m.loss), list(m.tokens_per_s))
    except AgentError:
        if fleet.history is None:
            return StepSeries(source="none")
    pts = await asyncio.to_thread(fleet.history.metrics, host, run_id)
    return StepSeries([p.step for p in pts], [p.loss for p in pts], [p.tokens_per_s for p in pts], source="history")


TAIL_WINDOW = 256 * 1024  # bytes read back from a run's output's end for its last lines


async def tail_nodes(fleet: Fleet, nodes: Sequence[tuple[str, str]], lines: int, follow: bool, emit: Callable[[str, str], None]) -> None:
    """The last ``lines`` lines (-1: all of the last :data:`TAIL_WINDOW` bytes) of each node's output, then, with
    ``follow``, what comes until the run ends: ``emit(host, text)`` gets whole lines only, so the nodes' lines never mix
    (the nodes one after another without ``follow``, all at once with it)."""

    async def one(host: str, run_id: str) -> None:
        window = await anext(run_output(fleet, host, run_id, offset=-TAIL_WINDOW, follow=False))
        last = window.data.splitlines(keepends=True)
        if lines >= 0:
            last = last[-lines:] if lines else []
        if last:
            emit(host, "".join(last))
        if not follow:
            return
        pending = ""
        async for chunk in run_output(fleet, host, run_id, offset=window.next_offset, follow=True):
            pending += chunk.data
            cut = pending.rfind("\n") + 1
            if cut:
                emit(host, pending[:cut])
                pending = pending[cut:]
        if pending:
            emit(host, pending + "\n")

    if follow:
        await asyncio.gather(*(one(h, rid) for h, rid in nodes))
    else:
        for h, rid in nodes:
            await one(h, rid)


def _compiled(text: str, when: float | None = None) -> Compiled:
    try:
        return compile_query(text, when)
    except QueryError as exc:
        raise QueryRefused(str(exc)) from exc


def query_history(history: History, terms: Sequence[str]) -> list[RunRecord]:
    """The runs ``terms`` select (each one filter term, never re-split), full rows, newest first: ``gpudeck history`` and
    ``runs --no-sync``. Blocking SQLite: call it from a thread. Raises :class:`QueryRefused` for a term the language does
    not understand."""
    try:
        return history.query(list(terms))
    except QueryError as exc:
        raise QueryRefused(str(exc)) from exc


# the columns the Runs and History tables need: never the environment (its freeze list is large)
LIGHT_COLUMNS = (
    "host, id, name, kind, state, cause, cause_class, created, started, ended, last_step, final_step, last_loss, tokens_per_s, mfu,"
    " mem_peak_gib, alert_count, alerts, env_torch, world_size, params_total, parent, start"
)


def find_runs(path: Path, text: str = "", *, when: float | None = None) -> list[RunRecord]:
    """Runs matching a history filter (console/history/query.py's language), newest first, light columns only.

    Blocking SQLite on a read-only connection of its own: call it from a thread.
    Raises :class:`~gpudeck.console.ops.errors.QueryRefused` for a filter the language does not understand.
    """
    sql, params = _compiled(text, when).sql(LIGHT_COLUMNS)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    try:
        return add_tokens_median(conn, read_runs(conn.execute(sql, params)))
    finally:
        conn.close()


def runs_changed_since(path: Path, text: str, after: int | None) -> tuple[list[RunRecord], int]:
    """``after`` None: the runs ``text`` matches (as :func:`find_runs`); else every run (each node of it) that an event
    newer than event ``after`` changed. With the newest event's number now, for the next call (the Runs screen reads
    the whole history once, then only what changed: 10,000 runs re-read every few seconds would cost a second of
    CPU each time). Events number by SQLite rowid, in the order the history stored them, whatever the hosts' clocks
    (runs change only through events, and events are never deleted).
    """
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    try:
        conn.execute("BEGIN")  # one snapshot: the mark and the rows agree
        mark = int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM events").fetchone()[0])
        if after is None:
            sql, params = _compiled(text).sql(LIGHT_COLUMNS)
        else:
            sql = (
                f"SELECT {LIGHT_COLUMNS} FROM runs WHERE id IN (SELECT run_id FROM events WHERE rowid > ? AND run_id IS NOT NULL)"
                " ORDER BY COALESCE(started, created) DESC, id"
            )
            params = [after]
        rows = add_tokens_median(conn, read_runs(conn.execute(sql, params)))
        conn.execute("COMMIT")
        return rows, mark
    finally:
        conn.close()


def history_run_count(path: Path) -> int:
    """How many runs the history holds (a multi-node run once, as the Runs screen lists it)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    try:
        return int(conn.execute("SELECT COUNT(DISTINCT id) FROM runs").fetchone()[0])
    finally:
        conn.close()
