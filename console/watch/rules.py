"""Provides the notification rules: the ``[[notify]]`` tables checked, and the history events each one picks.

An event of the history is notifiable when it is a run reaching a state (``run_state``) or an alert (``alert``).
Its *on word* is the state (``failed``, ``lost``, ``succeeded``, ``stopped``, ``preflight_failed``, ``started``
for ``running``) or ``alert:KIND`` (``alert:rank_exited``, ...; ``alert`` alone is any alert). A rule picks an
event when its word is in the rule's ``on`` and the event's run matches the rule's ``match`` (the history filter
language of console/history/query.py, evaluated against the run's row in the history).
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from typing import Any

from gpudeck.console.core.config import NotifyRule
from gpudeck.console.history.query import QueryError, compile_query

STATE_WORDS = ("failed", "lost", "succeeded", "stopped", "preflight_failed", "started")
ALERT_KINDS = ("rank_exited", "heartbeat_lost", "gpu_idle", "throughput_drop", "claim_mismatch", "node_lost")
# the names people use for them (the words), mapped to the agent's alert kinds
ALERT_ALIASES = {
    "rank_died": "rank_exited",
    "hang": "heartbeat_lost",
    "stuck": "heartbeat_lost",
    "idle": "gpu_idle",
    "slow": "throughput_drop",
}
_URL = re.compile(r"^[a-z][a-z0-9+.-]{0,31}://\S{1,2000}$")
# a rule's `match` is evaluated by SQLite for every event the rule's `on` picks. SQLite refuses an expression tree
# deeper than 1000 ("Expression tree is too large"), and each comparison of the filter (a word, a comma alternative)
# deepens it by about one: these bounds keep every rule well inside it (and its evaluation cheap)
MAX_MATCH_CHARS = 4096
MAX_MATCH_COMPARISONS = 256
# what SQLite answers for a statement it cannot take (a tree too deep, too many variables, a missing column): the
# rule's fault. Busy, locked, I/O or corruption are the history's: the event is read again, no rule is blamed
_RULE_FAULTS = {sqlite3.SQLITE_ERROR, sqlite3.SQLITE_TOOBIG}


class RuleError(Exception):
    """A ``[[notify]]`` rule that cannot work; the message says which and how to write it."""


@dataclass(frozen=True)
class Rule:
    """A checked rule: its targets, its on words (aliases resolved) and its compiled filter."""

    number: int  # 1-based, as in the file
    to: tuple[str, ...]
    on: frozenset[str]
    match: str

    def picks(self, word: str) -> bool:
        """Whether the rule sends events with this on word."""
        return word in self.on or (word.startswith("alert:") and "alert" in self.on)


def on_word(kind: str, data: dict[str, Any]) -> str | None:
    """The on word of a history event (its kind and decoded data), or None when no rule can pick it."""
    if kind == "run_state":
        state = data.get("state")
        if state == "running":
            return "started"
        return state if isinstance(state, str) and state in STATE_WORDS else None
    if kind == "alert":
        alert = data.get("alert", data)
        k = alert.get("kind") if isinstance(alert, dict) else None
        return f"alert:{k}" if isinstance(k, str) and k in ALERT_KINDS else None
    return None


def _word(rule: int, w: str) -> str:
    w = w.strip().lower()
    if w in STATE_WORDS or w == "alert":
        return w
    if w.startswith("alert:"):
        k = w.removeprefix("alert:")
        k = ALERT_ALIASES.get(k, k)
        if k in ALERT_KINDS:
            return f"alert:{k}"
        raise RuleError(
            f"[[notify]] number {rule}: unknown alert {w!r}; use alert:KIND with KIND one of {', '.join(ALERT_KINDS)}"
            f" (or {', '.join(ALERT_ALIASES)}), or `alert` for any"
        )
    raise RuleError(f"[[notify]] number {rule}: unknown event {w!r} in `on`; use {', '.join(STATE_WORDS)}, alert or alert:KIND")


def check_url(rule: int, url: str) -> str:
    """An apprise URL as given, or RuleError (the URL's scheme is checked by apprise when it is first used).

    The error never quotes the URL: what is not a URL may still hold a token; it names the entry by its place."""
    if not _URL.match(url):
        what = "is empty" if not url.strip() else f"({len(url)} characters) is not a URL"
        raise RuleError(
            f"[[notify]] number {rule}: a `to` entry {what}; write an apprise URL (at most 2000 characters after ://, no spaces)"
            " such as ntfy://host/topic or json://host:port/path"
        )
    return url


def check_match(rule: int, match: str) -> str:
    """A rule's ``match`` that SQLite can evaluate, or RuleError naming the bound it passes."""
    if len(match) > MAX_MATCH_CHARS:
        raise RuleError(
            f"[[notify]] number {rule}: `match` has {len(match)} characters, at most {MAX_MATCH_CHARS}: split the rule in several rules"
        )
    try:
        c = compile_query(match)  # compiled again for each event: since:/until: are relative to then
    except QueryError as exc:
        raise RuleError(f"[[notify]] number {rule}: match {match[:200]!r}: {exc}") from None
    n = comparisons(c.where)
    if n > MAX_MATCH_COMPARISONS:
        raise RuleError(
            f"[[notify]] number {rule}: `match` makes {n} comparisons, at most {MAX_MATCH_COMPARISONS} (SQLite evaluates it and refuses"
            " deeper filters): split the rule in several rules, or match a common part (name:~prefix) instead of listing names"
        )
    return match


def comparisons(where: str) -> int:
    """How many comparisons a compiled filter makes (each deepens the expression SQLite evaluates by about one)."""
    return where.count(" AND ") + where.count(" OR ") + 1


def compile_rules(rules: tuple[NotifyRule, ...]) -> list[Rule]:
    """The config's rules checked and compiled; RuleError on the first that cannot work."""
    out = []
    for i, r in enumerate(rules, 1):
        out.append(
            Rule(
                number=i,
                to=tuple(check_url(i, u) for u in r.to),
                on=frozenset(_word(i, w) for w in r.on),
                match=check_match(i, r.match),
            )
        )
    return out


def _where(r: Rule) -> tuple[str, list[object]]:
    c = compile_query(r.match)
    return c.where, c.params


def unusable(conn: sqlite3.Connection, rules: list[Rule]) -> dict[int, str]:
    """The rules this history's SQLite cannot evaluate (rule number -> why); sqlite3.Error when the history itself cannot be read."""
    conn.execute("SELECT 1 FROM runs LIMIT 0").fetchall()
    out = {}
    for r in rules:
        if not r.match.strip():
            continue
        where, params = _where(r)
        try:
            conn.execute(f"SELECT 1 FROM runs WHERE 0 AND ({where})", params).fetchall()
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorcode", sqlite3.SQLITE_ERROR) not in _RULE_FAULTS:
                raise
            out[r.number] = f"SQLite cannot evaluate its `match` ({exc})"
    return out


def targets_for(
    conn: sqlite3.Connection, rules: list[Rule], word: str, host: str, run_id: str, broken: dict[int, str] | None = None
) -> list[tuple[str, int]]:
    """(target URL, rule number) for every target whose rule picks this event; a URL in several rules once (its first).

    A rule SQLite cannot evaluate is added to ``broken`` (number -> why) and skipped from then on: the other rules go
    on. An error of the history itself (locked, unreadable) is raised: the event is read again later."""
    broken = {} if broken is None else broken
    out: dict[str, int] = {}
    for r in rules:
        if not r.picks(word) or r.number in broken:
            continue
        if r.match.strip():
            where, params = _where(r)
            try:
                row = conn.execute(f"SELECT 1 FROM runs WHERE host=? AND id=? AND ({where})", (host, run_id, *params)).fetchone()
            except sqlite3.Error:
                bad = unusable(conn, [r])  # raises when the history cannot be read at all
                if not bad:
                    raise
                broken.update(bad)
                continue
            if row is None:
                continue
        for url in r.to:
            out.setdefault(url, r.number)
    return list(out.items())
