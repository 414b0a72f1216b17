"""Provides the trainers' typed input errors: what a user can fix, printed as one line on stderr, exit code 2.

Stdlib only (the agent's pre-flight raises :class:`InputError` subclasses too, through
``checkpoint_trust``). A trainer's entry point (``runtime.run_main``) prints ``prog: message``
for these, without a traceback, records an ``error`` telemetry record and exits 2; anything
else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

__all__ = ["EXIT_BAD_INPUT", "ConfigLimitError", "DataPathError", "InputError"]

EXIT_BAD_INPUT = 2


class InputError(Exception):
    """A bad input (option, config, data, checkpoint) the user can fix; the message says how. Exit code 2."""


class ConfigLimitError(InputError):
    """A model or drafter config field out of its bounds, refused before anything is allocated."""

    def __init__(self, source: str, field: str, value: object, limit: str, fix: str | None = None) -> None:
        super().__init__(f"{source}: {field} = {value!r} is out of bounds ({limit}); {fix or f'fix {field} in the config'}")
        self.source = source
        self.field = field
        self.value = value


class DataPathError(InputError):
    """A data manifest naming a file outside the folder it describes."""
