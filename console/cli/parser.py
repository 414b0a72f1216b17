"""Provides the ``gpudeck`` argument parser: every command's options, built without importing any command's code.

Each subcommand names its coroutine function in :mod:`gpudeck.console.cli.main` (``func="cmd_status"``), which is
imported only once the arguments parsed (:func:`gpudeck.console.entry.console_main`): ``--help``, ``--version`` and
a usage error cost the interpreter, argparse and this module, nothing of the fleet, the history, SSH or Textual
(``tests/unit/test_cli_imports.py`` holds that; bench/cli.py measures it). A command that needs no event loop sets
``func=None`` and ``sync``, a function of the parsed arguments that imports what it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from gpudeck.console.core.sanitize import SECRET_RULE
from gpudeck.console.watch.cli import add_parser as add_watch_parser

DEFAULT_WATCH_S = 2.0  # status --watch's redraw interval, as watch(1)'s


class _Version(argparse.Action):
    """``--version``: the one version string, read from the package metadata only when asked (that read costs an
    ``importlib.metadata`` import, which every other command would pay for if the parser read it up front)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        from gpudeck.agents import __version__

        print(f"gpudeck {__version__}", flush=True)
        parser.exit()


SHOW_SECRETS_HELP = f"show --env values whose names look like secrets, redacted by default (the rule: {SECRET_RULE})"


def add_show_secrets(p: argparse.ArgumentParser) -> None:
    """The ``--show-secrets`` option of every command that prints a spec or an environment; its help quotes the rule."""
    p.add_argument("--show-secrets", action="store_true", help=SHOW_SECRETS_HELP)


