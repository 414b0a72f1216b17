"""Provides the ``gpudeck`` command's entry point: the agent's own commands run without the console's packages.

A GPU host's agent-only install (``pip install ./gpudeck``, no Textual, no SSH client) still answers every
``gpudeck agent ...`` command (serve, dial: what the console runs over SSH, status, stop: the agent's own main,
:mod:`gpudeck.agents.__main__`) and ``gpudeck --version``; everything else is the console's CLI
(:mod:`gpudeck.console.cli.main`).
"""

from __future__ import annotations

import sys

from gpudeck.agents.__main__ import COMMAND_PROG, stdout_gone
from gpudeck.agents.__main__ import main as agent_main

# the packages the console and its CLI need beyond the agent's (pyproject.toml's [console] extra)
CONSOLE_PACKAGES = ("textual", "asyncssh", "sqlite_utils", "rich")


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
    if args[:1] == ["agent"]:
        return agent_main(args[1:], prog=COMMAND_PROG)
    try:
        from gpudeck.console.cli.main import main as cli_main
    except ImportError as exc:
        if exc.name not in CONSOLE_PACKAGES:
            raise
        what = " ".join(args[:2]) or "the console"
        print(
            f"gpudeck: `gpudeck {what}` needs the console's packages ({exc.name} is not installed): "
            "pip install './gpudeck[console]'. This install (the agent's) runs `gpudeck agent serve|dial|status|stop`.",
            file=sys.stderr,
        )
        return 2
    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
