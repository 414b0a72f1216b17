"""Provides MessageGuard: a mixin whose subclass decides whether a NoMatches raised while handling a message is a bug.

Every message and event a Textual node handles passes through its private ``MessagePump._on_message``; there is no
public hook around all of them. A screen's queued message can still be handled after Escape took the screen off the
stack, when its widgets are gone: the mixin swallows a ``NoMatches`` then, and only then (``screen_gone``).
README.md here lists the name; tests/unit/test_textual_compat.py fails when it moves.
"""

from __future__ import annotations

from typing import Any

from textual.css.query import NoMatches


class MessageGuard:
    """Mixed in before a Textual node class: ``screen_gone`` says whether a NoMatches is the closed screen's."""

    def screen_gone(self) -> bool:
        """Whether the node's screen is gone (the subclass says)."""
        raise NotImplementedError

    async def _on_message(self, message: Any) -> None:
        try:
            await super()._on_message(message)  # type: ignore[misc]
        except NoMatches:
            if not self.screen_gone():
                raise
