"""Provides the history query language's words: the keys it knows and its negation rule (``-key:value``).

Stdlib only: the CLI's parser reads it before argparse (a negated filter of ``gpudeck history`` must not be taken for
an unknown option) without importing the query compiler (console/history/query.py), which builds on it.
"""

from __future__ import annotations

KEYS = ("state", "host", "kind", "name", "id", "cause", "operator", "parent", "torch", "alert", "since", "until", "limit")


def is_negation(word: str) -> bool:
    """Whether a word is a negated filter of a known key (``-state:failed``): what the CLI takes as a query word, not an option."""
    key, sep, _ = word[1:].partition(":")
    return word.startswith("-") and bool(sep) and key.lower() in KEYS
