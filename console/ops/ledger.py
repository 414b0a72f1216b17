"""Provides the GPU ledger's questions over the replicated history: who held a GPU at a time, and a run's GPU footprint.

``gpudeck ledger HOST[:GPU] [--at TIME | --since TIME --until TIME] [--run RUN]`` and
the console's timelines ask through :func:`ledger_query` (the words checked, typed
errors for bad input) and :func:`ledger_answer` (the history's index read in one
call: ``console/history/ledger_index.py``). TIME is an ISO time (``2026-12-04T02:14``,
with or without a zone: without one it is this machine's local time), ``HH:MM`` (or
``HH:MM:SS``) today, a time ago (``-2h``, ``-30m``, ``-90s``, ``-1d``), or ``now``.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from gpudeck.console.core.exitcodes import EXIT_USAGE
from gpudeck.console.history.ledger_index import HoldRecord
from gpudeck.console.history.replica import History
from gpudeck.console.ops.errors import OpsError

__all__ = [
    "GpuFootprint",
    "HoldRecord",
    "LedgerAnswer",
    "LedgerQuery",
    "LedgerQueryError",
    "ledger_answer",
    "ledger_query",
    "parse_time",
    "run_footprint",
]

_AGO = re.compile(r"^-(\d+(?:\.\d+)?)([smhdw])$")
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
TIME_FORMS = "an ISO time (2026-12-04T02:14, zone optional), HH:MM today, a time ago (-2h, -30m, -1d) or now"
MAX_TEXT = 64  # a TIME or HOST[:GPU] longer than this is refused before it is read


class LedgerQueryError(OpsError):
    """A ledger question that cannot be asked as written: the message names the word and the forms it takes."""

    exit_code = EXIT_USAGE


def parse_time(text: str, now: float | None = None) -> float:
    """A TIME word as a unix time (see the module doc for its forms); LedgerQueryError names the word and the forms."""
    now = time.time() if now is None else now
    raw = text
    text = text.strip()
    if not text or len(text) > MAX_TEXT or not text.isprintable():
        raise LedgerQueryError(f"time {raw[:MAX_TEXT]!r} is not a time: give {TIME_FORMS}")
    if text == "now":
        return now
    m = _AGO.match(text)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    m = _CLOCK.match(text)
    if m:
        h, mi, s = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
        if h > 23 or mi > 59 or s > 59:
            raise LedgerQueryError(f"time {text!r} is not a time of day (HH:MM, 00:00 to 23:59)")
        today = dt.datetime.fromtimestamp(now).replace(hour=h, minute=mi, second=s, microsecond=0)
        return today.timestamp()
    try:
        parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise LedgerQueryError(f"time {text!r} is not a time: give {TIME_FORMS}") from None
    try:
        return parsed.timestamp()  # naive: this machine's local time
    except (OverflowError, OSError, ValueError):
        raise LedgerQueryError(f"time {text!r} is out of range") from None


def parse_target(text: str) -> tuple[str, int | None]:
    """``HOST`` or ``HOST:GPU`` as (host, GPU index or None); LedgerQueryError for anything else."""
    if not text or len(text) > 255 or not text.isprintable() or any(c.isspace() for c in text):
        raise LedgerQueryError(f"{text[:MAX_TEXT]!r} is not HOST or HOST:GPU (e.g. gpu1 or gpu1:5)")
    host, sep, gpu = text.rpartition(":")
    if not sep:
        return text, None
    if not host or not gpu.isdigit() or len(gpu) > 4:
        raise LedgerQueryError(f"{text!r}: the GPU after ':' must be an index (e.g. {host or 'gpu1'}:5)")
    return host, int(gpu)


@dataclass(frozen=True)
class LedgerQuery:
    """One ledger question, checked: a host (and GPU), a moment or a window, and optionally a run."""

    host: str
    gpu: int | None
    mode: Literal["at", "between", "run"]
    at: float | None = None
    since: float | None = None
    until: float | None = None
    run: str | None = None


def ledger_query(
    target: str, at: str | None = None, since: str | None = None, until: str | None = None, run: str | None = None, now: float | None = None
) -> LedgerQuery:
    """The question the words ask; LedgerQueryError for a bad HOST[:GPU], TIME or combination."""
    now = time.time() if now is None else now
    host, gpu = parse_target(target)
    if at is not None and (since is not None or until is not None):
        raise LedgerQueryError("give --at TIME, or --since TIME [--until TIME], not both")
    if run is not None and (not run.strip() or len(run) > 256 or not run.isprintable()):
        raise LedgerQueryError(f"--run {run[:MAX_TEXT]!r} is not a run id, id prefix or name")
    if since is not None or until is not None:
        s = parse_time(since, now) if since is not None else 0.0
        u = parse_time(until, now) if until is not None else now
        if s > u:
            raise LedgerQueryError(f"--since ({since}) is after --until ({until or 'now'}): swap them")
        return LedgerQuery(host=host, gpu=gpu, mode="between", since=s, until=u, run=run)
    if run is not None and at is None:
        return LedgerQuery(host=host, gpu=gpu, mode="run", run=run)
    return LedgerQuery(host=host, gpu=gpu, mode="at", at=parse_time(at, now) if at is not None else now, run=run)


@dataclass(frozen=True)
class GpuFootprint:
    """A run on one GPU over its life: when it first and last held it, for how long, its peak, by which processes."""

    host: str
    gpu: int
    uuid: str | None
    first: float
    last: float | None  # None: still held (no end recorded)
    held_s: float  # the union of its holds' spans (a GPU held by two ranks at once counts once)
    peak: int | None
    pids: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class LedgerAnswer:
    """What the history says: the holds asked about and, for a run, its footprint per GPU."""

    query: LedgerQuery
    holds: list[HoldRecord]
    run_id: str | None = None
    footprint: list[GpuFootprint] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The answer as plain data (``ledger --json``)."""
        out: dict[str, Any] = {
            "host": self.query.host,
            "gpu": self.query.gpu,
            "mode": self.query.mode,
            "holds": msgspec.to_builtins(self.holds),
        }
        for k in ("at", "since", "until"):
            v = getattr(self.query, k)
            if v is not None:
                out[k] = v
        if self.run_id is not None:
            out["run"] = self.run_id
            out["footprint"] = [vars(f) for f in self.footprint]
        return out


