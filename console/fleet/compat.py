"""Provides the only place the console touches asyncssh's private names (console/tui/compat/README.md lists them).

- ``SSHClientConfig._handlers`` and ``SSHConfig._set_bool``: asyncssh's ssh config reader ignores ``CheckHostIP``;
  :class:`CheckHostIPConfig` adds it to the reader's table of options, parsed as asyncssh parses its own yes/no
  options. Waits for asyncssh to read the option itself (2.24.1, the version tested, does not).
- the logger class's ``_debug_level``: asyncssh formats a log line for every packet a channel receives before its
  logger checks whether packet logging is on; :func:`packet_logging_on` reads that level so the console's hook can
  skip the formatting. Waits for asyncssh to check the level first.

tests/unit/test_asyncssh_compat.py fails when any of them moves.
"""

from __future__ import annotations

import asyncssh


class CheckHostIPConfig(asyncssh.config.SSHClientConfig):
    """asyncssh's ssh config reader, also reading ``CheckHostIP`` (yes/no)."""

    _handlers = {**asyncssh.config.SSHClientConfig._handlers, "checkhostip": ("CheckHostIP", asyncssh.config.SSHConfig._set_bool)}


def packet_logging_on() -> bool:
    """Whether asyncssh logs every packet (its debug level 3); True when the level cannot be read."""
    return getattr(type(asyncssh.logging.logger), "_debug_level", 3) >= 3
