"""Provides the ``gpudeck`` command line: status, launch, runs, tail, stop, hosts, history, show, agent.

Every command returns a structured result or a structured error: with
``--json`` the result is one JSON document on stdout; errors go to stderr
with a non-zero exit code and say what to do. Every command reaches hosts
through :class:`~gpudeck.console.ops.context.Ops`, as the console does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET

from gpudeck.agents.wire.envdiff import EnvGate
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import RunInfo, Triage, VerifyReply, to_builtins
from gpudeck.console.cli.parser import DEFAULT_WATCH_S, parse
from gpudeck.console.cli.status_cmd import host_status, nothing_matched
from gpudeck.console.cli.waiting import enable as enable_progress
from gpudeck.console.cli.waiting import waiting
from gpudeck.console.core import config as cfg
from gpudeck.console.core.exitcodes import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_UNREACHABLE, EXIT_USAGE
from gpudeck.console.core.records import SyncResult
from gpudeck.console.core.sanitize import redact_events, redact_raw_event, redact_record, redact_run, terminal_text
from gpudeck.console.entry import main as entry_main
from gpudeck.console.ops import (
    ClaimsIntent,
    LaunchIntent,
    LaunchResult,
    OpsError,
    Resolved,
    relaunch_intent,
    run_figures,
    start_of,
)
from gpudeck.console.ops.context import Ops
from gpudeck.console.ops.holders import ReclaimLaunch
from gpudeck.console.ops.hosts import remove_hosts
from gpudeck.console.ops.intent import check_start, env_items
from gpudeck.console.ops.launch import LaunchPlan, NodeOutcome, is_trainer, plan_here
from gpudeck.console.ops.ledger import ledger_query
from gpudeck.console.ops.readings import StepSeries
from gpudeck.console.ops.relaunch import EnvironmentCheck
from gpudeck.console.ops.stop import StopOutcome, reclaim_targets
from gpudeck.console.ops.triage import format_triage
from gpudeck.console.present.formats import (
    HostLine,
    HostStatus,
    format_claims,
    format_history,
    format_hosts,
    format_leftovers,
    format_preflight,
    format_problems,
    format_runs,
    format_series,
    format_show,
    format_status,
    format_stop,
    group_runs,
    record_shape,
    run_json,
    why_down,
)
from gpudeck.console.present.ledger import format_ledger
from gpudeck.console.present.report import report_json, report_markdown
from gpudeck.console.present.rundiff import format_diff
from gpudeck.console.present.status import CLEAR_SCREEN, StatusFilter, redraw, snapshot_json, watch_frame
from gpudeck.console.present.views import run_diff

T = TypeVar("T")


class CliError(Exception):
    """A user-facing failure of the CLI itself (bad arguments, unknown host)."""


# ----------------------------------------------------------------------------- commands


async def _with_ops(
    fn: Callable[[Ops], Awaitable[T]], hosts: list[str] | None = None, remember: bool = True, need_history: bool = False
) -> T:
    """Run ``fn(ops)`` on a request-only :class:`Ops` (the same operations the console calls); see :meth:`Ops.request`."""
    async with Ops.request(hosts, remember=remember, need_history=need_history) as ops:
        return await fn(ops)


def _host_arg(args: argparse.Namespace) -> list[str]:
    return [args.host] if getattr(args, "host", None) else []


def partial_json(key: str, rows: list[dict[str, Any]], down: list[tuple[str, str]]) -> Any:
    """The rows as they are when every host answered; else ``{key: rows, "unreachable": [{"host", "error"}]}``.

    The printing edge: ``rows`` are the JSON objects ``--json`` prints (``RunRecord.as_json``, ``group_runs``)."""
    if not down:
        return rows
    return {key: rows, "unreachable": [{"host": h, "error": e} for h, e in down]}


def unreachable_exit(down: Sequence[tuple[str, str | None]]) -> int:
    """Name the hosts that did not answer on stderr; EXIT_UNREACHABLE if any, else 0."""
    for h, e in down:
        print(terminal_text(f"gpudeck: {h} not reachable, the answer is missing its part: {e}"), file=sys.stderr)
    return EXIT_UNREACHABLE if down else 0


async def _statuses(ops: Ops, names: list[str]) -> list[HostStatus]:
    """Every named host's snapshot now (in parallel); a host that does not answer is a row with its error."""
    snaps = await asyncio.gather(*(ops.snapshot(h) for h in names), return_exceptions=True)
    out = []
    for h, s in zip(names, snaps):
        if isinstance(s, AgentError):
            out.append(HostStatus(h, "unreachable", s.message, None))
        elif isinstance(s, BaseException):
            raise s
        else:
            out.append(HostStatus(h, "up", None, s))
    return out


