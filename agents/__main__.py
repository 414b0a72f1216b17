"""Provides ``python -m gpudeck.agents serve|dial``: the agent's own entry point (no console needed on a host)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Parse and dispatch."""
    ap = argparse.ArgumentParser(prog="python -m gpudeck.agents", description="gpudeck host agent")
    ap.add_argument("command", choices=["serve", "dial"])
    ap.add_argument("--state-dir", type=Path, default=None, help="agent state folder (default: $GPUDECK_HOME/agent or the user state dir)")
    args = ap.parse_args(argv)
    if args.command == "serve":
        from gpudeck.agents.server import serve

        return serve(args.state_dir)
    from gpudeck.agents.dial import dial

    return dial(args.state_dir)


if __name__ == "__main__":
    sys.exit(main())
