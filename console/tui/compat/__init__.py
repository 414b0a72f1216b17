"""Provides the only place the console touches Textual's private names (asyncssh's: console/fleet/compat.py); README.md
here lists each one, with its guard test."""