async def _watch_status(args: argparse.Namespace, filt: StatusFilter) -> int:
    """``status --watch``: the status every ``-n`` seconds, redrawn in place on a terminal (one frame after another
    otherwise; one JSON document a line with --json) until Ctrl-C or ``--count`` frames."""
    if args.interval <= 0:
        raise CliError(f"-n {args.interval}: give the seconds between redraws, more than 0 (e.g. -n 2)")
    names = [args.host] if args.host else None
    remember = args.host is None or args.host in cfg.load().names
    tty = sys.stdout.isatty() and not args.json

    async def loop(ops: Ops) -> int:
        frames = 0
        rc = 0
        while args.count is None or frames < args.count:
            t0 = time.monotonic()
            rows = [_filtered(r, filt) for r in await _statuses(ops, names or list(ops.links))]
            rc = EXIT_UNREACHABLE if any(r.snapshot is None for r in rows) else 0
            if args.json:
                doc = {
                    "ts": time.time(),
                    "hosts": [
                        {"host": r.host, "snapshot": snapshot_json(r.snapshot, args.show_secrets) if r.snapshot else None} for r in rows
                    ],
                    "unreachable": [{"host": r.host, "error": r.error} for r in rows if r.snapshot is None],
                }
                print(json.dumps(doc), flush=True)
            else:
                frame = watch_frame(rows, filt, args.interval)
                if tty:
                    sys.stdout.write(redraw(frame))
                    sys.stdout.flush()
                else:
                    print(frame + "\n", flush=True)
            frames += 1
            if args.count is not None and frames >= args.count:
                break
            await asyncio.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
        return rc

    if tty:
        sys.stdout.write(CLEAR_SCREEN)
    return await _with_ops(loop, hosts=names, remember=remember)


def _filtered(row: HostStatus, filt: StatusFilter) -> HostStatus:
    return msgspec.structs.replace(row, snapshot=filt.apply(row.snapshot)) if row.snapshot else row


async def cmd_status(args: argparse.Namespace) -> int:
    filt = StatusFilter(args.user, args.run, args.pid)
    if args.watch:
        return await _watch_status(args, filt)
    if args.count is not None or args.interval != DEFAULT_WATCH_S:
        raise CliError("-n and --count go with --watch (e.g. gpudeck status --watch -n 2)")
    if args.host:  # entry.py runs this one through status_cmd.run without importing this module
        return await host_status(args)

    with waiting(f"connecting to {len(cfg.load().names)} host(s)"):
        rows = await _with_ops(lambda o: _statuses(o, list(o.links)))
    rows = [_filtered(r, filt) for r in rows]
    if args.json:
        print(
            json.dumps(
                {
                    "hosts": [
                        {**to_builtins(r), "snapshot": snapshot_json(r.snapshot, args.show_secrets) if r.snapshot else None} for r in rows
                    ],
                    "unreachable": [{"host": r.host, "error": r.error} for r in rows if not r.snapshot],
                }
            )
        )
    else:
        parts = []
        for r in rows:
            if r.snapshot:
                parts.append(format_status(r.snapshot, r.host))
            else:
                parts.append(f"host {r.host}  UNREACHABLE: {why_down(r.host, r.error)}")
        print(terminal_text("\n\n".join(parts)))
    down = unreachable_exit([(r.host, r.error) for r in rows if not r.snapshot])
    return down or nothing_matched(filt, [r.snapshot for r in rows if r.snapshot])


