"""Provides the exit codes of every ``gpudeck`` command, in one place (docs/cli.md, "Exit codes", is their table)."""

from __future__ import annotations

OK = 0
EXIT_ERROR = 1  # the operation was refused or failed (the message says what to do)
EXIT_USAGE = 2  # bad usage: nothing was done (a field, a reference matching several runs, the config)
EXIT_UNREACHABLE = 3  # a host the command needed did not answer: the answer is partial
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it
EXIT_PIPE = 141  # stdout's reader went away (`| head`): 128 + SIGPIPE, what a shell reports for a Unix tool SIGPIPE ended

# `gpudeck watch`'s words for the same two codes
EXIT_FAILING = EXIT_ERROR  # a notification target failed (--check) or is failing (--status)
EXIT_CONFIG = EXIT_USAGE  # the configuration is wrong
