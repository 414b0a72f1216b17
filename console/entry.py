"""Provides the ``gpudeck`` command's entry point: the agent's own commands run without the console's packages.

A GPU host's agent-only install (``pip install ./gpudeck``, no Textual, no SSH client) still answers
``gpudeck agent serve`` and ``gpudeck agent dial`` (what the console runs over SSH) and ``gpudeck --version``;
everything else is the console's CLI (:mod:`gpudeck.console.cli.main`).
"""

from __future__ import annotations

import os
import sys

from gpudeck.console.core.exitcodes import EXIT_PIPE, EXIT_USAGE

# the packages the console and its CLI need beyond the agent's (pyproject.toml's [console] extra)
CONSOLE_PACKAGES = ("textual", "asyncssh", "sqlite_utils", "rich")


def stdout_gone() -> int:
    """The reader of stdout went away: point stdout at /dev/null (so the interpreter's last flush is silent); EXIT_PIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_PIPE


def main(argv: list[str] | None = None) -> int:
    """Run one gpudeck command."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["--version"]:
        from gpudeck.agents import __version__

        try:
            print(f"gpudeck {__version__}", flush=True)
        except BrokenPipeError:
            return stdout_gone()
        return 0
    if args[:2] in (["agent", "serve"], ["agent", "dial"]):
        from gpudeck.agents.__main__ import COMMAND_PROG
        from gpudeck.agents.__main__ import main as agent_main

        return agent_main(args[1:], prog=COMMAND_PROG)
    try:
        from gpudeck.console.cli.main import main as cli_main
    except ImportError as exc:
        if exc.name not in CONSOLE_PACKAGES:
            raise
        what = " ".join(args[:2]) or "the console"
        print(
            f"gpudeck: `gpudeck {what}` needs the console's packages ({exc.name} is not installed): "
            "pip install './gpudeck[console]'. This install (the agent's) runs `gpudeck agent serve` and `gpudeck agent dial`.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
