"""Provides Ops, a front-end's one handle on the fleet and the history: the CLI and the console call its methods and
show what comes back; neither builds a Fleet or a History, nor talks to either.

An :class:`Ops` owns what it was built with: a CLI command's request-only fleet (:meth:`Ops.request`, closed when the
command is done), the history alone (:meth:`Ops.recorded`, for commands that read what is recorded), or the console's
long-lived fleet with its history and the multi-node rank-death policy (:meth:`Ops.console`). Each method is one
operator action or read, and each is implemented once, in the module it names (launch, holders, stop, readings, ...):
this object only hands them the fleet and the history it owns.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpudeck.console.core.records import EpochRecord, EventRecord, MetricPoint, Problem, RunRecord, SyncResult
from gpudeck.console.fleet.fleet import Fleet, HostLink
from gpudeck.console.fleet.multinode import group
from gpudeck.console.history.replica import History, HistoryError
from gpudeck.console.ops import readings as _readings
from gpudeck.console.ops import resolve as _resolve
from gpudeck.console.ops.errors import HistoryUnavailable, OpsError
from gpudeck.console.ops.resolve import LIST_LIMIT, FleetRuns, Resolved

# Each operation's module is imported by the method that runs it, not here: a command pays only for what it runs
# (`status --host H` connects before most of ops/ is loaded; issue 30). The names below are for the signatures.
if TYPE_CHECKING:
    from gpudeck.agents.wire.envdiff import EnvGate
    from gpudeck.agents.wire.protocol import LaunchSpec, LeftoverList, OutputChunk, RunInfo, Snapshot, StopResult, Triage, VerifyReply
    from gpudeck.console.ops.compare import Compared
    from gpudeck.console.ops.holders import HolderPlan, ReclaimLaunch
    from gpudeck.console.ops.hosts import Probe
    from gpudeck.console.ops.intent import LaunchIntent
    from gpudeck.console.ops.launch import LaunchPlan, LaunchResult, NodeOutcome
    from gpudeck.console.ops.ledger import LedgerAnswer, LedgerQuery
    from gpudeck.console.ops.readings import StepSeries
    from gpudeck.console.ops.report import RunReport
    from gpudeck.console.ops.rollback import RollbackFrontEnd
    from gpudeck.console.ops.stop import StopOutcome


class Ops:
    """A front-end's operations on the fleet and the history it owns (see the module docstring for the three kinds)."""

    def __init__(self, fleet: Fleet | None, history: History | None, *, owns_history: bool = False) -> None:
        self._fleet = fleet
        self._history = history
        self._owns_history = owns_history

    # ------------------------------------------------------------------ building one

    @classmethod
    def console(cls, fleet: Fleet | None = None, *, with_history: bool = False) -> Ops:
        """The console's long-lived operations: ``fleet`` (else every configured host, with a history of its own when
        ``with_history``), followed by the rank-death policy (console/ops/rank_death.py)."""
        history = History() if fleet is None and with_history else None
        fleet = fleet if fleet is not None else Fleet(history=history)
        from gpudeck.console.ops.rank_death import attach as attach_rank_death

        attach_rank_death(fleet)  # --on-rank-death stop across a multi-node run's hosts
        return cls(fleet, fleet.history, owns_history=history is not None)

    @classmethod
    @asynccontextmanager
    async def request(
        cls,
        hosts: Sequence[str] | None = None,
        *,
        recorded: Ops | None = None,
        remember: bool = True,
        need_history: bool = False,
        meanwhile: Callable[[], object] | None = None,
    ) -> AsyncIterator[Ops]:
        """A CLI command's operations on a request-only fleet (the hosts asked for, else every configured host), closed
        when the block ends.

        The fleet has the history, so a stop asked for while a host was cut off is delivered the next time any command
        reaches that host; ``recorded`` lends the history an :meth:`recorded` block holds; ``remember=False`` (a look at a host
        the config does not name) leaves the history alone, so a typo never becomes a host it remembers as unreachable.
        A history that cannot be opened is a warning on stderr (the command works without it) unless ``need_history``.
        ``meanwhile`` is called on an SSH connect while the far side starts, the longest wait (the CLI imports its
        printers there; see :func:`~gpudeck.console.fleet.transport.connect_ssh`)."""
        lent = recorded.history if recorded is not None else None
        own: History | None = None
        if lent is None and remember:
            try:
                own = History()
            except HistoryError as exc:
                if need_history:
                    raise HistoryUnavailable(str(exc)) from None
                print(f"gpudeck: warning: {exc}", file=sys.stderr)
        db = lent or own
        fleet = Fleet(hosts=list(hosts) if hosts else None, watch=False, history=db, meanwhile=meanwhile)
        try:
            yield cls(fleet, db)
        except HistoryError as exc:
            raise HistoryUnavailable(str(exc)) from None
        finally:
            await fleet.close()
            if own is not None:
                own.close()

    @classmethod
    @contextmanager
    def recorded(cls) -> Iterator[Ops]:
        """The history alone (no host is asked until :meth:`sync_history`), closed when the block ends; a history that
        cannot be opened or read is :class:`HistoryUnavailable`."""
        try:
            history = History()
        except HistoryError as exc:
            raise HistoryUnavailable(str(exc)) from None
        try:
            yield cls(None, history, owns_history=True)
        except HistoryError as exc:
            raise HistoryUnavailable(str(exc)) from None
        finally:
            history.close()

    @property
    def fleet(self) -> Fleet:
        """The fleet these operations use (handed to the ops modules; a front-end calls the methods here)."""
        if self._fleet is None:
            raise OpsError("no host is asked here: this command reads the history only")
        return self._fleet

    @property
    def history(self) -> History | None:
        """The history these operations record into and read (None: the console runs without one)."""
        return self._history

    def _db(self) -> History:
        if self._history is None:
            raise HistoryUnavailable("this console runs without a history database (`gpudeck` opens one by default)")
        return self._history

    # ------------------------------------------------------------------ the fleet's hosts

    @property
    def links(self) -> Mapping[str, HostLink]:
        """Every host's link by name (its ``status`` is what the Fleet and Host screens show)."""
        return self.fleet.links

    def start(self) -> None:
        """Connect every host (the console's fleet)."""
        self.fleet.start()

    async def close(self) -> None:
        """Close the fleet's links (the history, when owned, closes with :meth:`close_history`)."""
        if self._fleet is not None:
            await self._fleet.close()

    def close_history(self) -> None:
        """Close the history this object opened (the console's, after the app has stopped)."""
        if self._owns_history and self._history is not None:
            self._history.close()

    @property
    def config_path(self) -> Path | None:
        """The config file the fleet follows (None: built without one)."""
        config = getattr(self.fleet, "config", None)  # a fleet built without a config file has nothing to follow
        return config.path if config is not None else None

    def reload_config(self) -> tuple[list[str], list[str], list[str]]:
        """Read the config file again: (added, removed, changed) host names (ConfigError when it cannot be read)."""
        return self.fleet.reload_config()

    async def snapshot(self, host: str) -> Snapshot:
        """A host's snapshot now (AgentError when it does not answer)."""
        return await self.fleet.snapshot(host)

    async def probe_hosts(self, names: list[str], timeout: float) -> list[Probe]:
        """``hosts --check``: each host's link state, agent version or error."""
        from gpudeck.console.ops import hosts as _hosts

        return await _hosts.probe_hosts(self.fleet, names, timeout)

    # ------------------------------------------------------------------ launch, reclaim, stop

    def plan(self, intent: LaunchIntent, run_id: str | None = None, verb: str = "launch") -> LaunchPlan:
        """``intent`` planned against the config this fleet follows (its hosts' settings: env, interfaces, rendezvous
        addresses), as the CLI plans against the same file; IntentError names the field to fix."""
        from gpudeck.console.ops.launch import plan_here

        return plan_here(intent, run_id=run_id, verb=verb, conf=getattr(self.fleet, "config", None))

    async def preflight(self, plan: LaunchPlan) -> list[NodeOutcome]:
        """Every node's pre-flight of ``plan`` (nothing starts)."""
        from gpudeck.console.ops.launch import preflight as preflight_plan

        return await preflight_plan(self.fleet, plan)

    async def launch(self, plan: LaunchPlan, request_id: str = "") -> LaunchResult:
        """Launch ``plan`` (every node, or none)."""
        from gpudeck.console.ops.launch import launch as launch_plan

        return await launch_plan(self.fleet, plan, request_id=request_id)

    async def gate(self, nodes: Sequence[tuple[str, LaunchSpec]]) -> EnvGate:
        """The cross-node gate: every node's interpreter fingerprinted (together) and compared."""
        from gpudeck.console.ops.gate import check as gate_check

        return await gate_check(self.fleet, nodes)

    async def plan_holders(self, plan: LaunchPlan, outcomes: list[NodeOutcome]) -> HolderPlan:
        """The processes a refused pre-flight names, and which of them may be reclaimed."""
        from gpudeck.console.ops import holders as _holders

        return await _holders.plan_holders(self.fleet, plan, outcomes)

    async def reclaim_and_launch(
        self,
        plan: LaunchPlan,
        held: HolderPlan,
        request_id: str = "",
        grace_s: float | None = None,  # None: holders.GRACE_S
        step: Callable[[str], None] | None = None,
    ) -> ReclaimLaunch:
        """Reclaim exactly ``held.to_stop``, pre-flight again and launch (``step`` hears each step)."""
        from gpudeck.console.ops import holders as _holders

        grace = _holders.GRACE_S if grace_s is None else grace_s
        return await _holders.reclaim_and_launch(self.fleet, plan, held, request_id=request_id, grace_s=grace, step=step)

    async def leftovers(self, host: str, include_live: bool = False) -> LeftoverList:
        """A host's leftovers (stale and foreign GPU holders)."""
        return await _readings.host_leftovers(self.fleet, host, include_live=include_live)

    async def reclaim(self, pids: dict[str, list[int]], grace_s: float, include_live: bool = False) -> list[tuple[str, StopResult | str]]:
        """Stop exactly these pids on each host (verified)."""
        from gpudeck.console.ops import stop as _stop

        return await _stop.reclaim(self.fleet, pids, grace_s, include_live)

    async def stop(self, found: Resolved, grace_s: float) -> StopOutcome:
        """Stop every node of a run (a node that does not answer: recorded in the history, stopped when it does)."""
        from gpudeck.console.ops import stop as _stop

        return await _stop.stop_run(self.fleet, found, grace_s, self._history)

    # ------------------------------------------------------------------ runs: find, read

    async def resolve(self, ref: str, host: str | None = None, destructive: bool = False) -> Resolved:
        """The run a reference names, every node of it."""
        return await _resolve.resolve_run(self.fleet, ref, host, destructive=destructive)

    async def nodes_of(self, host: str, run: RunInfo) -> Resolved:
        """Every node of a run already known on ``host``."""
        return await _resolve.nodes_of(self.fleet, host, run)

    async def run(self, host: str, run_id: str) -> RunInfo:
        """A run as its agent knows it now (AgentError when it cannot say)."""
        return await self.fleet.run(host, run_id)

    async def current_run(self, host: str, run_id: str) -> RunInfo | RunRecord:
        """A run as its agent knows it now, else as the history recorded it."""
        return await _readings.current_run(self.fleet, host, run_id)

    async def fleet_runs(self, hosts: Sequence[str] | None = None, limit: int = LIST_LIMIT) -> FleetRuns:
        """Every host's (or ``hosts``') runs, asked at once."""
        return await _resolve.fleet_runs(self.fleet, hosts, limit=limit)

    async def live_runs(self, hosts: Sequence[str] | None = None, limit: int = LIST_LIMIT) -> tuple[list[RunInfo], list[tuple[str, str]]]:
        """``gpudeck runs``: every host's (or ``hosts``') runs under the fleet's host names, newest first, and the hosts
        that did not answer with why."""
        listed = await self.fleet_runs(hosts, limit=limit)
        runs = []
        for h, run in listed.runs:
            run.host = h  # the fleet's name for the host, not the agent's own hostname
            runs.append(run)
        return runs, list(listed.unanswered.items())

    async def verify(self, host: str, run_id: str) -> VerifyReply:
        """A run's claims against what its agent observes."""
        return await _readings.verify_run(self.fleet, host, run_id)

    async def triage(self, found: Resolved) -> tuple[list[tuple[str, Triage]], list[tuple[str, str]]]:
        """Every node's triage of a run now; the nodes that gave none, with why."""
        from gpudeck.console.ops import triage as _triage

        return await _triage.triage_run(self.fleet, found)

    async def metrics(self, host: str, run_id: str, max_points: int = 200) -> StepSeries:
        """A run's step metrics (its agent's, else the history's)."""
        return await _readings.run_metrics(self.fleet, host, run_id, max_points=max_points)

    def output(self, host: str, run_id: str, offset: int = 0, follow: bool = True) -> AsyncIterator[OutputChunk]:
        """A run's output from a byte offset (negative: from the end), following it while the run lives."""
        return _readings.run_output(self.fleet, host, run_id, offset=offset, follow=follow)

    async def tail(self, nodes: Sequence[tuple[str, str]], lines: int, follow: bool, emit: Callable[[str, str], None]) -> None:
        """Each node's last lines (then, with ``follow``, what comes), whole lines to ``emit(host, text)``."""
        await _readings.tail_nodes(self.fleet, nodes, lines, follow, emit)

    # ------------------------------------------------------------------ relaunch, rollback, diff

    async def prepare_rollback(
        self,
        run_spec: LaunchSpec,
        run_id: str,
        good: RunRecord,
        host: str,
        start: str | None,
        config_from: bool,
        ui: RollbackFrontEnd,
    ) -> LaunchIntent:
        """The intent that relaunches ``run_id`` in ``good``'s environment (asking ``ui`` when it needs a choice)."""
        from gpudeck.console.ops import rollback as _rollback

        return await _rollback.prepare_rollback(self.fleet, run_spec, run_id, good, host, start, config_from, ui)

    async def rollback_candidates(self, host: str, run: RunInfo) -> list[RunRecord]:
        """The recorded runs ``run`` may be rolled back to."""
        from gpudeck.console.ops import rollback as _rollback

        return await _rollback.rollback_candidates(self.fleet, host, run)

    async def compare_runs(self, a: tuple[str, str], b: tuple[str, str], live_a: RunInfo | None = None) -> Compared:
        """Two runs by (host, id), as every diff reads them."""
        from gpudeck.console.ops import compare as _compare

        return await _compare.compare_runs(self.fleet, a, b, live_a=live_a)

    async def compare_refs(self, a_ref: str, b_ref: str, unanswered: list[str] | None = None) -> Compared:
        """Two runs by reference from the history: ``gpudeck diff``."""
        from gpudeck.console.ops import compare as _compare

        return await _compare.compare_refs(self._db(), a_ref, b_ref, unanswered)

    # ------------------------------------------------------------------ the history

    @property
    def history_path(self) -> Path | None:
        """The history's file (the screens read it on connections of their own), None without a history."""
        return self._history.path if self._history is not None else None

    async def sync_history(self, hosts: Sequence[str] | None = None, timeout: float = 20.0) -> list[SyncResult]:
        """Bring the history up to date from the hosts of a request fleet for ``hosts`` (the console's own fleet: every
        host): one result per host."""
        if self._fleet is not None:
            return await self._fleet.sync_history(timeout=timeout)
        async with Ops.request(hosts, recorded=self) as live:
            return await live.fleet.sync_history(timeout=timeout)

    async def find(self, ref: str, host: str | None = None, down: Sequence[str] = (), destructive: bool = False) -> RunRecord:
        """The recorded run a reference names (``down``: hosts whose newest runs may be missing)."""
        return await asyncio.to_thread(self._db().find, ref, host, list(down), destructive)

    def find_now(self, ref: str, host: str | None = None) -> RunRecord:
        """:meth:`find`, blocking (a screen's thread worker)."""
        return self._db().find(ref, host)

    async def events(self, host: str, run_id: str) -> list[EventRecord]:
        """A recorded run's events, oldest first."""
        return await asyncio.to_thread(self._db().events, host, run_id)

    async def step_metrics(self, host: str, run_id: str) -> list[MetricPoint]:
        """A recorded run's step metrics."""
        return await asyncio.to_thread(self._db().metrics, host, run_id)

    async def problems(self, host: str | None = None) -> list[Problem]:
        """The events kept out of the history (``history --problems``)."""
        return await asyncio.to_thread(self._db().problems, host)

    async def recorded_runs(self, terms: Sequence[str], *, with_down: bool = False) -> list[RunRecord]:
        """The runs a query selects, newest first, a multi-node run once (its nodes combined); ``with_down``: a node on a
        host the history last saw unreachable is marked so."""
        rows = await asyncio.to_thread(_readings.query_history, self._db(), terms)
        return group(rows, unreachable=await self.down_hosts() if with_down else None)

    async def ledger(self, query: LedgerQuery) -> LedgerAnswer:
        """Who held a GPU when, or a run's GPU footprint, from the history's ledger (``gpudeck ledger``)."""
        from gpudeck.console.ops import ledger as _ledger

        return await asyncio.to_thread(_ledger.ledger_answer, self._db(), query)

    async def report(self, ref: str, host: str | None = None, down: Sequence[str] = ()) -> RunReport:
        """The run report of ``ref`` from the history's evidence alone (``gpudeck report``; :meth:`with_output` adds the
        run's output from its agent)."""
        from gpudeck.console.ops import report as _report

        return await asyncio.to_thread(_report.gather_report, self._db(), ref, host, list(down))

    async def with_output(self, rep: RunReport) -> RunReport:
        """``rep`` with its run's output size and last lines from its agent (the history keeps no output); when the agent
        cannot be asked, the report says why."""
        from gpudeck.console.ops import report as _report

        return await _report.with_output(self.fleet, rep)

    async def down_hosts(self) -> set[str]:
        """The hosts the history last saw not up."""
        return {h.name for h in await asyncio.to_thread(self._db().hosts) if h.state not in (None, "up")}

    def recreations(self, host: str, epoch: str) -> list[dict[str, Any]]:
        """What the history recorded of a host's journal being recreated (the new ``epoch``)."""
        return self._db().recreations(host, epoch)

    def epochs(self, host: str) -> list[EpochRecord]:
        """The journal epochs the history has seen of a host."""
        return self._db().epochs(host)
