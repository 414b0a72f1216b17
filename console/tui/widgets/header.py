"""Provides AppHeader: the title bar of every screen, safe when its screen closes before the title is first drawn."""

from __future__ import annotations

from gpudeck.console.tui.compat.header import SafeTitleHeader


class AppHeader(SafeTitleHeader):
    """The title bar of every screen (the guard against a closed screen is compat/header.py's: it reaches into Header)."""
