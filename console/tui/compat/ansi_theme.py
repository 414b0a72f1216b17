"""Provides the light ANSI palette Textual uses (Alabaster), read from its private ``textual._ansi_theme``.

Textual exports no public name for the palettes it maps ANSI colours to; the light theme's is ``ALABASTER``.
README.md here lists it; tests/unit/test_textual_compat.py fails when it moves.
"""

from __future__ import annotations

from rich.terminal_theme import TerminalTheme
from textual._ansi_theme import ALABASTER

Rgb = tuple[int, int, int]


def light_ansi() -> tuple[Rgb, Rgb, list[Rgb]]:
    """Alabaster's background, foreground and 16 ANSI colours (8 normal, then 8 bright)."""
    theme: TerminalTheme = ALABASTER
    colors = [theme.ansi_colors[i] for i in range(16)]  # rich's Palette is indexable: no private list read
    bg, fg = theme.background_color, theme.foreground_color
    return (bg[0], bg[1], bg[2]), (fg[0], fg[1], fg[2]), [(c[0], c[1], c[2]) for c in colors]
