"""Provides ``python -m gpudeck.agents serve|dial|status|stop``: the agent's own entry point (no console on a host).

An agent-only install (``pip install ./gpudeck``: no Textual, no SSH client, no sqlite-utils) runs every command the
agent's own messages name; ``gpudeck agent ...`` (gpudeck.console.entry) hands them here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

MODULE_PROG = "python -m gpudeck.agents"
COMMAND_PROG = "gpudeck agent"  # what `gpudeck agent ...` (gpudeck.console.entry) passes
EXIT_PIPE = 141  # stdout's reader went away (`| head`): 128 + SIGPIPE, what a shell reports for a Unix tool SIGPIPE ended
EXIT_NOT_RUNNING = 3  # `status`: no agent answers (`stop` of no agent is no error: 0)
EXIT_STOP_TIMEOUT = 2  # `stop`: the agent did not exit within STOP_WAIT_S (docs/cli.md's exit codes)
STOP_WAIT_S = 10.0
_COMMANDS = (
    ("serve", "run the agent in the foreground until SIGTERM"),
    ("dial", "bridge stdin/stdout to the agent (what the console runs over SSH)"),
    ("status", "is the agent running, and where (exit 3: not running)"),
    ("stop", "stop the agent (SIGTERM by its pid); runs keep going and the next agent re-adopts them"),
)


def build_parser(prog: str = MODULE_PROG) -> argparse.ArgumentParser:
    """``PROG serve|dial|status|stop [--state-dir DIR]``: each command its own usage line (``gpudeck agent status --help``)."""
    ap = argparse.ArgumentParser(prog=prog, description="gpudeck host agent")
    sub = ap.add_subparsers(dest="command", metavar="serve|dial|status|stop", required=True)
    for name, help_text in _COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--state-dir",
            type=Path,
            default=None,
            metavar="DIR",
            help="agent state folder (default: $GPUDECK_HOME/agent or the user state dir)",
        )
        if name == "status":
            p.add_argument("--json", action="store_true", help="one JSON object (running, pid, host, version, state_dir, ...)")
    return ap


def stdout_gone() -> int:
    """The reader of stdout went away: point stdout at /dev/null (so the interpreter's last flush is silent); EXIT_PIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_PIPE


def _shown(text: str) -> str:
    """Agent-reported text (paths, the journal's story) with every unprintable character escaped for a terminal."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


async def _hello(state_dir: Path | None):  # -> HelloReply, or the AgentError saying why none
    from gpudeck.agents.wire.client import AgentClient

    c = await AgentClient.connect_unix(autostart=False, state_dir=state_dir)
    try:
        assert c.hello is not None
        return c.hello
    finally:
        await c.close()


def status(state_dir: Path | None, as_json: bool) -> int:
    """``agent status``: the running agent's identity, or "not running" and EXIT_NOT_RUNNING."""
    import msgspec

    from gpudeck.agents.wire import paths
    from gpudeck.agents.wire.errors import AgentError

    try:
        h = asyncio.run(_hello(state_dir))
    except AgentError as exc:
        sd = state_dir or paths.state_dir()
        if as_json:
            print(json.dumps({"running": False, "state_dir": str(sd), "error": exc.message}))
        else:
            print(_shown(f"agent: not running ({exc.message})"))
        return EXIT_NOT_RUNNING
    info = {
        "running": True,
        "pid": h.pid,
        "host": h.host,
        "version": h.agent_version,
        "protocol": h.version,
        "epoch": h.epoch,
        "state_dir": h.state_dir,
        "gpu_error": h.gpu_error,
        "simulated": h.simulated,
        "containment": h.containment,
        "journal": h.journal,
        "namespace": msgspec.to_builtins(h.namespace) if h.namespace is not None else None,
    }
    if as_json:
        print(json.dumps(info))
        return 0
    gpus = "SIMULATED (GPUDECK_SIMULATE_GPUS is set: no real GPU is read)" if h.simulated else "NVML ok"
    for line in (
        f"agent: running, pid {h.pid} on {h.host}, version {h.agent_version}, state {h.state_dir}",
        f"GPUs: {h.gpu_error or gpus}",
        f"containment: {h.containment or 'not reported (an older agent)'}",
        f"PID namespace: {h.namespace.label if h.namespace is not None else 'not reported (an older agent)'}",
        f"journal: {h.journal or 'ok'}",
    ):
        print(_shown(line))
    return 0


def stop(state_dir: Path | None) -> int:
    """``agent stop``: SIGTERM to the agent that answers (by its pid, once its Hello named it), then wait for it."""
    import psutil

    from gpudeck.agents.wire import paths
    from gpudeck.agents.wire.errors import AgentError

    try:
        pid = asyncio.run(_hello(state_dir)).pid
    except AgentError as exc:
        print(_shown(f"agent: not running ({exc.message})"))
        return 0
    try:
        p = psutil.Process(pid)
        p.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        pass
    else:
        deadline = time.monotonic() + STOP_WAIT_S
        while True:  # gone, or a zombie its parent has not reaped yet: either way it has exited
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            if time.monotonic() > deadline:
                log = paths.log_path(state_dir or paths.state_dir())
                print(
                    _shown(f"gpudeck agent: the agent (pid {pid}) did not exit within {STOP_WAIT_S:.0f} s of SIGTERM; see {log}"),
                    file=sys.stderr,
                )
                return EXIT_STOP_TIMEOUT
            time.sleep(0.05)
    print(f"agent {pid} stopped; runs keep going and the next agent re-adopts them")
    return 0


def main(argv: list[str] | None = None, prog: str = MODULE_PROG) -> int:
    """Parse and dispatch; ``prog`` is how the usage lines name the command. A reader of stdout that goes away
    (``gpudeck agent status | head -c0``) ends the command quietly with EXIT_PIPE."""
    args = build_parser(prog).parse_args(argv)
    try:
        if args.command == "serve":
            from gpudeck.agents.server.daemon import serve

            return serve(args.state_dir)
        if args.command == "status":
            rc = status(args.state_dir, args.json)
        elif args.command == "stop":
            rc = stop(args.state_dir)
        else:
            from gpudeck.agents.wire.dial import dial

            return dial(args.state_dir)
        sys.stdout.flush()  # inside the try: what is still buffered meets a closed pipe here, not at interpreter exit
        return rc
    except BrokenPipeError:
        return stdout_gone()


if __name__ == "__main__":
    sys.exit(main())