def build_parser() -> argparse.ArgumentParser:
    """The gpudeck argument parser."""
    ap = argparse.ArgumentParser(prog="gpudeck", description="Run and watch PyTorch training on your GPU hosts.")
    ap.add_argument("--version", action=_Version, help="print the version and exit")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    host_help = "a host of the fleet (a name from ~/.ssh/config; `local` is this machine)"

    p = sub.add_parser("console", help="open the full-screen console (the default in a terminal)")
    p.set_defaults(func=None, sync=lambda ns: __import__("gpudeck.console.tui.app", fromlist=["run_console"]).run_console())

    p = sub.add_parser("status", help="GPUs, who holds them, and live runs: every host, or one with --host")
    p.add_argument("--host", default=None, help=host_help + "; default: every host")
    p.add_argument("--json", action="store_true", help="print the snapshot(s) as JSON (with --watch: one JSON document a line)")
    p.add_argument("--watch", "-w", action="store_true", help="redraw every -n seconds, in place on a terminal, until Ctrl-C")
    p.add_argument(
        "-n",
        "--interval",
        type=float,
        default=DEFAULT_WATCH_S,
        metavar="SECONDS",
        help=f"with --watch: seconds between redraws (default {DEFAULT_WATCH_S:g})",
    )
    p.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N redraws (default: until Ctrl-C)")
    p.add_argument("--user", default=None, help="only the GPU processes and live runs of this user")
    p.add_argument("--run", default=None, metavar="RUN", help="only this run's GPU processes and run (id prefix or name)")
    p.add_argument("--pid", type=int, default=None, help="only this GPU process (and the live run it is a member of)")
    add_show_secrets(p)
    p.set_defaults(func="cmd_status")

    spec_args = argparse.ArgumentParser(add_help=False)
    spec_args.add_argument("--host", default=None, help=host_help + "; default: local")
    spec_args.add_argument("--name", default=None, help="a name to find the run by")
    spec_args.add_argument("--gpus", default=None, help="GPU indices (sets CUDA_VISIBLE_DEVICES), e.g. 0,1 or 0-3")
    spec_args.add_argument(
        "--kind",
        default="command",
        help="command (default), fsdp or dflash (checked by the operations layer, as the console checks it); fsdp/dflash: the "
        "arguments after -- may be just the trainer's (the command is built, under torchrun for several GPUs)",
    )
    spec_args.add_argument(
        "--python", default=None, help="the run's python interpreter (its environment is fingerprinted and pre-flighted)"
    )
    spec_args.add_argument("--fresh", action="store_true", help="trainers: start from step 0 with new checkpoints")
    spec_args.add_argument("--resume", default=None, metavar="N|latest", help="trainers: continue from checkpoint step N")
    spec_args.add_argument("--env", action="append", metavar="NAME=VALUE", help="extra environment (repeatable)")
    spec_args.add_argument("--cwd", default=None, help="working directory (default: here for local, the agent's home elsewhere)")
    spec_args.add_argument(
        "--need-gib", type=float, default=None, help="GPU memory each GPU needs (estimated for fsdp/dflash when not given)"
    )
    spec_args.add_argument(
        "--force", action="store_true", help="launch even with FOREIGN/STALE processes on the GPUs (only that check; recorded)"
    )
    spec_args.add_argument("--rdzv-port", type=int, default=None, help="the rendezvous port that must be free")
    spec_args.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (its free space is checked)")
    spec_args.add_argument(
        "--on-rank-death",
        default="alert",
        help="when a rank dies and the run goes on: alert (default) or stop the whole run",
    )
    spec_args.add_argument(
        "--on-hang",
        default="triage",
        help="when steps stop advancing: triage (default: stacks of every rank, then the alert), alert, or stop",
    )
    spec_args.add_argument(
        "--hang-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="hang threshold floor (default 120; the threshold is max(5 x median step, this))",
    )
    spec_args.add_argument(
        "--straggler-window",
        type=int,
        default=None,
        metavar="STEPS",
        help="steps each rank's median compute time is taken over for the straggler alert (default 8)",
    )
    spec_args.add_argument("--expected-ranks", type=int, default=None, help="ranks the run must have (default: the manifest's world size)")
    spec_args.add_argument("--claim-gpus", type=int, default=None, help="GPUs the run is claimed to use (checked against NVML)")
    spec_args.add_argument("--claim-params", default=None, help="parameters claimed, e.g. 1.1B (checked against the manifest)")
    spec_args.add_argument("--claim-world-size", type=int, default=None, help="ranks claimed (checked against the rank processes)")
    spec_args.add_argument("--claim-tokens-per-s", type=float, default=None, help="throughput claimed (checked against the telemetry)")
    spec_args.add_argument("--note", default=None, help="free text stored with the run (claims in it are checked too)")
    spec_args.add_argument(
        "--nproc-per-node", type=int, default=None, help="--kind fsdp/dflash: ranks per host (default: the number of --gpus)"
    )
    spec_args.add_argument(
        "--hosts", default=None, metavar="H1,H2,...", help="one run across these hosts (torchrun c10d; the first host is the rendezvous)"
    )
    spec_args.add_argument(
        "--rdzv-host",
        default=None,
        help="multi-node: the address the other hosts reach the first one at (default: its rdzv_host or SSH HostName)",
    )
    spec_args.add_argument(
        "--allow-env-diff",
        action="append",
        default=[],
        metavar="NAME",
        help="multi-node: launch although the nodes differ in NAME, a row of the cross-node gate's table (repeatable; recorded)",
    )
    spec_args.add_argument("--json", action="store_true", help="print the result as JSON")
    spec_args.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command and its arguments (never run by a shell)")

    p = sub.add_parser(
        "launch", parents=[spec_args], help="pre-flight, then start a run: gpudeck launch [--host H] [--gpus 0,1] -- CMD ARGS..."
    )
    p.add_argument(
        "--request-id",
        default=None,
        help="idempotency key: a retry with the same key and the same launch (every option and the command) starts nothing new; "
        "the same key with any difference is refused",
    )
    add_show_secrets(p)
    p.add_argument(
        "--reclaim-holders",
        action="store_true",
        help="when pre-flight refuses because stale or foreign processes of yours hold the GPUs: stop exactly those (TERM, "
        "--grace, KILL, verified), pre-flight again and launch, printing each step; another user's process, a process this host "
        "cannot see, or a failure reclaiming cannot fix refuses it before anything is stopped",
    )
    p.add_argument("--grace", type=float, default=10.0, help="with --reclaim-holders: seconds between SIGTERM and SIGKILL (default 10)")

    p.set_defaults(func="cmd_launch")

    p = sub.add_parser("preflight", parents=[spec_args], help="only the pre-flight checks of a launch (nothing starts)")
    p.set_defaults(func="cmd_preflight")

    p = sub.add_parser("reclaim", help="list leftovers (reclaim HOST) or stop them (reclaim HOST:PID ...): TERM, grace, KILL, verify")
    p.add_argument("targets", nargs="+", metavar="HOST | HOST:PID")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("--include-live", action="store_true", help="also list / allow members of live runs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func="cmd_reclaim")

    p = sub.add_parser("verify", help="a run's claims against what is observed: parameters, ranks, GPUs, data, throughput")
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default=None, help=host_help + "; default: the host that has the run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func="cmd_verify")

    p = sub.add_parser("metrics", help="a run's step metrics: loss and tokens/s (its agent's, else the history's), as the Run screen")
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default=None, help=host_help + "; default: the host that has the run")
    p.add_argument("--points", type=int, default=200, help="at most this many steps, evenly spread (default 200, as the Run screen)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func="cmd_metrics")

    p = sub.add_parser("triage", help="a live run's evidence now: every rank's stacks, state, CPU, GPU and the likely culprit (stored)")
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default=None, help=host_help + "; default: the host that has the run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func="cmd_triage")

    p = sub.add_parser("runs", help="every run the agents have recorded (every host, or one with --host)")
    p.add_argument("--host", default=None, help=host_help)
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--no-sync",
        action="store_true",
        help="ask no host: the runs as this machine's history last recorded them (`gpudeck history` and the console sync it)",
    )
    add_show_secrets(p)
    p.set_defaults(func="cmd_runs")

    p = sub.add_parser("tail", help="a run's output (stdout and stderr of all its ranks)")
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default=None, help=host_help + "; default: the host that has the run")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the run ends (Ctrl-C leaves)")
    p.add_argument("-n", "--lines", type=int, default=20, help="how many last lines to print first (-1: all of the last 256 KiB)")
    p.add_argument(
        "--node",
        type=int,
        default=None,
        help="multi-node runs: only this node's output (default: every node, each line prefixed with its host)",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="print the output byte for byte (by default control characters and escape sequences are shown as \\x1b-style escapes)",
    )
    p.set_defaults(func="cmd_tail")

    p = sub.add_parser("stop", help="stop every process of a run: TERM, grace, KILL, verify")
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default=None, help=host_help + "; default: the host that has the run")
    p.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL (default 30)")
    p.add_argument("--json", action="store_true", help="print the verification result as JSON")
    p.set_defaults(func="cmd_stop")

    p = sub.add_parser("hosts", help="the fleet: list hosts (--check probes them), add NAME, remove NAME")
    p.add_argument("--check", action="store_true", help="connect to every host and show its state")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for each host with --check")
    p.add_argument("--json", action="store_true")
    hsub = p.add_subparsers(dest="hosts_command", metavar="list|add|remove")
    hsub.add_parser("list", help="the configured hosts")
    h = hsub.add_parser("add", help="add hosts (names as in ~/.ssh/config)")
    h.add_argument("names", nargs="+")
    h = hsub.add_parser("remove", help="remove hosts")
    h.add_argument("names", nargs="+")
    p.set_defaults(func="cmd_hosts")

    sync_args = argparse.ArgumentParser(add_help=False)
    sync_args.add_argument("--no-sync", action="store_true", help="answer from the history as it is, without asking the hosts first")
    sync_args.add_argument("--sync-timeout", type=float, default=20.0, help="seconds to wait for each host's new events (default 20)")

    p = sub.add_parser(
        "history", parents=[sync_args], help="every run ever started: gpudeck history state:failed host:gpu1 since:7d cause:oom"
    )
    p.add_argument(
        "query",
        nargs="*",
        help="filters, each argument one term (key:value, key:~text, key:a,b, -key:value; see docs/history.md): "
        "state host kind name id cause operator parent torch alert since until limit",
    )
    p.add_argument("--host", default=None, help="sync only this host first (the query itself takes host:NAME)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--problems",
        action="store_true",
        help="the events the history kept out (quarantined: a value SQLite cannot store, an event that does not decode), raw, with why",
    )
    add_show_secrets(p)
    p.set_defaults(func="cmd_history")

    p = sub.add_parser("show", parents=[sync_args], help="one run in full from the history: spec, environment, telemetry, timeline")
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default=None, help=host_help)
    p.add_argument("--json", action="store_true")
    add_show_secrets(p)
    p.set_defaults(func="cmd_show")

    p = sub.add_parser(
        "report",
        parents=[sync_args],
        help="a run's post-mortem from evidence: claims vs manifest and GPU ledger, curve, environment, alerts, end, leftovers",
    )
    p.add_argument("run", help="run id, unique id prefix, or name")
    p.add_argument("--host", default=None, help=host_help)
    p.add_argument("--json", action="store_true", help="the report as JSON (schema gpudeck.report/1) instead of Markdown")
    p.set_defaults(func="cmd_report")

    p = sub.add_parser(
        "ledger",
        parents=[sync_args],
        help="the GPU ledger: who held a GPU at a time (--at), over a window (--since/--until), or a run's GPU footprint (--run)",
    )
    p.add_argument("target", metavar="HOST[:GPU]", help="a host of the fleet, optionally one GPU index (gpu1:5)")
    time_help = "an ISO time (2026-12-04T02:14), HH:MM today, a time ago (-2h, -30m, -1d) or now"
    p.add_argument("--at", default=None, metavar="TIME", help=f"who held it then (default: now): {time_help}")
    p.add_argument("--since", default=None, metavar="TIME", help="the holds from this time on (a timeline)")
    p.add_argument("--until", default=None, metavar="TIME", help="with --since: up to this time (default now)")
    p.add_argument(
        "--run", default=None, metavar="RUN", help="one run's holds; alone: its GPU footprint over its life (id, prefix or name)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func="cmd_ledger")

    p = sub.add_parser(
        "diff", parents=[sync_args], help="two runs side by side: config, environment (torch/CUDA/driver/NCCL first), outcome"
    )
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument(
        "--all",
        action="store_true",
        help="also show the config and environment rows that are equal (the outcome rows are always all shown)",
    )
    p.add_argument("--host", default=None, help="sync only this host first")
    p.add_argument("--json", action="store_true")
    add_show_secrets(p)
    p.set_defaults(func="cmd_diff")

    start_args = argparse.ArgumentParser(add_help=False)
    start_args.add_argument("--fresh", action="store_true", help="start from step 0 with new checkpoints")
    start_args.add_argument("--resume", default=None, metavar="N|latest", help="continue from checkpoint step N")
    start_args.add_argument("--host", default=None, help="launch there (default: where the run ran)")
    start_args.add_argument("--json", action="store_true")
    add_show_secrets(start_args)

    p = sub.add_parser(
        "relaunch", parents=[sync_args, start_args], help="run a recorded run's config again (a trainer: --fresh or --resume N is required)"
    )
    p.add_argument("run")
    p.set_defaults(func="cmd_relaunch")

    p = sub.add_parser(
        "rollback",
        parents=[sync_args, start_args],
        help="relaunch RUN in GOOD_RUN's environment: rollback RUN --to GOOD (--fresh | --resume N)",
    )
    p.add_argument("run")
    p.add_argument("--to", required=True, metavar="GOOD_RUN", help="the known-good run whose environment to use")
    p.add_argument("--config-from", action="store_true", help="use GOOD_RUN's configuration too")
    p.add_argument(
        "--rebuild-env",
        action="store_true",
        help="when GOOD_RUN's environment changed, recreate it from its recorded freeze (new venv under the agent's state dir)",
    )
    p.set_defaults(func="cmd_rollback")

    # parsed by the agent's own main (an agent-only install runs them too; console/entry.py hands them over): listed
    # here for --help
    p = sub.add_parser("agent", help="the host agent: serve, dial, status, stop (`gpudeck agent --help`)", add_help=False)
    p.add_argument("agent_args", nargs=argparse.REMAINDER)
    add_watch_parser(sub)
    return ap


def negated_filters(argv: list[str]) -> tuple[list[str], list[str]]:
    """``history``'s ``-key:value`` words (a negated filter of a known key) taken out of its arguments, so argparse does not
    read them as unknown options: (the arguments without them, the words). Other commands' arguments are left alone."""
    if argv[:1] != ["history"]:
        return argv, []
    from gpudeck.console.core.query_words import is_negation  # the query language's word rule: only `history` needs it

    end = argv.index("--") if "--" in argv else len(argv)
    words = [a for a in argv[1:end] if is_negation(a)]
    return [a for i, a in enumerate(argv) if not (0 < i < end and is_negation(a))], words


_LEDGER_TIME_OPTIONS = ("--at", "--since", "--until")


def ledger_times(argv: list[str]) -> list[str]:
    """``ledger --since -2h``: a time ago starts with '-', which argparse reads as an option; joined to its option
    (``--since=-2h``) so it is read as the option's value."""
    if not argv or argv[0] != "ledger":
        return argv
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _LEDGER_TIME_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1][1:2].isdigit():
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line (``sys.argv[1:]`` when ``argv`` is None); ``--help``, ``--version`` and a usage error
    exit here (SystemExit), as argparse does."""
    args, negated = negated_filters(ledger_times(sys.argv[1:] if argv is None else list(argv)))
    ns = build_parser().parse_args(args)
    if negated:
        ns.query = [*ns.query, *negated]
    return ns
