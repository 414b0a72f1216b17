"""Provides the ``gpudeck watch`` subcommand: run the watcher, ``--check`` the configuration, or show ``--status``.

Exit codes: 0 fine; 1 a target failed (``--check``), is failing (``--status``), or the watcher could not run;
2 the configuration is wrong (the message says where and how to fix it); 3 (``--status``) no watcher runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from gpudeck.console.core.exitcodes import EXIT_CONFIG, EXIT_FAILING, EXIT_INTERRUPTED, EXIT_UNREACHABLE
from gpudeck.console.core.sanitize import terminal_text

if TYPE_CHECKING:
    from gpudeck.console.core import config as cfg
    from gpudeck.console.watch.outbox import TargetStatus
    from gpudeck.console.watch.rules import Rule

# every gpudeck command builds this module's parser (add_parser): the watcher itself (the Fleet, prometheus_client),
# the config, rules, outbox, delivery and the targets' privacy forms are imported when `watch` runs, not by every
# gpudeck command
DEFAULT_METRICS = ("127.0.0.1", 9464)

# --status: no watcher runs on this history (what its outbox says is printed all the same)
EXIT_NOT_RUNNING = EXIT_UNREACHABLE


def add_parser(sub: Any) -> None:
    """Register ``watch`` on the CLI's subparsers."""
    p = sub.add_parser(
        "watch",
        help="follow the fleet without a UI: notifications ([[notify]] in the config, apprise) and Prometheus metrics",
        description="Follows every host like the console (history sync included), sends notifications for the [[notify]] rules "
        "exactly once per event and target, and with --metrics serves OpenMetrics on loopback.",
    )
    p.add_argument(
        "--metrics",
        nargs="?",
        const=f"{DEFAULT_METRICS[0]}:{DEFAULT_METRICS[1]}",
        default=None,
        metavar="[ADDRESS:]PORT",
        help=f"serve metrics (default address {DEFAULT_METRICS[0]}; another address only when given)",
    )
    p.add_argument("--check", action="store_true", help="check the configuration and send a test notification to every target")
    p.add_argument("--status", action="store_true", help="every target: delivered, pending, failing and why")
    p.add_argument("--json", action="store_true", help="--status as JSON")
    p.add_argument(
        "--interval", type=float, default=5.0, help="snapshot interval of the hosts followed, s (default 5: the metrics' resolution)"
    )
    p.add_argument("--expire-hours", type=float, default=None, help="give up on a notification not delivered within this (default 24)")
    p.set_defaults(func=None, sync=main)


def _load() -> tuple[cfg.Config, list[Rule]]:
    from gpudeck.console.core import config as cfg
    from gpudeck.console.watch.rules import compile_rules

    conf = cfg.load()
    return conf, compile_rules(conf.notify)


def _unusable_rules(rules: list[Rule]) -> dict[int, str]:
    """The rules the history's SQLite cannot evaluate (none when there is no history yet to try them on)."""
    import sqlite3

    from gpudeck.console.core import config as cfg
    from gpudeck.console.watch.rules import unusable

    path = cfg.history_path()
    if not path.exists():
        return {}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            return unusable(conn, rules)
        finally:
            conn.close()
    except sqlite3.Error:
        return {}  # a history that cannot be read is the watcher's to report


def check() -> int:
    """Validate the configuration and send a test notification to every target; 0 when every target accepted it."""
    from gpudeck.console.core import config as cfg
    from gpudeck.console.watch import deliver
    from gpudeck.console.watch.rules import RuleError
    from gpudeck.console.watch.targets import privacy_form

    try:
        conf, rules = _load()
    except (cfg.ConfigError, RuleError) as exc:
        print(terminal_text(f"gpudeck watch: {exc}"), file=sys.stderr)
        return EXIT_CONFIG
    bad = _unusable_rules(rules)
    if bad:
        for number, reason in sorted(bad.items()):
            print(f"gpudeck watch: [[notify]] number {number}: {reason}", file=sys.stderr)
        return EXIT_CONFIG
    targets = list(dict.fromkeys(u for r in rules for u in r.to))
    print(f"config {conf.path}: {len(conf.names)} host(s), {len(rules)} [[notify]] rule(s), {len(targets)} target(s)")
    if not targets:
        print("no [[notify]] rules: nothing to send (see README, `gpudeck watch`)")
        return 0
    msg = deliver.test_message()
    failed = 0
    for url in targets:
        try:
            why = deliver.send(url, msg)
        except deliver.UnusableTarget as exc:
            why = str(exc)
        print(terminal_text(f"  {'ok    ' if why is None else 'FAILED'} {privacy_form(url)}" + (f": {why}" if why else "")))
        failed += why is not None
    return EXIT_FAILING if failed else 0