def intent_from_args(args: argparse.Namespace) -> LaunchIntent:
    """The launch/preflight options as an intent (every field is checked by the operations layer)."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip()) if args.hosts else ()
    return LaunchIntent(
        host=args.host or cfg.LOCAL,
        kind=args.kind,
        argv=tuple(argv),
        gpus=args.gpus,
        nproc_per_node=args.nproc_per_node,
        start=start_of(args.fresh, args.resume),
        python=args.python,
        env=env_items(args.env),
        name=args.name,
        cwd=args.cwd,
        claims=ClaimsIntent(args.claim_gpus, args.claim_params, args.claim_world_size, args.claim_tokens_per_s, args.note),
        hosts=hosts,
        need_gib=args.need_gib,
        force=args.force,
        rdzv_port=args.rdzv_port,
        rdzv_host=args.rdzv_host,
        checkpoint_dir=args.checkpoint_dir,
        on_rank_death=args.on_rank_death,
        on_hang=args.on_hang,
        hang_after_s=args.hang_after,
        straggler_window=args.straggler_window,
        expected_ranks=args.expected_ranks,
        allow_env_diff=tuple(args.allow_env_diff),
    )


def shown_run(run: RunInfo, host: str, show_secrets: bool) -> dict[str, Any]:
    """A run as ``--json`` prints it (``run_json`` plus ``host``), its ``--env`` secrets redacted unless ``show_secrets``."""
    out = {**run_json(run), "host": host}
    return out if show_secrets else redact_run(out)


def _print_launch(result: LaunchResult, as_json: bool, show_secrets: bool = False) -> int:
    """Print a launch's outcome: the run id on stdout; what refused it on stderr."""
    if result.plan.multinode:
        return _print_multinode(result, as_json, show_secrets)
    node = result.nodes[0]
    assert node.reply is not None
    run, host = node.reply.run, node.host
    failed = run.state == "preflight_failed"
    if as_json:
        print(json.dumps({**shown_run(run, host, show_secrets), "duplicate": node.reply.duplicate}))
    elif failed:
        print(run.id)
    if failed:
        assert run.preflight is not None
        print(terminal_text(format_preflight(run.preflight)), file=sys.stderr)
        print(
            f"gpudeck: nothing was started on {host}; run {run.id} is recorded as preflight_failed (`gpudeck show {run.id}`)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if not as_json:
        print(run.id)
        if run.preflight is not None and run.preflight.forced:
            print("gpudeck: launched with --force past GPU holders (recorded with the run)", file=sys.stderr)
    return 0


def _print_multinode(result: LaunchResult, as_json: bool, show_secrets: bool) -> int:
    rid, names, ep = result.run_id, result.plan.hosts, result.plan.rdzv_endpoint
    for n in result.failed:
        if n.error is not None:
            print(terminal_text(f"gpudeck: {n.host}: {n.error}"), file=sys.stderr)
        elif n.preflight is not None:
            print(terminal_text(format_preflight(n.preflight)), file=sys.stderr)
        elif n.reply is not None and n.reply.run.preflight is not None:
            print(terminal_text(f"gpudeck: {n.host}: {format_preflight(n.reply.run.preflight)}"), file=sys.stderr)
    if result.gate is not None and result.gate.refused:
        print(
            terminal_text("\n".join("gpudeck: " + ln if i == 0 else ln for i, ln in enumerate(result.gate.refusal(rid)))), file=sys.stderr
        )
    if result.gate is not None and result.gate.refused and as_json:  # every node's values (the table shows at most 8)
        print(json.dumps({"id": rid, "verdict": result.verdict, "hosts": names, "env_gate": to_builtins(result.gate)}))
    if result.verdict == "preflight_failed" and not result.failed:
        return EXIT_ERROR
    if result.verdict == "preflight_failed":
        print(
            f"gpudeck: pre-flight failed on {', '.join(n.host for n in result.failed)}: nothing was started on any host (run {rid})",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if result.verdict == "launch_failed":
        print(f"gpudeck: run {rid} could not start on every host; the nodes that started were stopped", file=sys.stderr)
        return EXIT_ERROR
    if as_json:
        print(
            json.dumps(
                {
                    "id": rid,
                    "hosts": names,
                    "rdzv_endpoint": ep,
                    "nodes": [shown_run(n.reply.run, n.host, show_secrets) for n in result.nodes if n.reply is not None],
                }
            )
        )
    else:
        print(rid)
        print(
            f"gpudeck: {len(names)} nodes ({', '.join(names)}), {result.plan.nproc_per_node} rank(s) each, rendezvous {ep}", file=sys.stderr
        )
    if result.gate is not None and result.gate.rows:
        allowed = ", ".join(r.name for r in result.gate.rows)
        print(
            terminal_text(f"gpudeck: launched past environment differences in {allowed} (--allow-env-diff, recorded with the run)"),
            file=sys.stderr,
        )
    return 0


async def cmd_launch(args: argparse.Namespace) -> int:
    p = plan_here(intent_from_args(args))
    if args.reclaim_holders:
        if args.force:
            raise CliError("--reclaim-holders and --force: choose one (reclaim the holders, or launch past them with --force)")
        return await _launch_reclaiming(args, p)
    with waiting(f"launching on {', '.join(p.hosts)}"):
        result = await _with_ops(lambda o: o.launch(p, request_id=args.request_id or ""), hosts=p.hosts)
    return _print_launch(result, args.json, args.show_secrets)


def _step(text: str) -> None:
    """One step of reclaim-and-launch, on stderr (stdout keeps the run id or the JSON)."""
    print(terminal_text(f"gpudeck: {text}"), file=sys.stderr, flush=True)


async def _launch_reclaiming(args: argparse.Namespace, p: LaunchPlan) -> int:
    """``launch --reclaim-holders``: pre-flight; if only stale/foreign holders of yours refuse it, reclaim exactly those
    (each step printed), pre-flight again and launch (the console's "Reclaim these and launch" runs the same)."""

    async def go(ops: Ops) -> ReclaimLaunch | LaunchResult:
        _step(f"pre-flight on {', '.join(p.hosts)}")
        first = await ops.preflight(p)
        if all(o.preflight is not None and o.preflight.ok for o in first):
            _step("pre-flight passed: nothing to reclaim; launching")
            return await ops.launch(p, request_id=args.request_id or "")
        holders = await ops.plan_holders(p, first)
        _step(f"pre-flight refused the launch; {len(holders.to_stop)} process(es) to reclaim:")
        for line in holders.lines():
            _step(f"  {line}")
        return await ops.reclaim_and_launch(p, holders, request_id=args.request_id or "", grace_s=args.grace, step=_step)

    done = await _with_ops(go, hosts=p.hosts)
    if isinstance(done, LaunchResult):
        return _print_launch(done, args.json, args.show_secrets)
    if done.refused is not None or done.result is None:
        raise OpsError(f"reclaim-and-launch stopped: {done.refused}")
    return _print_launch(done.result, args.json, args.show_secrets)


async def cmd_preflight(args: argparse.Namespace) -> int:
    p = plan_here(intent_from_args(args), verb="preflight")

    async def both(ops: Ops) -> tuple[list[NodeOutcome], EnvGate | None]:
        if not p.multinode:
            return await ops.preflight(p), None
        return await asyncio.gather(ops.preflight(p), ops.gate(p.nodes))

    checks, gate = await _with_ops(both, hosts=p.hosts)
    rc = 0
    if gate is not None and gate.refused:
        rc = EXIT_ERROR
        print(terminal_text("\n".join(["gpudeck: the nodes' environments differ:", *gate.refusal()[1:]])), file=sys.stderr)
    for c in checks:
        if c.error is not None:
            print(f"gpudeck: {c.host}: {c.error}", file=sys.stderr)
            rc = EXIT_ERROR
            continue
        assert c.preflight is not None
        if not c.preflight.ok:
            rc = EXIT_ERROR
        if not args.json:
            print(format_preflight(c.preflight))
    if args.json:
        results = [to_builtins(c.preflight) for c in checks if c.preflight is not None]
        print(json.dumps(results[0] if len(results) == 1 and not p.multinode else results))
    return rc


async def cmd_reclaim(args: argparse.Namespace) -> int:
    listing, pids = reclaim_targets(args.targets)
    if listing is not None:
        found = await _with_ops(lambda o: o.leftovers(listing, include_live=args.include_live), hosts=[listing])
        if args.json:
            print(
                json.dumps(
                    {
                        "host": listing,
                        "leftovers": to_builtins(found.leftovers),
                        "gpu_error": found.gpu_error,
                        "unaccounted": to_builtins(found.unaccounted),
                    }
                )
            )
        else:
            print(terminal_text(format_leftovers(listing, found.leftovers, found.unaccounted)))
        return 0
    results = await _with_ops(lambda o: o.reclaim(pids, args.grace, args.include_live), hosts=list(pids))
    rc = 0
    out = []
    for host, res in results:
        if isinstance(res, str):
            print(f"gpudeck: {host}: {res}", file=sys.stderr)
            rc = EXIT_ERROR
            continue
        out.append({**to_builtins(res), "host": host})
        if not args.json:
            text = format_stop(res)
            print(terminal_text(f"{host}: " + text.replace("run None: ", "")))
            if res.message and res.message != text:
                print(f"  {res.message}")
        if res.survivors:
            rc = EXIT_ERROR
    if args.json:
        print(json.dumps(out))
    return rc


async def cmd_verify(args: argparse.Namespace) -> int:
    async def verify(ops: Ops) -> tuple[str, VerifyReply]:
        found = await _resolve(ops, args)
        return found.host, await ops.verify(found.host, found.id)

    host, reply = await _with_ops(verify, hosts=_host_arg(args))
    if args.json:
        print(json.dumps({"host": host, **to_builtins(reply)}))
    else:
        print(terminal_text(format_claims(reply.run_id, reply.rows, reply.alerts)))
    return EXIT_ERROR if any(r.ok is False for r in reply.rows) else 0


async def cmd_metrics(args: argparse.Namespace) -> int:
    if args.points < 1:
        raise CliError(f"--points {args.points}: give how many steps to show, 1 or more (e.g. --points 200)")

    async def read(ops: Ops) -> tuple[str, str, StepSeries]:
        found = await _resolve(ops, args)
        return found.host, found.id, await ops.metrics(found.host, found.id, max_points=args.points)

    host, rid, series = await _with_ops(read, hosts=_host_arg(args))
    if args.json:
        print(json.dumps({"host": host, "run_id": rid, **vars(series)}))
        return 0
    print(terminal_text(format_series(rid, host, series)))
    return 0


async def cmd_diff(args: argparse.Namespace) -> int:
    with Ops.recorded() as ops:
        syncs = await _synced_history(args, ops)
        down = [r.host for r in syncs if not r.ok]
        # the same records and step metrics as the console's Diff screen and Roll back dialog (ops.compare)
        pair = await ops.compare_refs(args.run_a, args.run_b, down)
    a, b = (pair.a, pair.b) if args.show_secrets else (redact_record(pair.a), redact_record(pair.b))
    d = run_diff(a, b, pair.a_metrics, pair.b_metrics)  # as the console's Diff screen: the command argument by argument too
    if args.json:
        print(
            json.dumps(
                {
                    "a": d.a_id,
                    "b": d.b_id,
                    "config": [vars(r) | {"differs": r.differs} for r in d.config],
                    "environment": [vars(r) | {"differs": r.differs} for r in d.environment],
                    "outcome": [vars(r) | {"differs": r.differs} for r in d.outcome],
                    "env_note": d.env_note,
                }
            )
        )
    else:
        print(terminal_text(format_diff(d, only_changes=not args.all)))
    return 0


class _CliRollback:
    """``gpudeck rollback``'s answers to the rollback flow: --rebuild-env decides, each step on stderr."""

    def __init__(self, rebuild_env: bool) -> None:
        self.rebuild_env = rebuild_env

    def say(self, text: str, tone: str = "info") -> None:
        print(terminal_text(f"gpudeck: {'note: ' if tone == 'warn' else ''}{text}"), file=sys.stderr)

    def waiting(self, text: str, detail: str = "") -> AbstractContextManager[object]:
        return waiting(text)

    async def rebuild(self, good_id: str, host: str, check: EnvironmentCheck) -> bool:
        return self.rebuild_env


async def _relaunch(args: argparse.Namespace, good_ref: str | None) -> int:
    check_start(start_of(args.fresh, args.resume), needed=False)  # a malformed --resume is refused before any host is asked
    with Ops.recorded() as recorded:
        syncs = await _synced_history(args, recorded)
        down = [r.host for r in syncs if not r.ok]
        # --host says where to launch, not where to look: the run is found across every host
        row = await recorded.find(args.run, None, down, good_ref is not None)  # a rollback is destructive
        good = await recorded.find(good_ref, None, down) if good_ref else None
    spec = row.launch_spec()
    # only a trainer has a start to choose (no default); a plain command runs again as it was
    started = good.launch_spec() if good is not None and args.config_from else spec
    start = check_start(start_of(args.fresh, args.resume), needed=is_trainer(started.argv, started.kind))
    host = args.host or row.host
    hosts = list(spec.nodes) if len(spec.nodes) > 1 else [host]  # a multi-node run is relaunched on all its hosts

    async def go(ops: Ops) -> LaunchResult:
        if good is None:
            intent = relaunch_intent(spec, row.id, row.host, start, to_host=host)
        else:
            intent = await ops.prepare_rollback(spec, row.id, good, host, start, args.config_from, _CliRollback(args.rebuild_env))
        plan = plan_here(intent)
        with waiting(f"launching on {', '.join(plan.hosts)}"):
            return await ops.launch(plan)

    result = await _with_ops(go, hosts=hosts)
    return _print_launch(result, args.json, args.show_secrets)


async def cmd_relaunch(args: argparse.Namespace) -> int:
    return await _relaunch(args, None)


async def cmd_rollback(args: argparse.Namespace) -> int:
    return await _relaunch(args, args.to)


async def cmd_runs(args: argparse.Namespace) -> int:
    if args.no_sync:
        return await _runs_from_history(args)
    with waiting(f"asking {len(_host_arg(args)) or len(cfg.load().names)} host(s) for their runs"):
        runs, down = await _with_ops(lambda o: o.live_runs(_host_arg(args), limit=args.limit), hosts=_host_arg(args))
    rows = group_runs(runs, unreachable={h for h, _e in down})  # JSON objects: what --json prints and the table shows
    rows = rows if args.show_secrets else [redact_run(r) for r in rows]
    if args.json:
        print(json.dumps(partial_json("runs", rows, down)))
    else:
        print(terminal_text(format_runs(rows) if rows or not down else f"no runs on the hosts that answered ({len(down)} did not)"))
    return unreachable_exit(down)


async def _runs_from_history(args: argparse.Namespace) -> int:
    """``runs --no-sync``: the runs as this machine's history last recorded them, no host asked (the same record shape
    as ``runs``; what changed since the last ``gpudeck history`` or console sync is not there)."""
    with Ops.recorded() as ops:
        records = await ops.recorded_runs([*(f"host:{h}" for h in _host_arg(args)), f"limit:{args.limit}"])
    rows = [record_shape((r if args.show_secrets else redact_record(r)).as_json()) for r in records]
    print(json.dumps(rows, default=str) if args.json else terminal_text(format_runs(rows)))
    return 0


async def _resolve(ops: Ops, args: argparse.Namespace, destructive: bool = False) -> Resolved:
    """The run ``args.run`` names (every node of it), by the one resolver; warns about hosts that did not answer."""
    found = await ops.resolve(args.run, args.host, destructive=destructive)
    if found.unanswered and found.id != args.run and not found.missing:
        print(
            f"gpudeck: note: {', '.join(found.unanswered)} did not answer; {args.run!r} was resolved on the hosts that did", file=sys.stderr
        )
    return found


async def cmd_tail(args: argparse.Namespace) -> int:
    out = sys.stdout

    async def tail(ops: Ops) -> None:
        found = await _resolve(ops, args)
        nodes, missing = found.nodes, found.missing
        if args.node is not None:
            nodes = [(h, r) for h, r in nodes if (r.spec.node_rank or 0) == args.node]
            if not nodes:
                raise CliError(f"run {args.run} has no node {args.node}")
        for h in missing:
            print(f"gpudeck: {h} (a node of this run) is not reachable: its output is missing", file=sys.stderr)
        prefix = len(nodes) > 1

        def emit(host: str, text: str) -> None:
            if prefix:
                text = "".join(f"[{host}] {ln}" for ln in text.splitlines(keepends=True))
            out.write(text if args.raw else terminal_text(text))
            out.flush()

        await ops.tail([(h, r.id) for h, r in nodes], args.lines, args.follow, emit)

    await _with_ops(tail, hosts=_host_arg(args))
    return 0


async def cmd_stop(args: argparse.Namespace) -> int:
    async def stop(ops: Ops) -> StopOutcome:
        return await ops.stop(await _resolve(ops, args, destructive=True), args.grace)

    try:
        with waiting(f"stopping {args.run}: SIGTERM sent, SIGKILL after {args.grace:g} s"):
            # the history records a stop a node did not answer (delivered when it does): it must open
            done = await _with_ops(stop, hosts=_host_arg(args), need_history=True)
    except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl-C: the agent does not stop stopping because we stopped waiting
        print(
            terminal_text(
                f"gpudeck: interrupted: the stop of {args.run} continues on the agent once it got the request (SIGTERM, "
                f"SIGKILL after {args.grace:g} s, then verified); `gpudeck show {args.run}` or `gpudeck runs` shows when it "
                "has stopped; `gpudeck stop` again is safe, and `gpudeck stop "
                f"{args.run} --grace 0` cuts the grace short (SIGKILL now)"
            ),
            file=sys.stderr,
        )
        raise
    out = [{**to_builtins(res), "host": h} for h, res in done.results]
    if args.json:
        print(
            json.dumps(out[0] if len(out) == 1 and not done.pending else {"run_id": done.run_id, "nodes": out, "unreachable": done.pending})
        )
    else:
        multi = len(done.results) + len(done.pending) > 1
        for h, res in done.results:
            print(terminal_text((f"[{h}] " if multi else "") + format_stop(res)))
        for h in done.pending:
            print(f"[{h}] UNREACHABLE: not stopped yet; it will be stopped as soon as gpudeck reaches {h} again (recorded in the history)")
    return EXIT_ERROR if done.pending or done.survivors else 0


async def cmd_hosts(args: argparse.Namespace) -> int:
    action = args.hosts_command or "list"
    if action == "add":
        for name in args.names:
            added = cfg.add_host(name)
            print(f"{name}: {'added to' if added else 'already in'} {cfg.config_path()}")
        print("check a new host with `gpudeck hosts --check` (it must be reachable as `ssh NAME` and have gpudeck installed)")
        return 0
    if action == "remove":
        rc = 0
        for gone in remove_hosts(args.names):
            if gone.found:
                print(terminal_text(gone.line(str(cfg.config_path()))))
            else:  # a typo must not read as done: a script learns nothing was removed
                print(terminal_text(f"gpudeck: {gone.line(str(cfg.config_path()))}"), file=sys.stderr)
                rc = EXIT_ERROR
        return rc
    conf = cfg.load()
    rows = [
        HostLine(name=h.name, transport="unix" if h.name == cfg.LOCAL else "ssh", command="-" if h.name == cfg.LOCAL else h.command)
        for h in conf.hosts
    ]
    if args.check:
        probes = await _with_ops(lambda o: o.probe_hosts([r.name for r in rows], args.timeout))
        rows = [
            msgspec.structs.replace(r, state=p.state, error=p.error, **({"agent_version": p.agent_version} if p.state == "up" else {}))
            for r, p in zip(rows, probes)
        ]
    if args.json:
        print(json.dumps({"config": str(conf.path), "hosts": to_builtins(rows)}))
    else:
        print(f"config: {conf.path}" + ("" if conf.path.exists() else " (not created yet: `gpudeck hosts add NAME`)"))
        print(terminal_text(format_hosts(rows)))
    return 0 if all(r.state in (UNSET, "up") for r in rows) else EXIT_ERROR


async def _synced_history(args: argparse.Namespace, ops: Ops) -> list[SyncResult]:
    """Bring ``ops``' history up to date (unless --no-sync), saying on stderr which hosts did not answer and whose
    journal was recreated."""
    if getattr(args, "no_sync", False):
        return []
    with waiting(f"syncing the history from {len(_host_arg(args)) or len(cfg.load().names)} host(s)"):
        results = await ops.sync_history(_host_arg(args), timeout=args.sync_timeout)
    for r in results:
        if not r.ok:
            print(f"gpudeck: {r.host} not reachable, its newest runs may be missing: {r.error}", file=sys.stderr)
        elif r.new_epoch and r.epoch and (story := ops.recreations(r.host, r.epoch)):
            s = story[-1]
            where = f"; the old file is kept on the host as {s['moved_to']}" if s.get("moved_to") else ""
            print(
                terminal_text(
                    f"gpudeck: {r.host}'s agent journal was recreated ({s.get('reason')}: {s.get('detail') or '-'}{where}); "
                    f"new epoch {r.epoch}, {len(s.get('runs') or [])} live run(s) re-recorded; the history keeps the old runs too"
                ),
                file=sys.stderr,
            )
        elif r.new_epoch and r.last_seq and r.new_events == r.last_seq and len(ops.epochs(r.host)) > 1:
            print(
                f"gpudeck: {r.host}'s agent journal was recreated (new epoch {r.epoch}); the history keeps the old runs too",
                file=sys.stderr,
            )
    return results


async def cmd_history(args: argparse.Namespace) -> int:
    with Ops.recorded() as ops:
        synced = await _synced_history(args, ops)
        if args.problems:
            problems = await ops.problems(args.host)
        else:
            rows = await ops.recorded_runs(args.query, with_down=True)  # each argument one term: no re-splitting
    if args.problems:
        if not args.show_secrets:
            problems = [msgspec.structs.replace(p, raw=redact_raw_event(p.raw)) for p in problems]
        print(json.dumps(to_builtins(problems)) if args.json else terminal_text(format_problems(problems)))
        return 0
    rows = rows if args.show_secrets else [redact_record(r) for r in rows]
    missed = [(r.host, r.error or "not reachable") for r in synced if not r.ok]
    if args.json:
        print(json.dumps(partial_json("runs", [record_shape(r.as_json()) for r in rows], missed), default=str))
    else:
        print(terminal_text(format_history(rows)))
    return EXIT_UNREACHABLE if missed else 0  # _synced_history named them on stderr


async def cmd_triage(args: argparse.Namespace) -> int:
    async def go(ops: Ops) -> tuple[list[tuple[str, Triage]], list[tuple[str, str]]]:
        return await ops.triage(await _resolve(ops, args))

    got, failed = await _with_ops(go, hosts=_host_arg(args))
    if args.json:
        print(
            json.dumps({"triages": [{"host": h, **to_builtins(t)} for h, t in got], "failed": [{"host": h, "error": e} for h, e in failed]})
        )
    else:
        print(terminal_text("\n\n".join(format_triage(t, h) for h, t in got)))
        for h, e in failed:
            print(terminal_text(f"gpudeck: {h}: no triage: {e}"), file=sys.stderr)
    return EXIT_ERROR if failed or not got else 0


async def cmd_show(args: argparse.Namespace) -> int:
    with Ops.recorded() as ops:
        syncs = await _synced_history(args, ops)
        run = await ops.find(args.run, args.host, [r.host for r in syncs if not r.ok])
        events = await ops.events(run.host, run.id)
        metrics = await ops.step_metrics(run.host, run.id)
    figures = run_figures(run, metrics)
    if not args.show_secrets:
        run, events = redact_record(run), redact_events(events)
    if args.json:
        # the keys `history --json` has, in its order (record_shape), then the figures and the timeline
        shape = record_shape(run.as_json(), {"tokens_per_s_median": figures.tokens_per_s})  # the median as `history` has it
        print(json.dumps({**shape, "figures": vars(figures), "events": to_builtins(events)}, default=str))
    else:
        print(terminal_text(format_show(run, events, figures)))
    return 0


async def cmd_ledger(args: argparse.Namespace) -> int:
    query = ledger_query(args.target, args.at, args.since, args.until, args.run)  # bad words: a usage error, nothing synced
    args.host = query.host
    with Ops.recorded() as ops:
        synced = await _synced_history(args, ops)
        answer = await ops.ledger(query)
    missed = [{"host": r.host, "error": r.error or "not reachable"} for r in synced if not r.ok]
    doc = {**answer.as_json(), **({"unreachable": missed} if missed else {})}
    print(json.dumps(doc) if args.json else terminal_text(format_ledger(answer)))
    return EXIT_UNREACHABLE if missed else 0  # _synced_history named them on stderr


async def cmd_report(args: argparse.Namespace) -> int:
    with Ops.recorded() as recorded:
        syncs = await _synced_history(args, recorded)
        down = [r.host for r in syncs if not r.ok]
        rep = await recorded.report(args.run, args.host, down)
        if not args.no_sync and rep.run.host not in down:  # the run's output size and last lines: its agent's
            async with Ops.request([rep.run.host], recorded=recorded, remember=False) as ops:
                rep = await ops.with_output(rep)
    print(json.dumps(report_json(rep), default=str) if args.json else terminal_text(report_markdown(rep).rstrip("\n")))
    return EXIT_UNREACHABLE if down else 0  # _synced_history named them on stderr


# ----------------------------------------------------------------------------- running a parsed command


def run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names (parsed by :func:`gpudeck.console.cli.parser.parse`); the exit code.

    Errors a user can act on are printed on stderr, one line that says what to do, with their exit code."""
    if args.command is None:
        if sys.stdout.isatty() and sys.stdin.isatty():
            from gpudeck.console.tui.app import run_console

            return run_console()
        args = parse(["status"])  # not a terminal (a pipe, a script): print the status instead
    enable_progress(not getattr(args, "json", False))  # --json is for scripts: nothing but the document
    try:
        if getattr(args, "func", None) is None:
            return int(args.sync(args) or 0)
        command: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = globals()[args.func]  # the parser names it
        return asyncio.run(command(args))
    except OpsError as exc:
        print(terminal_text(f"gpudeck: {exc.message}"), file=sys.stderr)
        return exc.exit_code
    except (CliError, cfg.ConfigError) as exc:
        print(terminal_text(f"gpudeck: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except AgentError as exc:
        print(terminal_text(f"gpudeck: {exc.message}"), file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    """The ``gpudeck`` command's console part, as ``python -m gpudeck.console.cli.main`` runs it (the script's own
    entry, :func:`gpudeck.console.entry.main`, parses before it imports this module); ``agent ...`` goes to the
    agent's own main there."""
    return entry_main(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
