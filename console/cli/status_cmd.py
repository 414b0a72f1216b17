"""Provides ``gpudeck status --host H``: one host's snapshot, on a path that imports only what it runs.

:mod:`gpudeck.console.entry` runs a parsed ``status --host H`` (without ``--watch``) here rather than through the
whole command module (:mod:`gpudeck.console.cli.main`, every command's imports), and the printers (present/) are
imported while the far side starts its bridge, the longest wait of an SSH connect, instead of before connecting
(issue 30: ``status`` over SSH within 100 ms of ``ssh host true``). :func:`host_status` is also what
``cmd_status`` runs for ``--host``: one implementation, the same output, errors and exit codes either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from gpudeck.agents.wire.errors import AgentError
from gpudeck.console.cli.parser import DEFAULT_WATCH_S
from gpudeck.console.cli.waiting import enable as enable_progress
from gpudeck.console.cli.waiting import waiting
from gpudeck.console.core.exitcodes import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_UNREACHABLE, EXIT_USAGE
from gpudeck.console.core.sanitize import terminal_text

# the operations layer (asyncio, the fleet, the history), the config reader and the printers are imported where they
# are used: inside entry.py's collector_off when the `gpudeck` script runs this

if TYPE_CHECKING:
    from gpudeck.agents.wire.protocol import Snapshot
    from gpudeck.console.present.status import StatusFilter


def handles(args: argparse.Namespace) -> bool:
    """Whether ``args`` is a ``status --host H`` this module runs alone (``--watch`` and the -n/--count usage error go
    to the command module)."""
    return (
        getattr(args, "func", None) == "cmd_status"
        and bool(args.host)
        and not args.watch
        and args.count is None
        and args.interval == DEFAULT_WATCH_S
    )


def import_printers() -> None:
    """The modules that print a snapshot (present/): imported while the far side starts, or when they are used."""
    import gpudeck.console.present.status  # noqa: F401  (it imports present.formats)


async def host_status(args: argparse.Namespace) -> int:
    """``status --host H``: the host's snapshot now (filtered by --user/--run/--pid); exit 3 when it does not answer."""
    from gpudeck.console.core import config as cfg
    from gpudeck.console.ops.context import Ops

    try:
        known = args.host in cfg.load().names
        with waiting(f"connecting to {args.host}"):
            async with Ops.request([args.host], remember=known, meanwhile=import_printers) as ops:
                snap = await ops.snapshot(args.host)
    except AgentError as exc:  # the one host asked for did not answer (or not safely): nothing to show, exit 3
        if args.json:
            print(json.dumps({"unreachable": [{"host": args.host, "error": exc.message}]}))
        print(terminal_text(f"gpudeck: {exc.message}"), file=sys.stderr)
        return EXIT_UNREACHABLE
    from gpudeck.console.present.formats import format_status
    from gpudeck.console.present.status import StatusFilter, snapshot_json

    filt = StatusFilter(args.user, args.run, args.pid)
    snap = filt.apply(snap)
    print(json.dumps(snapshot_json(snap, args.show_secrets)) if args.json else terminal_text(format_status(snap, args.host)))
    return nothing_matched(filt, [snap])


def nothing_matched(filt: StatusFilter, snaps: list[Snapshot]) -> int:
    """A filter that matched nothing on the hosts that answered: said on stderr; exit 1 for --run (a run reference that
    matches nothing), 0 for --user/--pid (nothing of theirs running is an answer)."""
    said = filt.nothing_matched(snaps)
    if said is None:
        return 0
    print(terminal_text(f"gpudeck: {said}"), file=sys.stderr)
    return EXIT_ERROR if filt.run is not None else 0


def run(args: argparse.Namespace) -> int:
    """Run ``status --host H`` as :func:`gpudeck.console.cli.main.run` runs a command: progress off for --json, and the
    errors a user can act on printed on stderr with their exit code. Run from the ``gpudeck`` script, it runs with the
    cyclic collector off (:func:`gpudeck.console.entry.collector_off`); the operations layer, asyncio and the config
    reader are imported here, inside that."""
    import asyncio

    from gpudeck.console.core import config as cfg
    from gpudeck.console.ops.errors import OpsError

    enable_progress(not args.json)  # --json is for scripts: nothing but the document
    try:
        return asyncio.run(host_status(args))
    except OpsError as exc:
        print(terminal_text(f"gpudeck: {exc.message}"), file=sys.stderr)
        return exc.exit_code
    except cfg.ConfigError as exc:
        print(terminal_text(f"gpudeck: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
