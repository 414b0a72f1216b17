"""Provides ``python -m gpudeck.agents serve|dial``: the agent's own entry point (no console needed on a host)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MODULE_PROG = "python -m gpudeck.agents"
COMMAND_PROG = "gpudeck agent"  # what `gpudeck agent serve|dial` (gpudeck.console.entry) passes


def build_parser(prog: str = MODULE_PROG) -> argparse.ArgumentParser:
    """``PROG serve|dial [--state-dir DIR]``: each command its own usage line (``gpudeck agent serve --help``)."""
    ap = argparse.ArgumentParser(prog=prog, description="gpudeck host agent")
    sub = ap.add_subparsers(dest="command", metavar="serve|dial", required=True)
    for name, help_text in (
        ("serve", "run the agent in the foreground until SIGTERM"),
        ("dial", "bridge stdin/stdout to the agent (what the console runs over SSH)"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--state-dir",
            type=Path,
            default=None,
            metavar="DIR",
            help="agent state folder (default: $GPUDECK_HOME/agent or the user state dir)",
        )
    return ap


def main(argv: list[str] | None = None, prog: str = MODULE_PROG) -> int:
    """Parse and dispatch; ``prog`` is how the usage lines name the command."""
    args = build_parser(prog).parse_args(argv)
    if args.command == "serve":
        from gpudeck.agents.server.daemon import serve

        return serve(args.state_dir)
    from gpudeck.agents.wire.dial import dial

    return dial(args.state_dir)


if __name__ == "__main__":
    sys.exit(main())
