"""Provides the ``gpudeck`` command's entry point: the agent's own commands run without the console's packages.

A GPU host's agent-only install (``pip install ./gpudeck``, no Textual, no SSH client) still answers
``gpudeck agent serve`` and ``gpudeck agent dial`` (what the console runs over SSH) and ``gpudeck --version``;
everything else is the console's CLI (:mod:`gpudeck.console.cli.main`).
"""

from __future__ import annotations

import importlib.util
import os
import sys

EXIT_PIPE = 141  # stdout's reader went away (`| head`): 128 + SIGPIPE, what a shell reports for a Unix tool SIGPIPE ended
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
    missing = next((name for name in CONSOLE_PACKAGES if importlib.util.find_spec(name) is None), None)
    if missing is not None:  # looked up, not imported: a command imports only what it uses (console/cli/parser.py)
        what = " ".join(args[:2]) or "the console"
        print(
            f"gpudeck: `gpudeck {what}` needs the console's packages ({missing} is not installed): "
            "pip install './gpudeck[console]'. This install (the agent's) runs `gpudeck agent serve` and `gpudeck agent dial`.",
            file=sys.stderr,
        )
        return 2
    return console_main(args)


def console_main(args: list[str]) -> int:
    """A console command: parsed first, so ``--help`` and a usage error import nothing of the commands; then the
    command module (:mod:`gpudeck.console.cli.main`) runs it.

    A reader that goes away (``gpudeck runs --json | head``) ends the command quietly with EXIT_PIPE, as a Unix tool
    killed by SIGPIPE reports it in the shell; nothing more is written to stdout."""
    from gpudeck.console.cli.parser import parse

    try:
        parsed = parse(args)
        from gpudeck.console.cli.main import run

        rc = run(parsed)
        sys.stdout.flush()  # inside the try: what is still buffered meets the closed pipe here, not at interpreter exit
        return rc
    except BrokenPipeError:
        return stdout_gone()


if __name__ == "__main__":
    sys.exit(main())
