"""Provides the ``gpudeck`` command line: status, launch, runs, tail, stop, agent.

Every command returns a structured result or a structured error: with
``--json`` the result is one JSON document on stdout; errors go to stderr
with a non-zero exit code and say what to do.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from agents import paths
from agents.client import AgentClient
from agents.errors import AgentError
from agents.protocol import LaunchSpec, RunInfo, Snapshot, StopResult, to_builtins
from console.fleet import Fleet
from console.fmt import duration, elapsed, gib, when

EXIT_ERROR = 1
EXIT_USAGE = 2
# passed from the caller's shell to a local run, so it resolves commands as the caller would
CALLER_ENV = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE")


class CliError(Exception):
    """A user-facing failure of the CLI itself (bad arguments, unsupported host)."""


# ----------------------------------------------------------------------------- formatting


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A left-aligned text table."""
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    line = lambda cells: "  ".join(c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()  # noqa: E731
    return "\n".join([line(headers), *(line(r) for r in rows)])


def format_status(snap: Snapshot) -> str:
    """Human view of a snapshot: GPUs, GPU processes, live runs."""
    out = [f"host {snap.host}  ({when(snap.ts)}, sampled in {snap.sample_ms:.2f} ms)"]
    if snap.gpu_error:
        out.append(f"GPUs: none ({snap.gpu_error})")
    else:
        rows = [
            [
                str(g.index),
                g.name,
                f"{gib(g.memory_used)}/{gib(g.memory_total)} GiB",
                "-" if g.util_gpu is None else f"{g.util_gpu}%",
                "-" if g.temperature_c is None else f"{g.temperature_c}C",
                "-" if g.power_w is None else f"{g.power_w:.0f}W",
                gib(g.unaccounted_bytes),
            ]
            for g in snap.gpus
        ]
        out.append(table(["GPU", "NAME", "MEMORY", "UTIL", "TEMP", "POWER", "UNACCOUNTED GiB"], rows))
        procs = [p for g in snap.gpus for p in g.processes]
        if procs:
            prow = [
                [
                    str(p.pid),
                    str(p.gpu),
                    gib(p.used_bytes),
                    p.attribution,
                    p.run_id or "-",
                    "-" if p.rank is None else str(p.rank),
                    p.user or "-",
                    " ".join(p.cmdline)[:60] or "-",
                ]
                for p in procs
            ]
            out.append("")
            out.append(table(["PID", "GPU", "GiB", "HOLDER", "RUN", "RANK", "USER", "COMMAND"], prow))
        else:
            out.append("no GPU processes")
    if snap.runs:
        out.append("")
        out.append(table(["RUN", "NAME", "STATE", "MEMBERS", "ELAPSED", "COMMAND"], [
            [r.id, r.name or "-", r.state, str(sum(1 for m in r.members if m.role != "shim")), duration(elapsed(r.started, r.ended)), " ".join(r.spec.argv)[:50]]
            for r in snap.runs
        ]))
    else:
        out.append("no live runs")
    return "\n".join(out)


def format_runs(runs: list[RunInfo]) -> str:
    """Human view of the run list."""
    if not runs:
        return "no runs yet: `gpudeck launch -- CMD ...` starts one"
    rows = [
        [r.id, r.host, r.name or "-", r.state, when(r.started or r.created), duration(elapsed(r.started, r.ended)), (r.cause or "-")[:70]]
        for r in runs
    ]
    return table(["RUN", "HOST", "NAME", "STATE", "STARTED", "ELAPSED", "CAUSE"], rows)


def format_stop(res: StopResult) -> str:
    """Human view of a stop's verification."""
    lines = [f"run {res.run_id}: {res.state} in {res.seconds:.2f} s"]
    for p in res.stopped:
        lines.append(f"  stopped  pid {p.pid:<7} {p.how:<12} {' '.join(p.cmdline)[:70]}")
    for p in res.survivors:
        lines.append(f"  SURVIVED pid {p.pid:<7} {p.status or '?':<12} {' '.join(p.cmdline)[:70]}")
    if res.needed_kill:
        lines.append(f"  needed SIGKILL: {', '.join(map(str, res.needed_kill))}")
    for f in res.freed:
        lines.append(f"  GPU {f.gpu}: {gib(f.before_bytes)} -> {gib(f.after_bytes)} GiB used ({gib(f.freed_bytes)} GiB freed)")
    lines.append(f"  {res.gpu_note}" if res.gpu_note else "")
    if res.survivors:
        lines.append("  a process in disk sleep (D) cannot be killed until its I/O returns: check the driver/storage (dmesg); it is not retried in a loop")
    return "\n".join(ln for ln in lines if ln)


def run_json(r: RunInfo) -> dict[str, Any]:
    """The scripted shape of a run (stable keys for users' scripts)."""
    d = to_builtins(r)
    for k in ("exit_code", "signal", "cause", "started", "ended", "name"):
        d.setdefault(k, None)
    return d


# ----------------------------------------------------------------------------- commands


async def _with_fleet(host: str, fn):  # type: ignore[no-untyped-def]
    """Run ``fn(fleet)`` on a request-only Fleet that links ``host`` (the same API the console uses)."""
    fleet = Fleet(hosts=[host], watch=False)
    try:
        return await fn(fleet)
    finally:
        await fleet.close()


async def cmd_status(args: argparse.Namespace) -> int:
    snap = await _with_fleet(args.host, lambda f: f.snapshot(args.host))
    if args.json:
        print(json.dumps(to_builtins(snap)))
    else:
        print(format_status(snap))
    return 0


def _parse_gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise CliError(f"--gpus {text!r} is not a GPU list: write 0,1,2 or 0-3") from None
    return out


def _parse_env(items: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise CliError(f"--env {item!r} needs the form NAME=VALUE")
        k, v = item.split("=", 1)
        env[k] = v
    return env


async def cmd_launch(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise CliError("launch needs a command after --, e.g. `gpudeck launch -- python train.py`")
    # a local launch runs in the caller's environment: `python` means the python of this shell
    env = {k: os.environ[k] for k in CALLER_ENV if k in os.environ}
    env.update(_parse_env(args.env or []))
    spec = LaunchSpec(
        argv=argv,
        name=args.name,
        kind=args.kind,
        gpus=_parse_gpus(args.gpus),
        env=env,
        cwd=os.path.abspath(args.cwd) if args.cwd else os.getcwd(),
        operator=getpass.getuser(),
    )
    reply = await _with_fleet(args.host, lambda f: f.launch(args.host, spec, request_id=args.request_id or ""))
    if args.json:
        print(json.dumps({**run_json(reply.run), "duplicate": reply.duplicate}))
    else:
        print(reply.run.id)
    return 0


async def cmd_runs(args: argparse.Namespace) -> int:
    runs = await _with_fleet(args.host, lambda f: f.runs(args.host, limit=args.limit))
    if args.json:
        print(json.dumps([run_json(r) for r in runs]))
    else:
        print(format_runs(runs))
    return 0


async def cmd_tail(args: argparse.Namespace) -> int:
    out = sys.stdout

    async def tail(fleet: Fleet) -> None:
        rid = (await fleet.run(args.host, args.run)).id
        # the last N lines: read a window from the end, then follow from its end
        window = await anext(fleet.output(args.host, rid, offset=-256 * 1024, follow=False))
        text = window.data
        if args.lines >= 0:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-args.lines:]) if args.lines else ""
        out.write(text)
        out.flush()
        if args.follow:
            async for chunk in fleet.output(args.host, rid, offset=window.next_offset, follow=True):
                out.write(chunk.data)
                out.flush()

    await _with_fleet(args.host, tail)
    return 0


async def cmd_stop(args: argparse.Namespace) -> int:
    res = await _with_fleet(args.host, lambda f: f.stop(args.host, args.run, args.grace))
    if args.json:
        print(json.dumps(to_builtins(res)))
    else:
        print(format_stop(res))
    return 0 if not res.survivors else EXIT_ERROR


async def cmd_agent_status(args: argparse.Namespace) -> int:
    sd = paths.state_dir()
    try:
        c = await AgentClient.connect_unix(autostart=False)
    except AgentError as exc:
        if args.json:
            print(json.dumps({"running": False, "state_dir": str(sd), "error": exc.message}))
        else:
            print(f"agent: not running ({exc.message})")
        return 3
    try:
        h = c.hello
        assert h is not None
        info = {"running": True, "pid": h.pid, "host": h.host, "version": h.agent_version, "epoch": h.epoch, "state_dir": h.state_dir, "gpu_error": h.gpu_error}
    finally:
        await c.close()
    if args.json:
        print(json.dumps(info))
    else:
        print(f"agent: running, pid {info['pid']} on {info['host']}, version {info['version']}, state {info['state_dir']}")
        print(f"GPUs: {info['gpu_error'] or 'NVML ok'}")
    return 0


async def cmd_agent_stop(args: argparse.Namespace) -> int:
    """Stop the agent (SIGTERM by its pid); runs keep going and a new agent re-adopts them."""
    import signal as _signal

    import psutil

    try:
        c = await AgentClient.connect_unix(autostart=False)
    except AgentError as exc:
        print(f"agent: not running ({exc.message})")
        return 0
    assert c.hello is not None
    pid = c.hello.pid
    await c.close()
    p = psutil.Process(pid)
    p.send_signal(_signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # gone, or a zombie its parent has not reaped yet: either way it has exited
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        if time.monotonic() > deadline:
            raise CliError(f"the agent (pid {pid}) did not exit within 10 s of SIGTERM; see {paths.log_path()}")
        await asyncio.sleep(0.05)
    print(f"agent {pid} stopped; runs keep going and the next agent re-adopts them")
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The gpudeck argument parser."""
    ap = argparse.ArgumentParser(prog="gpudeck", description="Run and watch PyTorch training on your GPU hosts.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("console", help="open the full-screen console (the default in a terminal)")
    p.set_defaults(func=None, sync=lambda ns: __import__("console.app", fromlist=["run_console"]).run_console())

    p = sub.add_parser("status", help="this host's GPUs, who holds them, and live runs")
    p.add_argument("--host", default="local")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("launch", help="start a run: gpudeck launch [--gpus 0,1] -- CMD ARGS...")
    p.add_argument("--host", default="local")
    p.add_argument("--name", default=None, help="a name to find the run by")
    p.add_argument("--gpus", default=None, help="GPU indices (sets CUDA_VISIBLE_DEVICES), e.g. 0,1 or 0-3")
    p.add_argument("--kind", default="command", choices=["command", "fsdp", "dflash"])
    p.add_argument("--env", action="append", metavar="NAME=VALUE", help="extra environment (repeatable)")
    p.add_argument("--cwd", default=None, help="working directory (default: here)")
    p.add_argument("--request-id", default=None, help="idempotency key: a retry with the same key starts nothing new")
    p.add_argument("--json", action="store_true", help="print the run as JSON (with its id)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command and its arguments (never run by a shell)")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("runs", help="every run this host's agent has recorded")
    p.add_argument("--host", default="local")
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("tail", help="a run's output (stdout and stderr of all its ranks)")
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default="local")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the run ends (Ctrl-C leaves)")
    p.add_argument("-n", "--lines", type=int, default=20, help="how many last lines to print first (-1: all of the last 256 KiB)")
    p.set_defaults(func=cmd_tail)

    p = sub.add_parser("stop", help="stop every process of a run: TERM, grace, KILL, verify")
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default="local")
    p.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL (default 30)")
    p.add_argument("--json", action="store_true", help="print the verification result as JSON")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("agent", help="the host agent: serve, dial, status, stop")
    asub = p.add_subparsers(dest="agent_command", metavar="serve|dial|status|stop", required=True)
    a = asub.add_parser("serve", help="run the agent in the foreground")
    a.add_argument("--state-dir", type=Path, default=None)
    a.set_defaults(func=None, sync=lambda ns: __import__("agents.server", fromlist=["serve"]).serve(ns.state_dir))
    a = asub.add_parser("dial", help="bridge stdin/stdout to the agent (what the console runs over SSH)")
    a.add_argument("--state-dir", type=Path, default=None)
    a.set_defaults(func=None, sync=lambda ns: __import__("agents.dial", fromlist=["dial"]).dial(ns.state_dir))
    a = asub.add_parser("stop", help="stop the agent (runs keep going; the next agent re-adopts them)")
    a.set_defaults(func=cmd_agent_stop)
    a = asub.add_parser("status", help="is the agent running, and where")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_agent_status)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpudeck`` command."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        if sys.stdout.isatty() and sys.stdin.isatty():
            from console.app import run_console

            return run_console()
        args = ap.parse_args(["status"])  # not a terminal (a pipe, a script): print the status instead
    try:
        if getattr(args, "func", None) is None:
            return int(args.sync(args) or 0)
        return asyncio.run(args.func(args))
    except CliError as exc:
        print(f"gpudeck: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except AgentError as exc:
        print(f"gpudeck: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
