"""Provides the ``gpudeck`` command's entry point: the agent's own commands run without the console's packages.

A GPU host's agent-only install (``pip install ./gpudeck``, no Textual, no SSH client) still answers every
``gpudeck agent ...`` command (serve, dial: what the console runs over SSH, status, stop: the agent's own main,
:mod:`gpudeck.agents.__main__`) and ``gpudeck --version``; everything else is the console's CLI
(:mod:`gpudeck.console.cli.main`). Each branch imports only what it runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from gpudeck.console.core.exitcodes import EXIT_USAGE

# the packages the console and its CLI need beyond the agent's (pyproject.toml's [console] extra)
CONSOLE_PACKAGES = ("textual", "asyncssh", "sqlite_utils", "rich")


def stdout_gone() -> int:
    """The reader of stdout went away: the agent's own rule (:func:`gpudeck.agents.__main__.stdout_gone`), imported only then."""
    from gpudeck.agents.__main__ import stdout_gone as gone

    return gone()


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
    if args == ["agent", "dial"]:
        # what the console runs over SSH on every connect (its forced command): the bridge alone, without the agent's
        # argument parser and asyncio, whose imports the far side's start would otherwise pay each time (issue 30)
        with collector_off(argv is None):  # its imports' objects live until exit; the bridge's own are collected as usual
            from gpudeck.agents.wire.dial import dial

        return dial()
    if args[:1] == ["agent"]:
        from gpudeck.agents.__main__ import COMMAND_PROG
        from gpudeck.agents.__main__ import main as agent_main

        return agent_main(args[1:], prog=COMMAND_PROG)
    import importlib.util  # here, not above: the agent's commands (dial on every SSH connect) do not use it

    missing = next((name for name in CONSOLE_PACKAGES if importlib.util.find_spec(name) is None), None)
    if missing is not None:  # looked up, not imported: a command imports only what it uses (console/cli/parser.py)
        what = " ".join(args[:2]) or "the console"
        print(
            f"gpudeck: `gpudeck {what}` needs the console's packages ({missing} is not installed): "
            "pip install './gpudeck[console]'. This install (the agent's) runs `gpudeck agent serve|dial|status|stop`.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return console_main(args, own_process=argv is None)


@contextmanager
def collector_off(own_process: bool) -> Iterator[None]:
    """The cyclic garbage collector off for the block, and what the block made frozen at its end, when this command is
    the whole process (``own_process``: the ``gpudeck`` script's own call; not a caller's ``main(argv)``, a test's say).

    Nearly every object such a block makes (imports: modules, classes, functions) lives until the process exits, so
    the collector's passes during it, and the interpreter's own pass over all of them at exit (frozen objects are
    skipped), find nothing to free: for ``status --host H`` about 50 ms of its ~220 ms of CPU, for the far side's
    bridge about 5 ms (bench/RESULTS.md 28-sshspeed2). What the block opens it must close itself, as these do."""
    if not own_process:
        yield
        return
    import gc

    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def console_main(args: list[str], own_process: bool = False) -> int:
    """A console command: parsed first, so ``--help`` and a usage error import nothing of the commands; then the
    command module (:mod:`gpudeck.console.cli.main`) runs it.

    A reader that goes away (``gpudeck runs --json | head``) ends the command quietly with EXIT_PIPE, as a Unix tool
    killed by SIGPIPE reports it in the shell; nothing more is written to stdout."""
    from gpudeck.console.cli.parser import parse

    try:
        parsed = parse(args)
        from gpudeck.console.cli import status_cmd  # `status --host H`: its own path, without every command's imports (issue 30)

        if status_cmd.handles(parsed):
            with collector_off(own_process):  # a short command: see collector_off
                rc = status_cmd.run(parsed)
            sys.stdout.flush()
            return rc
        from gpudeck.console.cli.main import run

        rc = run(parsed)
        sys.stdout.flush()  # inside the try: what is still buffered meets the closed pipe here, not at interpreter exit
        return rc
    except BrokenPipeError:
        return stdout_gone()


if __name__ == "__main__":
    sys.exit(main())
