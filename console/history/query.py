"""Provides the history filter language, compiled to parameterised SQL over the ``runs`` table.

A query is words: typed as text (the console's ``/`` filter) they are separated by spaces, shell-style (quote a
value that holds spaces); from the command line each shell argument is one word as it is (:func:`compile_terms`),
so ``gpudeck history 'cause:~exit code'`` is one term::

    state:failed host:gpu1 kind:dflash since:7d name:~drafter cause:oom

- ``key:value`` matches exactly; ``key:~text`` matches a substring; ``key:a,b``
  matches either; ``-key:value`` excludes.
- keys: ``state`` (also ``live`` / ``ended``), ``host``, ``kind``, ``name``,
  ``id``, ``cause`` (a cause class such as ``oom``, ``nccl_timeout``,
  ``host_oom``, ``signal``, ``rank_died``, ``preflight``, ``operator``,
  ``lost``; any other text is searched in the cause), ``operator``,
  ``parent``, ``torch`` (version prefix), ``alert`` (alert kind, or ``any``),
  ``since`` / ``until`` (``30m``, ``6h``, ``7d``, ``2w``, or a date
  ``2026-11-30`` / ``2026-11-30T14:00``), ``limit``.
- a bare word matches a run id prefix or a substring of the name.

Values only ever travel as SQL parameters: a quote in a name cannot change the
query. Results are sorted newest first.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import get_args

from gpudeck.agents.wire.protocol import RunState
from gpudeck.console.core.query_words import KEYS

# column each plain key compares against (never interpolated from user input)
_COLUMNS = {"state": "state", "host": "host", "kind": "kind", "name": "name", "id": "id", "operator": "operator", "parent": "parent"}
_META_STATES = {
    "live": ("pending", "starting", "running", "stopping"),
    "ended": ("preflight_failed", "succeeded", "failed", "stopped", "lost"),
}
STATES = get_args(RunState)  # what state:VALUE may name (and live / ended)
_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DEFAULT_LIMIT = 200


class QueryError(Exception):
    """A query the language does not understand; the message shows the right form."""


@dataclass
class Compiled:
    """A WHERE clause with its parameters, and the row limit."""

    where: str
    params: list[object] = field(default_factory=list)
    limit: int = DEFAULT_LIMIT

    def sql(self, columns: str = "*") -> tuple[str, list[object]]:
        """The full SELECT over ``runs``, newest first."""
        return (
            f"SELECT {columns} FROM runs WHERE {self.where} ORDER BY COALESCE(started, created) DESC, id LIMIT ?",
            [*self.params, self.limit],
        )


def parse_time(value: str, now: float | None = None) -> float:
    """``7d`` (ago) or an ISO date/time (local time) as unix seconds."""
    now = time.time() if now is None else now
    m = _SPAN.match(value)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise QueryError(f"{value!r} is not a time: write 30m, 6h, 7d, 2w or a date like 2026-11-30 / 2026-11-30T14:00") from None


def _like(text: str) -> str:
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _term(key: str, value: str, now: float) -> tuple[str, list[object]]:
    alts = [v for v in value.split(",") if v != ""] if not value.startswith("~") else [value]
    if not alts:
        raise QueryError(f"{key}: needs a value, e.g. {key}:x")
    parts: list[str] = []
    params: list[object] = []
    for v in alts:
        sub = v.startswith("~")
        text = v[1:] if sub else v
        if key in ("since", "until"):
            parts.append("COALESCE(started, created) >= ?" if key == "since" else "COALESCE(started, created) <= ?")
            params.append(parse_time(text, now))
        elif key == "state" and not sub and text not in _META_STATES and text not in STATES:
            raise QueryError(f"state:{text}: not a state: use one of {', '.join(STATES)}, or live / ended (state:~text for a substring)")
        elif key == "state" and not sub and text in _META_STATES:
            states = _META_STATES[text]
            parts.append(f"state IN ({','.join('?' * len(states))})")
            params.extend(states)
        elif key == "cause":
            if sub:
                parts.append("cause LIKE ? ESCAPE '\\'")
                params.append(_like(text))
            else:
                parts.append("(cause_class = ? OR cause LIKE ? ESCAPE '\\')")
                params.extend([text, _like(text)])
        elif key == "torch":
            parts.append("env_torch LIKE ? ESCAPE '\\'")
            params.append(("%" if sub else "") + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%")
        elif key == "alert":
            if text == "any":
                parts.append("alert_count > 0")
            else:
                parts.append("alerts LIKE ? ESCAPE '\\'")
                params.append(_like(f'"kind":"{text}"'))
        elif key == "id" and not sub:
            parts.append("id LIKE ? ESCAPE '\\'")
            params.append(text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%")
        else:
            col = _COLUMNS[key]
            if sub:
                parts.append(f"{col} LIKE ? ESCAPE '\\'")
                params.append(_like(text))
            else:
                parts.append(f"{col} = ?")
                params.append(text)
    return "(" + " OR ".join(parts) + ")", params


def compile_query(text: str, now: float | None = None) -> Compiled:
    """Compile a filter typed as text (words split shell-style) into SQL; QueryError says what is wrong and how to write it."""
    try:
        words = shlex.split(text or "")
    except ValueError as exc:
        raise QueryError(f"cannot read the query ({exc}): close the quote") from None
    return compile_terms(words, now)


def compile_terms(words: Sequence[str], now: float | None = None) -> Compiled:
    """Compile a filter given as its words, each one term as it is (the CLI's arguments), into SQL."""
    now = time.time() if now is None else now
    clauses: list[str] = []
    params: list[object] = []
    limit = DEFAULT_LIMIT
    for w in words:
        neg = w.startswith("-") and ":" in w
        body = w[1:] if neg else w
        if ":" not in body:
            clauses.append("(id LIKE ? ESCAPE '\\' OR name LIKE ? ESCAPE '\\')")
            params.extend([body.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%", _like(body)])
            continue
        key, value = body.split(":", 1)
        key = key.lower()
        if key not in KEYS:
            raise QueryError(f"unknown filter {key!r}: use one of {', '.join(KEYS)} (e.g. state:failed host:gpu1 since:7d)")
        if key == "limit":
            if not value.isdigit() or int(value) < 1:
                raise QueryError(f"limit:{value}: give a positive number, e.g. limit:50")
            limit = int(value)
            continue
        clause, ps = _term(key, value, now)
        clauses.append(f"NOT COALESCE({clause}, 0)" if neg else clause)
        params.extend(ps)
    return Compiled(where=" AND ".join(clauses) if clauses else "1=1", params=params, limit=limit)
