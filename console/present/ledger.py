"""Provides the GPU ledger's text views: who held a GPU at a time, the holds over a window as a timeline, a run's footprint.

Both front-ends render these (``gpudeck ledger`` prints them; the console can show
the same lines); every value from the history is escaped by the caller's
``terminal_text`` before it reaches a terminal.
"""

from __future__ import annotations

import time

from gpudeck.console.core.fmt import duration, gib, when
from gpudeck.console.ops.ledger import GpuFootprint, HoldRecord, LedgerAnswer

BAR = 40  # characters of a timeline bar


def _who(h: HoldRecord) -> str:
    if h.attribution == "UNACCOUNTED":
        return "(no visible process)"
    return f"pid {h.pid}" if h.pid is not None else "-"


def _run(h: HoldRecord) -> str:
    if not h.run_id:
        return "-"
    return h.run_id if h.rank is None else f"{h.run_id} (rank {h.rank})"


def _end(h: HoldRecord) -> str:
    if h.ended is None:
        return "still held"
    return when(h.ended) + (" (after an agent restart)" if h.last_seen is not None else "")


def _bar(start: float, end: float | None, lo: float, hi: float, now: float) -> str:
    """The part of [lo, hi] a span covers, as '#' over '.'."""
    span = max(hi - lo, 1e-9)
    e = now if end is None else end
    a = max(0, min(BAR, int((max(start, lo) - lo) / span * BAR)))
    b = max(a + 1, min(BAR, int(round((min(e, hi) - lo) / span * BAR))))
    return "." * a + "#" * (b - a) + "." * (BAR - b)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_ledger(ans: LedgerAnswer, now: float | None = None) -> str:
    """The human view of a ledger answer."""
    now = time.time() if now is None else now
    q = ans.query
    where = q.host if q.gpu is None else f"{q.host} GPU {q.gpu}"
    if ans.run_id is not None and q.mode == "run":
        return format_footprint(ans.run_id, where, ans.footprint, ans.holds, now)
    run = f", run {ans.run_id}" if ans.run_id else ""
    if q.mode == "at":
        head = f"GPU ledger of {where}{run} at {when(q.at)}: "
        if not ans.holds:
            return head + "nobody held memory (nothing recorded then; the ledger starts with the agent's first sample)"
        rows = [["GPU", "HOLDER", "USER", "CONTAINER", "RUN", "ATTRIBUTION", "HELD GiB", "PEAK GiB", "SINCE", "UNTIL"]]
        for h in ans.holds:
            rows.append(
                [
                    str(h.gpu),
                    _who(h),
                    h.user or "-",
                    h.container or "-",
                    _run(h),
                    h.attribution or "-",
                    gib(h.at_bytes),
                    gib(h.peak),
                    when(h.started),
                    _end(h),
                ]
            )
        return "\n".join([head + f"{len(ans.holds)} holder(s)", *_table(rows)])
    assert q.since is not None and q.until is not None
    head = f"GPU ledger of {where}{run} from {when(q.since)} to {when(q.until)}: "
    if not ans.holds:
        return head + "no holds recorded"
    rows = [["GPU", "HOLDER", "RUN", "ATTRIBUTION", "PEAK GiB", "FROM", "TO", f"|{'timeline':^{BAR - 2}}|"]]
    for h in ans.holds:
        rows.append(
            [
                str(h.gpu),
                _who(h),
                _run(h),
                h.attribution or "-",
                gib(h.peak),
                when(h.started),
                _end(h),
                _bar(h.started, h.ended, q.since, q.until, now),
            ]
        )
    return "\n".join([head + f"{len(ans.holds)} hold(s)", *_table(rows)])


def format_footprint(run_id: str, where: str, fp: list[GpuFootprint], holds: list[HoldRecord], now: float) -> str:
    """A run's GPU footprint over its life: each GPU it held, from when to when, for how long, its peak; the timeline."""
    if not fp:
        return f"run {run_id} on {where}: the ledger holds no GPU memory of it (it held none, or it ran before the ledger)"
    lo = min(f.first for f in fp)
    hi = max((f.last if f.last is not None else now) for f in fp)
    rows = [["GPU", "FROM", "TO", "HELD FOR", "PEAK GiB", "PIDS", "RANKS", f"|{'timeline':^{BAR - 2}}|"]]
    for f in fp:
        spans = [h for h in holds if h.host == f.host and h.gpu == f.gpu]
        bar = ["."] * BAR
        for h in spans:
            for i, c in enumerate(_bar(h.started, h.ended, lo, hi, now)):
                if c == "#":
                    bar[i] = "#"
        rows.append(
            [
                str(f.gpu),
                when(f.first),
                "still held" if f.last is None else when(f.last),
                duration(f.held_s),
                gib(f.peak),
                ",".join(map(str, f.pids[:8])) + (" ..." if len(f.pids) > 8 else "") or "-",
                ",".join(map(str, f.ranks)) or "-",
                "".join(bar),
            ]
        )
    return "\n".join([f"run {run_id} on {where}: {len(fp)} GPU(s) held over its life", *_table(rows)])
