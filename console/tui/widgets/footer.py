"""Provides DeckFooter: the footer every screen uses, rebuilt once per burst of binding changes (compat/footer.py says
why and how: it sets one of Footer's private fields)."""

from __future__ import annotations

from gpudeck.console.tui.compat.footer import CoalescedFooter


class DeckFooter(CoalescedFooter):
    """The footer every screen uses."""