def run_footprint(holds: list[HoldRecord], now: float) -> list[GpuFootprint]:
    """A run's holds as its footprint per (host, GPU): the first and last time it held it, the union of the spans."""
    by_gpu: dict[tuple[str, int], list[HoldRecord]] = {}
    for h in holds:
        by_gpu.setdefault((h.host, h.gpu), []).append(h)
    out: list[GpuFootprint] = []
    for (host, gpu), hs in sorted(by_gpu.items()):
        spans = sorted((h.started, h.ended if h.ended is not None else now) for h in hs)
        total, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
        for s, e in spans[1:]:
            if s > cur_e:
                total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        total += cur_e - cur_s
        open_ = any(h.ended is None for h in hs)
        peaks = [h.peak for h in hs if h.peak is not None]
        out.append(
            GpuFootprint(
                host=host,
                gpu=gpu,
                uuid=hs[0].uuid,
                first=spans[0][0],
                last=None if open_ else max(h.ended or 0.0 for h in hs),
                held_s=total,
                peak=max(peaks) if peaks else None,
                pids=sorted({h.pid for h in hs if h.pid is not None}),
                ranks=sorted({h.rank for h in hs if h.rank is not None}),
            )
        )
    return out


def _run_id(history: History, q: LedgerQuery) -> str:
    """The run --run names, by the history's rules (id, unique prefix, unique name) on that host."""
    assert q.run is not None
    return history.find(q.run, q.host).id  # AmbiguousRun / NoSuchRun (OpsErrors) say what to give


def ledger_answer(history: History, q: LedgerQuery, now: float | None = None) -> LedgerAnswer:
    """The history's answer to ``q`` (blocking: call it in a thread); an OpsError when --run names no run, or several."""
    now = time.time() if now is None else now
    run_id = _run_id(history, q) if q.run is not None else None
    if q.mode == "at":
        assert q.at is not None
        holds = history.ledger_at(q.host, q.gpu, q.at, run_id)
    elif q.mode == "between":
        assert q.since is not None and q.until is not None
        holds = history.ledger_between(q.host, q.gpu, q.since, q.until, run_id)
    else:
        assert run_id is not None
        holds = [h for h in history.ledger_of_run(q.host, run_id) if q.gpu is None or h.gpu == q.gpu]
    footprint = run_footprint(holds, now) if run_id is not None and holds else []
    return LedgerAnswer(query=q, holds=holds, run_id=run_id, footprint=footprint)