def status(as_json: bool) -> int:
    """Print every target's record (JSON with ``as_json``, whatever the state); 1 when one is failing, 3 when no watcher runs."""
    from gpudeck.console.watch.outbox import Outbox, OutboxError
    from gpudeck.console.watch.service import outbox_path, running_pid
    from gpudeck.console.watch.targets import privacy_form, scrub

    path = outbox_path()
    pid = running_pid()
    rows: list[TargetStatus] = []
    items: list[tuple] = []
    ids: dict[str, str] = {}
    if path.exists():
        try:
            ob = Outbox(path)
        except OutboxError as exc:
            print(terminal_text(f"gpudeck watch: {exc}"), file=sys.stderr)
            return EXIT_FAILING
        try:
            rows = ob.status()
            items = ob.items()
            ids = {t: ob.label(t) for t in {*(s.target for s in rows), *(it[3] for it in items)}}
        finally:
            ob.close()
    forms = {t: privacy_form(t) for t in ids}  # apprise parses each URL once
    # errors recorded before their secrets were hidden (or quoting the URL some other way) are scrubbed as they are shown
    errors = {s.target: scrub(s.last_error, s.target) if s.last_error else s.last_error for s in rows}
    if as_json:
        out = {
            "running": pid is not None,
            "running_pid": pid,
            "outbox": str(path) if path.exists() else None,
            "targets": [
                {
                    "id": ids[s.target],
                    "target": forms[s.target],
                    "failing": s.failing,
                    "pending": s.pending,
                    "oldest_pending": s.oldest_pending,
                    "delivered": s.delivered,
                    "failures": s.failures,
                    "expired": s.expired,
                    "consecutive_failures": s.consecutive,
                    "last_ok": s.last_ok,
                    "last_fail": s.last_fail,
                    "last_error": errors[s.target],
                }
                for s in rows
            ],
            "notifications": [{"key": f"{h}/{e}/{q}", "id": ids[t], "target": forms[t], "state": st} for h, e, q, t, st in items],
        }
        print(json.dumps(out, indent=2))
    else:
        where = f"outbox {path}" if path.exists() else f"no outbox at {path}: gpudeck watch has not run on this history"
        print(f"watcher: {'running, pid ' + str(pid) if pid else 'not running'}; {where}")
        if path.exists() and not rows:
            print("no targets have been used yet")
        now = time.time()
        for s in rows:
            head = "FAILING" if s.failing else "ok"
            line = f"{head:8} {ids[s.target]} {forms[s.target]}: {s.delivered} delivered, {s.pending} pending, {s.expired} expired"
            if s.failing:
                since = f" (oldest pending {now - s.oldest_pending:.0f} s)" if s.oldest_pending else ""
                line += f"; {s.consecutive} failed attempt(s) in a row{since}: {errors[s.target] or '?'}"
            print(terminal_text(line))
    if any(s.failing for s in rows):
        return EXIT_FAILING
    return 0 if pid is not None else EXIT_NOT_RUNNING


async def _run(opts: Any) -> int:
    import asyncio
    import signal

    from gpudeck.console.watch.service import Watcher

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await Watcher(opts).run(stop)


def main(args: argparse.Namespace) -> int:
    """``gpudeck watch``."""
    if args.status:
        return status(args.json)
    if args.check:
        return check()
    import asyncio

    from gpudeck.console.core import config as cfg
    from gpudeck.console.watch.outbox import OutboxError
    from gpudeck.console.watch.rules import RuleError
    from gpudeck.console.watch.service import WatchError, WatchOptions, parse_address

    try:
        conf, rules = _load()
        metrics = parse_address(args.metrics) if args.metrics else None
    except (cfg.ConfigError, RuleError, WatchError) as exc:
        print(terminal_text(f"gpudeck watch: {exc}"), file=sys.stderr)
        return EXIT_CONFIG
    expire = args.expire_hours * 3600 if args.expire_hours else None
    try:
        return asyncio.run(_run(WatchOptions(config=conf, rules=rules, metrics=metrics, interval_s=args.interval, expire_s=expire)))
    except (WatchError, OutboxError) as exc:
        print(terminal_text(f"gpudeck watch: {exc}"), file=sys.stderr)
        return EXIT_FAILING
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
