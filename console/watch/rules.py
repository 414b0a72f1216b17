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
    """An apprise URL as given, or RuleError (the URL's scheme is checked by apprise when it is first used)."""
    if not _URL.match(url):
        raise RuleError(
            f"[[notify]] number {rule}: {url[:40]!r}... is not a URL; write an apprise URL such as ntfy://host/topic or json://host:port/path"
        )
    return url


def compile_rules(rules: tuple[NotifyRule, ...]) -> list[Rule]:
    """The config's rules checked and compiled; RuleError on the first that cannot work."""
    out = []
    for i, r in enumerate(rules, 1):
        try:
            compile_query(r.match)  # compiled again for each event: since:/until: are relative to then
        except QueryError as exc:
            raise RuleError(f"[[notify]] number {i}: match {r.match!r}: {exc}") from None
        out.append(
            Rule(
                number=i,
                to=tuple(check_url(i, u) for u in r.to),
                on=frozenset(_word(i, w) for w in r.on),
                match=r.match,
            )
        )
    return out


def targets_for(conn: sqlite3.Connection, rules: list[Rule], word: str, host: str, run_id: str) -> list[tuple[str, int]]:
    """(target URL, rule number) for every target whose rule picks this event; a URL in several rules once (its first)."""
    out: dict[str, int] = {}
    for r in rules:
        if not r.picks(word):
            continue
        if r.match.strip():
            c = compile_query(r.match)
            row = conn.execute(f"SELECT 1 FROM runs WHERE host=? AND id=? AND ({c.where})", (host, run_id, *c.params)).fetchone()
            if row is None:
                continue
        for url in r.to:
            out.setdefault(url, r.number)
    return list(out.items())
