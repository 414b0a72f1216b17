"""Provides the run supervisor: launch, watch, stop exactly one run, and re-adopt after a restart.

Each live run is a :class:`~gpudeck.agents.liverun.LiveRun`. A run is started through
:mod:`gpudeck.agents.shim` (see :mod:`gpudeck.agents.launcher`) into its own cgroup where the
host allows one (:mod:`gpudeck.agents.containment`); membership comes from the group,
or from the tag and parentage without one (:mod:`gpudeck.agents.membership`). Members
are recorded as ``(pid, create_time)``; nothing is signalled whose create_time
no longer matches. Stop and reclaim share one sequence (:mod:`gpudeck.agents.stopper`);
how a run ended is decided in :mod:`gpudeck.agents.exit_cause`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from gpudeck.agents import envs, stopper
from gpudeck.agents.attribution import Attribution
from gpudeck.agents.causes import cause_class, classify_output
from gpudeck.agents.containment import LABELS, Containment, RunGroup, detect
from gpudeck.agents.errors import AgentError, BadRequest, LaunchFailed, NotFound, StorageError
from gpudeck.agents.estimate import estimate_or_reason
from gpudeck.agents.exit_cause import ExitFacts, decide, read_exit_record, telemetry_evidence
from gpudeck.agents.gpus import GpuSource
from gpudeck.agents.health import Baseline, claims_report, observe
from gpudeck.agents.journal import Journal
from gpudeck.agents.launcher import LaunchPlan, check_executable, fsync_write, spawn
from gpudeck.agents.leftovers import find_leftovers
from gpudeck.agents.liverun import LiveRun
from gpudeck.agents.membership import TreeWatch, discover, proc_tree
from gpudeck.agents.preflight import failure_summary, run_preflight
from gpudeck.agents.procs import (
    CT_TOLERANCE,
    ProcTable,
    StatLine,
    alive,
    create_time_of,
    read_stat,
    signal_exact,
)
from gpudeck.agents.protocol import (
    LIVE_STATES,
    TERMINAL_STATES,
    Alert,
    ClaimRow,
    ContainmentInfo,
    EnvFingerprint,
    Event,
    Gpu,
    GpuProcess,
    LaunchSpec,
    Leftover,
    Member,
    PreflightResult,
    RunInfo,
    StoppedProcess,
    StopResult,
    new_run_id,
)

log = logging.getLogger("gpudeck.agent")

MAX_REJECTIONS_JOURNALED = 20  # per run: the first refused telemetry lines are journaled; later ones are only counted
STEP_EVENT_EVERY_S = 10.0  # step records reach the journal at most this often per run (all other records always)
RANK_DEATH_STOP_GRACE_S = 30.0  # --on-rank-death stop: the grace the survivors get to checkpoint
TAG_LIMIT = (
    "at the tag + ancestry level a process that cleared its environment and left the run's process tree, "
    "session and process group cannot be found; a cgroup (root, or a delegated cgroup v2 subtree) closes that gap"
)


def read_tail(path: Path, max_bytes: int = 64 * 1024) -> str:
    """The last bytes of a file as text ('' when missing)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


class Supervisor:
    """Owns every run on this host: launch, membership, exit, stop, re-adoption."""

    def __init__(
        self,
        journal: Journal,
        runs_dir: Path,
        host: str,
        gpus: GpuSource,
        procs: ProcTable | None = None,
        on_event: Callable[[Event], None] | None = None,
        containment: Containment | None = None,
    ) -> None:
        self.journal = journal
        self.runs_dir = Path(runs_dir)
        self.host = host
        self.gpus = gpus
        self.procs = procs if procs is not None else ProcTable()
        self._on_event = on_event or (lambda ev: None)
        self.containment = containment if containment is not None else detect(self.runs_dir)
        self.uid = os.getuid()
        self._live: dict[str, LiveRun] = {}
        self._ended_ids: set[str] = set()  # ended runs whose members may linger (STALE)
        self._ended_groups: dict[str, RunGroup] = {}  # groups of ended runs that still hold processes (leftovers)
        self._stopping: dict[str, asyncio.Task] = {}  # live and ended runs alike (a stop of an ended run reclaims)
        self._launch_lock = asyncio.Lock()
        self._bg: set[asyncio.Task] = set()
        self.attribution = Attribution(self.containment, self.run_state)
        self.adopt_notes: list[str] = []
        self._tree = TreeWatch()  # the tick's parentage for tag-level runs: what changed, not the whole host
        # fills in a GPU process's attribution (RUN/STALE/FOREIGN/NO_SUCH_PROCESS); set by the agent
        self.attribute: Callable[[GpuProcess], None] = lambda p: None
        log.info("containment: %s", self.containment.label)

    # ------------------------------------------------------------------ journal helpers

    def _emit(self, ev: Event | None) -> None:
        if ev is not None:
            self._on_event(ev)

    def _emit_many(self, items: list[tuple[str, str | None, dict]], what: str) -> None:
        try:
            for ev in self.journal.append_many(items):
                self._emit(ev)
        except StorageError:
            log.warning("could not journal %s", what)

    def _set(self, run: RunInfo, event_kind: str | None, event_data: dict | None = None, **fields: object) -> None:
        new_state = fields.get("state")
        if run.state in TERMINAL_STATES and new_state is not None and new_state not in TERMINAL_STATES:
            # an ended run never comes back to life in the journal: that would be a run nobody supervises
            log.error("run %s: refusing %s -> %s (the run has ended)", run.id, run.state, new_state)
            return
        if event_kind == "run_state":
            # the event carries what a replica (the console's history) needs to rebuild the run row
            event_data = dict(event_data or {})
            for key in ("started", "ended"):
                if fields.get(key) is not None:
                    event_data.setdefault(key, fields[key])
            state = str(fields.get("state", run.state))
            if state in TERMINAL_STATES:
                event_data.setdefault("cause_class", cause_class(state, str(fields.get("cause", run.cause) or "")))
        ev = self.journal.update_run(run.id, event_kind, event_data, **fields)
        for k, v in fields.items():
            setattr(run, k, v)
        if run.state in TERMINAL_STATES:
            lr = self._live.pop(run.id, None)
            self._ended_ids.add(run.id)
            if lr is not None and lr.group is not None:
                self._settle_group(run.id, lr.group)
            self._reindex()
        self._emit(ev)

    def _settle_group(self, run_id: str, group: RunGroup) -> str | None:
        """Remove an ended run's group when empty; keep it (its processes are leftovers) otherwise. None when removed."""
        if group.populated():
            self._ended_groups[run_id] = group
            return f"{group.path} kept: {len(group.pids())} process(es) still in it (leftovers: `gpudeck reclaim {self.host}`)"
        why = group.remove()
        if why is None:
            self._ended_groups.pop(run_id, None)
            self.containment.release()  # this agent's own group goes with its last run's (refused while any remains)
        else:
            self._ended_groups[run_id] = group
        return why

    def _reindex(self) -> None:
        self.attribution.index({rid: lr.info.members for rid, lr in self._live.items()})

    def live_runs(self) -> list[RunInfo]:
        """Runs that are not over, as the supervisor tracks them."""
        return [lr.info for lr in self._live.values()]

    def run_state(self, run_id: str) -> str | None:
        """State of a run this agent knows; None for an unknown id."""
        lr = self._live.get(run_id)
        if lr is not None:
            return lr.info.state
        if run_id in self._ended_ids:
            return "ended"
        r = self.journal.get_run(run_id)
        if r is None:
            return None
        if r.state in TERMINAL_STATES:
            self._ended_ids.add(run_id)
        return r.state

    def _with_containment(self, run: RunInfo) -> RunInfo:
        lr = self._live.get(run.id)
        if lr is not None:
            return lr.info
        if run.containment is None:
            ev = self.journal.last_event(run.id, "containment")
            if ev is not None:
                try:
                    run.containment = msgspec.convert(ev.data.get("containment", {}), ContainmentInfo)
                except msgspec.ValidationError:
                    pass
        return run

    def resolve(self, ref: str) -> RunInfo:
        """A run by id, unique id prefix, or name; NotFound/BadRequest say what to do."""
        run = self.journal.get_run(ref)
        if run is not None:
            return self._with_containment(run)
        matches = self.journal.find_runs(ref)
        if not matches:
            raise NotFound(f"no run {ref!r} on {self.host}: `gpudeck runs` lists the runs")
        if len(matches) > 1:
            ids = ", ".join(m.id for m in matches[:5])
            raise BadRequest(f"{ref!r} matches {len(matches)} runs ({ids}): give more of the id")
        return self._with_containment(matches[0])

    # ------------------------------------------------------------------ GPU attribution

    def _attribute(self, p: GpuProcess) -> None:
        self.attribute(p)
        self.attribution.correct(p, self.procs.get(p.pid))

    def attributed_gpus(self, gpus: list[Gpu] | None = None) -> list[Gpu]:
        """One GPU sample (or ``gpus``) with every process attributed (call on the agent's loop thread)."""
        if gpus is None:
            gpus = self.gpus.sample()
        for g in gpus:
            for p in g.processes:
                self._attribute(p)
        return gpus

    # ------------------------------------------------------------------ launch

    async def preflight(self, spec: LaunchSpec, host_name: str | None = None, plan: LaunchPlan | None = None) -> PreflightResult:
        """Every pre-flight check of ``spec`` here; nothing is started. ``host_name``: what the client calls this host."""
        plan = plan or LaunchPlan.of(spec)
        gpus = self.attributed_gpus() if self.gpus.available else []
        ended: dict[str, RunInfo] = {}
        for g in gpus:
            for p in g.processes:
                if p.run_id and p.run_id not in ended:
                    r = self.journal.get_run(p.run_id)
                    if r is not None:
                        ended[p.run_id] = r
        run_env = plan.base_env
        est, why = await asyncio.to_thread(estimate_or_reason, spec)
        return await asyncio.to_thread(
            run_preflight,
            spec,
            host=host_name or self.host,
            gpus=gpus,
            gpu_error=self.gpus.error,
            ended=ended,
            estimate=est,
            estimate_error=why,
            python_check=lambda py: envs.check_imports_torch(py, env=run_env),
        )

    def fingerprint_for(self, spec: LaunchSpec, plan: LaunchPlan | None = None) -> EnvFingerprint | None:
        """The run's python environment, fingerprinted (None when the run is not a python program)."""
        python = (plan or LaunchPlan.of(spec)).python
        if python is None:
            return None
        try:
            return envs.fingerprint(python, driver=self.gpus.driver_version)
        except AgentError as exc:
            return EnvFingerprint(python=python, error=exc.message, taken=time.time())

    async def launch(self, spec: LaunchSpec, request_id: str = "", host_name: str | None = None) -> tuple[RunInfo, bool]:
        """Pre-flight, then start a run; returns (run, duplicate). A known request_id returns its first run.

        A failed pre-flight starts nothing; the run is recorded as ``preflight_failed`` with the reasons.
        """
        plan = LaunchPlan.of(spec)  # validated, its argv parsed and its environment built: once
        async with self._launch_lock:
            if request_id:
                earlier = self.journal.run_by_request(request_id)
                if earlier is not None:
                    return self._with_containment(earlier), True
            if spec.run_id is not None and self.journal.get_run(spec.run_id) is not None:
                raise BadRequest(f"run {spec.run_id} already exists on {self.host}")
            pf = await self.preflight(spec, host_name, plan)
            if not pf.ok:
                return await self._record_preflight_failed(spec, request_id, pf), False
            env = await asyncio.to_thread(self.fingerprint_for, spec, plan)
            return await self._launch_new(plan, request_id, pf, env)

    async def _record_preflight_failed(self, spec: LaunchSpec, request_id: str, pf: PreflightResult) -> RunInfo:
        now = time.time()
        cause = failure_summary(pf)
        run = RunInfo(
            id=spec.run_id or new_run_id(),
            host=self.host,
            state="preflight_failed",
            spec=spec,
            name=spec.name,
            created=now,
            request_id=request_id or None,
            cause=cause,
            ended=now,
            preflight=pf,
        )
        self._emit(await self.journal.durable_create_run(run))  # on disk before the reply; the loop never waits on the disk
        self._emit_many(
            [
                ("preflight", run.id, {"result": msgspec.to_builtins(pf)}),
                ("run_state", run.id, {"state": "preflight_failed", "cause": cause, "ended": now, "cause_class": "preflight"}),
            ],
            f"run {run.id}'s pre-flight failure",
        )
        self._ended_ids.add(run.id)
        return run

    def _containment_info(self, group: RunGroup | None) -> ContainmentInfo:
        if group is not None:
            return ContainmentInfo(level="cgroupfs", label=LABELS["cgroupfs"], group=str(group.path))
        if self.containment.has_groups:  # adopted from an agent that gave it no group
            return ContainmentInfo(level="tag", label=Containment("the run was started without a cgroup").label)
        return ContainmentInfo(level="tag", label=self.containment.label)

    async def _launch_new(
        self, plan: LaunchPlan, request_id: str, pf: PreflightResult | None = None, env_fp: EnvFingerprint | None = None
    ) -> tuple[RunInfo, bool]:
        spec = plan.spec
        run_id = spec.run_id or new_run_id()
        run_dir = self.runs_dir / run_id
        now = time.time()
        run = RunInfo(
            id=run_id,
            host=self.host,
            state="starting",
            spec=spec,
            name=spec.name,
            created=now,
            request_id=request_id or None,
            run_dir=str(run_dir),
            preflight=pf,
            env=env_fp,
        )
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
            fsync_write(run_dir / "spec.json", msgspec.json.encode(spec))
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise StorageError(
                f"cannot create the run folder {run_dir} ({exc.strerror}): free space or fix permissions in {self.runs_dir}; nothing was started"
            ) from exc
        # the record exists before anything starts: a failed start is never unrecorded
        try:
            self._emit(await self.journal.durable_create_run(run))  # on disk before anything starts; the loop keeps serving meanwhile
        except StorageError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise StorageError(f"{exc.message}; nothing was started") from exc
        lr = self._live[run_id] = LiveRun(info=run, launching=True)
        try:
            return await self._start_recorded(lr, plan, run_dir, pf, env_fp)
        finally:
            lr.launching = False

    async def _start_recorded(
        self, lr: LiveRun, plan: LaunchPlan, run_dir: Path, pf: PreflightResult | None, env_fp: EnvFingerprint | None
    ) -> tuple[RunInfo, bool]:
        run = lr.info
        run_id = run.id
        spec = plan.spec
        group: RunGroup | None = None
        problem: str | None  # why the launch cannot go on, or None
        if self.containment.has_groups:
            try:
                group = self.containment.create(run_id)
            except OSError as exc:
                problem = f"cannot create the run's cgroup under {getattr(self.containment, 'base', '?')} ({exc.strerror}); set GPUDECK_CONTAINMENT=tag to run without one"
                self._fail_launch(run, problem)
                raise LaunchFailed(f"{problem}; run {run_id} is recorded as failed") from exc
        lr.group = group
        run.containment = self._containment_info(group)
        extra: list[tuple[str, str | None, dict]] = [("containment", run_id, {"containment": msgspec.to_builtins(run.containment)})]
        if pf is not None:
            extra.append(("preflight", run_id, {"result": msgspec.to_builtins(pf)}))
        if env_fp is not None:
            extra.append(("env_fingerprint", run_id, {"env": msgspec.to_builtins(env_fp)}))
        self._emit_many(extra, f"run {run_id}'s containment/pre-flight/environment records")

        env = plan.run_env(run_id, run_dir)
        # a cwd on a hung NFS/FUSE mount must not freeze the agent: the checks run off the event loop
        try:
            problem = await asyncio.wait_for(asyncio.to_thread(check_executable, spec, env, self.host), 20.0)
        except TimeoutError:
            problem = f"checking the working directory {spec.cwd} and {spec.argv[0]!r} did not return within 20 s (a hung file system?)"
        if problem is not None:
            self._fail_launch(run, problem)
            raise LaunchFailed(f"{problem}; run {run_id} is recorded as failed")
        try:
            pid, shim = await asyncio.to_thread(self._spawn, run, env)
        except LaunchFailed as exc:
            self._fail_launch(run, exc.message)
            raise LaunchFailed(f"{exc.message}; run {run_id} is recorded as failed") from exc
        lr.shim = shim
        now = time.time()
        members = [Member(pid=shim.pid, create_time=create_time_of(shim.pid) or 0.0, role="shim", first_seen=now, cmdline=["gpudeck-shim"])]
        leader_ct = create_time_of(pid)
        if leader_ct is not None:
            members.append(
                Member(
                    pid=pid,
                    create_time=leader_ct,
                    role="leader",
                    first_seen=now,
                    cmdline=list(spec.argv),
                    found_by="cgroup" if group else "tag",
                )
            )
        self._set(run, "run_state", {"state": "running", "pid": pid}, state="running", started=time.time(), members=members)
        self._reindex()
        return run, False

    def _spawn(self, run: RunInfo, env: dict[str, str]) -> tuple[int, subprocess.Popen]:
        lr = self._live.get(run.id)
        return spawn(run, env, lr.group if lr is not None else None)

    def _fail_launch(self, run: RunInfo, cause: str) -> None:
        self._set(
            run,
            "run_state",
            {"state": "failed", "cause": f"launch failed: {cause}"},
            state="failed",
            cause=f"launch failed: {cause}",
            ended=time.time(),
        )

    # ------------------------------------------------------------------ watching

    def _needs_tree(self) -> bool:
        return any(lr.group is None and lr.info.state in ("running", "starting") and not lr.launching for lr in self._live.values())

    def _scan(
        self, want_tree: bool, want_gpus: bool, members: list[Member]
    ) -> tuple[dict[int, StatLine] | None, list[Gpu] | None, dict[tuple[int, float], bool]]:
        """The parts of a tick that read the whole host: parentage (tag-level runs only), one GPU sample, whether each member lives."""
        tree = self._tree.scan() if want_tree else None
        gpus = self.gpus.sample() if want_gpus and self.gpus.available else None
        alive_now = {(m.pid, m.create_time): alive(m.pid, m.create_time) for m in members}
        return tree, gpus, alive_now

    def _scan_args(self) -> tuple[bool, bool, list[Member]]:
        members = [m for lr in self._live.values() for m in lr.info.members]
        return self._needs_tree(), bool(self._live) and self.gpus.available, members

    def refresh(self) -> None:
        """One supervision tick, all on the calling thread (tests, benchmarks; the agent uses :meth:`tick`)."""
        self.procs.refresh()
        self._judge(*self._scan(*self._scan_args()))

    async def tick(self) -> None:
        """One supervision tick; the full scans, the NVML sample and the members' liveness run in a thread, off the event loop."""
        self.procs.refresh()  # incremental: one listdir in the steady state (the table has one writer: this loop)
        scanned = await asyncio.to_thread(self._scan, *self._scan_args())
        self._judge(*scanned)  # back on the loop: request handlers may have changed runs meanwhile, so judge what is there now

    def _judge(
        self, tree: dict[int, StatLine] | None, raw_gpus: list[Gpu] | None, alive_now: dict[tuple[int, float], bool] | None = None
    ) -> None:
        gpus: list[Gpu] | None = None
        for lr in list(self._live.values()):
            run = lr.info
            if run.state not in ("running", "starting", "stopping") or run.id not in self._live:
                continue
            self._poll_telemetry(lr)
            if run.id in self._stopping or lr.launching:
                continue
            self._discover(lr, tree)
            if not self._run_alive(lr):
                self._finish(lr)
                continue
            if gpus is None:
                gpus = self.attributed_gpus(raw_gpus) if raw_gpus is not None else []
            self._check_health(lr, gpus, alive_now or {})
        for rid, group in list(self._ended_groups.items()):
            if not group.populated():
                self._settle_group(rid, group)

    # ------------------------------------------------------------------ membership

    def _discover(self, lr: LiveRun, tree: dict[int, StatLine] | None) -> bool:
        run = lr.info
        if lr.group is None and tree is None:
            tree = proc_tree()
        d = discover(run, self.procs, lr.group, tree, self.uid)
        info = run.containment
        if info is not None:
            if lr.group is not None:
                info.untagged = sorted(set(info.untagged) & set(lr.group.pids()) | set(d.untagged))
                f = lr.group.figures()
                info.cpu_seconds, info.memory_peak_bytes, info.oom_kills, info.figures_note = (
                    f.cpu_seconds,
                    f.memory_peak_bytes,
                    f.oom_kills,
                    f.note,
                )
            info.outside = d.outside
            info.other_uid = d.other_uid
            for r in d.outside + d.other_uid:
                if r.pid not in lr.reported_pids:
                    lr.reported_pids.add(r.pid)
                    log.warning("run %s: pid %d %s", run.id, r.pid, r.why)
        if not d.new and not d.updated:
            return False
        # workers that came and went (shell helpers, finished DataLoader workers) leave the list;
        # the journal's "members" events keep their history
        members = [m for m in run.members if m.role in ("shim", "leader") or alive(m.pid, m.create_time)] + d.new

        def brief(ms: list[Member]) -> list[dict]:
            out = []
            for m in ms:
                b: dict = {"pid": m.pid, "rank": m.rank, "local_rank": m.local_rank, "cmdline": m.cmdline[:8]}
                if m.found_by:
                    b["found_by"] = m.found_by
                if not m.tagged:
                    b["tagged"] = False
                out.append(b)
            return out

        data = {"added": brief(d.new)}
        if d.updated:
            data["updated"] = brief(d.updated)  # members already journaled, now with their rank: replaced, not added
        self._set(run, "members", data, members=members)
        self._reindex()
        return True

    def _run_alive(self, lr: LiveRun) -> bool:
        if lr.shim is not None:
            return lr.shim.poll() is None
        m = lr.member("shim") or lr.member("leader")
        if m is None:  # only tagged workers are known (the agent died while starting it)
            return any(alive(x.pid, x.create_time) for x in lr.info.members)
        return alive(m.pid, m.create_time)

    def _poll_shims(self) -> None:
        # reap our own children (the shims) so none lingers as a zombie
        for lr in self._live.values():
            if lr.shim is not None:
                lr.shim.poll()

    # ------------------------------------------------------------------ health (failures 4 and 7)

    def _check_health(self, lr: LiveRun, gpus: list[Gpu], alive_now: dict[tuple[int, float], bool]) -> None:
        run = lr.info
        health = lr.health_state()

        def is_alive(m: Member) -> bool:
            known = alive_now.get((m.pid, m.create_time))
            return alive(m.pid, m.create_time) if known is None else known

        obs = observe(run, time.time(), gpus, is_alive, stopping=run.state == "stopping")
        lr.last_obs = obs
        raised = health.update(obs, self._baseline(lr))
        cleared = health.cleared_since_last()
        if raised or cleared:
            items: list[tuple[str, str | None, dict]] = [("alert", run.id, {"alert": msgspec.to_builtins(a)}) for a in raised]
            items += [("alert_cleared", run.id, {"alert": msgspec.to_builtins(a)}) for a in cleared]
            self._emit_many(items, f"run {run.id}'s {len(items)} alert event(s)")
            for a in raised:
                log.warning("run %s: %s", run.id, a.message)
                if a.kind == "rank_exited" and lr.first_death is None:
                    lr.first_death = a
        run.alerts = health.active
        if health.wants_stop and run.id not in self._stopping:
            death = lr.first_death
            why = f"a rank died ({death.message.split(':')[0]})" if death else "a rank died"
            self._spawn_bg(
                self.stop(
                    run.id, RANK_DEATH_STOP_GRACE_S, reason=f"stopped by gpudeck: {why} and the run was launched with --on-rank-death stop"
                )
            )

    def _spawn_bg(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _baseline(self, lr: LiveRun) -> Baseline | None:
        """The median throughput of the newest earlier run with the same config (looked up once per run)."""
        if lr.baseline_known():
            return lr.baseline_value()
        tel = lr.info.telemetry
        if tel is None or not tel.config_hash:
            return None  # not known yet: look again next tick
        found = self.journal.throughput_baseline(tel.config_hash, tel.world_size, exclude=lr.id)
        lr.baseline = Baseline(run_id=found[0], median_tokens_per_s=found[1], config_hash=tel.config_hash) if found else None
        return lr.baseline_value()

    def verify(self, ref: str) -> tuple[RunInfo, list[ClaimRow]]:
        """Claims vs observed: live from the last observation, or as recorded when the run ended."""
        run = self.resolve(ref)
        lr = self._live.get(run.id)
        if lr is not None and lr.last_obs is not None:
            return run, claims_report(lr.last_obs)
        ev = self.journal.last_event(run.id, "claims")
        if ev is not None:
            return run, [msgspec.convert(r, ClaimRow) for r in ev.data.get("rows", [])]
        if run.state in LIVE_STATES:
            gpus = self.attributed_gpus() if self.gpus.available else []
            return run, claims_report(observe(run, time.time(), gpus, lambda m: alive(m.pid, m.create_time)))
        return run, []

    def _record_claims(self, lr: LiveRun | None) -> None:
        if lr is None or lr.last_obs is None:
            return
        try:
            rows = claims_report(lr.last_obs)
            self._emit(self.journal.append("claims", lr.id, {"rows": msgspec.to_builtins(rows)}))
        except (StorageError, Exception):  # the claims are a report; never let them block the end of a run
            log.exception("run %s: claims report failed", lr.id)

    def poll_telemetry(self, run: RunInfo) -> None:
        """Fold new telemetry into a live run's summary; journal what history needs, exactly once."""
        lr = self._live.get(run.id)
        if lr is not None:
            self._poll_telemetry(lr)

    def _poll_telemetry(self, lr: LiveRun) -> None:
        run = lr.info
        if lr.tail is None:
            last = self.journal.last_event(run.id, "telemetry")
            lr.journaled_offset = int(last.data.get("offset", 0)) if last else 0
        tail = lr.telemetry_tail()
        records = tail.poll(final=run.state not in ("starting", "running", "stopping"))
        run.telemetry = tail.summary
        items: list[tuple[str, str | None, dict]] = []
        for rej in tail.take_rejections():
            tail.summary.last_rejection = rej.describe()
            if lr.rejections_journaled < MAX_REJECTIONS_JOURNALED:
                lr.rejections_journaled += 1
                items.append(("telemetry_rejected", run.id, {"line": rej.line, "offset": rej.offset, "reason": rej.reason[:500]}))
        if not records and not items:
            return
        floor = lr.journaled_offset
        now = time.monotonic()
        for rec, offset in records:
            if offset <= floor or rec.get("type") == "heartbeat":
                continue
            if rec.get("type") == "step":
                if now - lr.last_step_event < STEP_EVENT_EVERY_S:
                    continue
                lr.last_step_event = now
            items.append(("telemetry", run.id, {"record": rec, "offset": offset}))
        if items:
            for ev in self.journal.append_many(items):
                self._emit(ev)
            offsets = [d["offset"] for kind, _r, d in items if kind == "telemetry"]
            if offsets:
                lr.journaled_offset = offsets[-1]

    # ------------------------------------------------------------------ the end of a run

    def _finish(self, lr: LiveRun, *, agent_was_down: bool = False, stopped_cause: str | None = None) -> None:
        run = lr.info
        self._poll_telemetry(lr)  # the last records (done, error) before the run is closed
        # the shim is let go only once the end is journaled: a journal that cannot be written now (disk full)
        # must not cost the exit code on the next try
        if lr.shim is not None:
            lr.shim.poll()
        tail = read_tail(Path(run.run_dir or "") / "output.log")
        figures = lr.group.figures() if lr.group is not None else None
        health = lr.health
        facts = ExitFacts(
            record=read_exit_record(run.run_dir),
            shim_returncode=lr.shim.returncode if lr.shim is not None else None,
            output_tail=tail,
            output_reason=classify_output(tail),
            telemetry_evidence=telemetry_evidence(read_tail(Path(run.run_dir or "") / "telemetry.jsonl", 16 * 1024)),
            agent_was_down=agent_was_down,
            first_death=lr.first_death,
            first_gone=health.first_gone(run) if health is not None and lr.first_death is None else None,
            group_oom_kills=figures.oom_kills if figures is not None else None,
            stopped_cause=stopped_cause,
        )
        end = decide(run, facts)
        if end.node_death is not None:
            self._node_death_alert(run, end.node_death, end.cause)
        lingering = [m for m in run.members if m.role != "shim" and alive(m.pid, m.create_time)]
        data: dict = {"state": end.state, "cause": end.cause, "exit_code": end.exit_code, "signal": end.signal}
        if lingering:
            data["lingering"] = [m.pid for m in lingering]
        if run.containment is not None:
            if figures is not None:
                c = run.containment
                c.cpu_seconds, c.memory_peak_bytes, c.oom_kills, c.figures_note = (
                    figures.cpu_seconds,
                    figures.memory_peak_bytes,
                    figures.oom_kills,
                    figures.note,
                )
            data["containment"] = msgspec.to_builtins(run.containment)
        self._record_claims(lr)
        self._set(run, "run_state", data, state=end.state, cause=end.cause, exit_code=end.exit_code, signal=end.signal, ended=end.ended)
        lr.shim = None

    def _node_death_alert(self, run: RunInfo, gone: tuple[int, int, float], cause: str) -> None:
        """A multi-node member whose rank died and whose torchrun tore the node down before the health tick's grace:
        the other nodes go on (until their collectives fail), so this is the rank-death alert, raised as the node ends."""
        rank, pid, since = gone
        node = f"node {run.spec.node_rank}" if run.spec.node_rank is not None else "this node"
        alert = Alert(
            kind="rank_exited",
            severity="critical",
            ts=time.time(),
            rank=rank,
            pid=pid,
            message=f"rank {rank} (pid {pid}) died on {node} ({self.host}), which then ended: {cause}; the other nodes lose their peer; "
            f"`gpudeck stop {run.id}`, then relaunch",
            data={"node_rank": run.spec.node_rank, "gone_since": round(since, 3), "member_ended": True},
        )
        self._emit_many([("alert", run.id, {"alert": msgspec.to_builtins(alert)})], f"run {run.id}'s node-death alert")
        log.warning("run %s: %s", run.id, alert.message)

    # ------------------------------------------------------------------ re-adoption

    def _group_of(self, run: RunInfo) -> RunGroup | None:
        """The run's group, as its containment record names it (or by its name under this agent's group)."""
        info = run.containment
        if info is not None and info.group:
            p = Path(info.group)
            return RunGroup(p, run.id) if p.is_dir() else None
        return self.containment.group(run.id) if self.containment.has_groups else None

    def adopt(self) -> list[str]:
        """After an agent (re)start: take over live runs, settle runs that ended meanwhile, tidy this agent's groups."""
        self.procs.refresh(full=True)
        notes: list[str] = []
        tree = proc_tree()
        for run in self.journal.list_runs(limit=100000, states=LIVE_STATES):
            run = self._with_containment(run)
            lr = self._live[run.id] = LiveRun(info=run, group=self._group_of(run))
            if run.containment is None:  # a run an older agent started: it has what the tag gives
                run.containment = self._containment_info(None) if lr.group is None else self._containment_info(lr.group)
            if run.state == "starting" and not run.members and not self.procs.tagged(run.id) and not (lr.group and lr.group.populated()):
                # the agent died between the record and the start, and no process carries the tag
                self._set(
                    run,
                    "run_state",
                    {"state": "failed", "cause": "launch interrupted: the agent stopped while starting it"},
                    state="failed",
                    cause="launch interrupted: the agent stopped while starting it; nothing was started",
                    ended=time.time(),
                )
                notes.append(f"{run.id}: launch interrupted")
                continue
            self._discover(lr, tree)
            # a stop under way is finished while anything of the run lives (its leader may be gone, a deaf worker not)
            stop_left = run.state == "stopping" and (
                any(alive(m.pid, m.create_time) for m in run.members if m.role != "shim") or (lr.group is not None and lr.group.populated())
            )
            if stop_left or self._run_alive(lr) or any(alive(m.pid, m.create_time) for m in run.members if m.role == "leader"):
                if run.state == "stopping":
                    ev = self.journal.last_event(run.id, "run_state")
                    data = ev.data if ev is not None and ev.data.get("state") == "stopping" else {}
                    lr.resume_stop_started = float(data.get("stop_started") or (ev.ts if ev is not None and data else time.time()))
                    notes.append(f"{run.id}: stop was in progress ({time.time() - lr.resume_stop_started:.1f} s ago); finishing it")
                    self._set(run, "run_adopted", {"state": run.state, "resume_stop": True, "stop_started": lr.resume_stop_started})
                else:
                    self._set(
                        run,
                        "run_adopted",
                        {"state": "running", "containment": run.containment.label if run.containment else None},
                        state="running",
                    )
                    notes.append(f"{run.id}: re-adopted ({run.containment.label if run.containment else 'tag'})")
            else:
                was_stopping = run.state == "stopping"
                self._finish(
                    lr,
                    agent_was_down=True,
                    stopped_cause="stopped by operator (the stop finished while the agent was down)" if was_stopping else None,
                )
                notes.append(f"{run.id}: ended while the agent was down ({run.state})")
        for run in self.journal.list_runs(limit=2000, states=TERMINAL_STATES):
            self._ended_ids.add(run.id)
        notes += self._tidy_groups()
        self._reindex()
        self.adopt_notes = notes
        return notes

    def _tidy_groups(self) -> list[str]:
        """Remove the empty groups of ended runs; keep those still holding processes; report, never delete, unknown ones."""
        notes = []
        for rid, group in self.containment.groups().items():
            if rid in self._live:
                continue
            known = self.journal.get_run(rid)
            if known is None:
                n = len(group.pids())
                msg = f"unknown cgroup {group.path} ({n} process(es)): no run {rid} in this agent's journal; left as it is"
                log.warning(msg)
                notes.append(msg)
                continue
            why = self._settle_group(rid, group)
            if why is not None:
                notes.append(f"{rid}: {why}")
        return notes

    def pending_stops(self) -> list[RunInfo]:
        """Runs left in ``stopping`` by an earlier agent; the server finishes those stops."""
        return [lr.info for lr in self._live.values() if lr.info.state == "stopping"]

    # ------------------------------------------------------------------ stop

    async def stop(self, ref: str, grace_s: float = 30.0, reason: str = "stopped by operator") -> StopResult:
        """Stop one run entirely and verify; concurrent stops of the same run share one result."""
        if grace_s < 0 or grace_s > 3600:
            raise BadRequest(f"grace {grace_s} s is out of range: give 0 to 3600 seconds")
        run = self.resolve(ref)
        task = self._stopping.get(run.id)
        if task is None:
            task = asyncio.ensure_future(self._stop(run, grace_s, reason))
            self._stopping[run.id] = task
            rid = run.id
            task.add_done_callback(lambda _t: self._stopping.pop(rid, None))
        return await asyncio.shield(task)

    async def _members_now(self, run: RunInfo, group: RunGroup | None, lr: LiveRun | None, full: bool = True) -> list[Member]:
        """A fresh look at the run's processes (``full``: every pid's identity checked again): recorded members plus what is found now."""
        self.procs.refresh(full=full)
        tree = None if group is not None else await asyncio.to_thread(proc_tree)
        if lr is not None:
            self._discover(lr, tree)
            return list(run.members)
        d = discover(run, self.procs, group, tree, self.uid)
        run.members = list(run.members) + d.new
        return list(run.members)

    async def _stop(self, run: RunInfo, grace_s: float, reason: str = "stopped by operator") -> StopResult:
        t0 = time.monotonic()
        was_terminal = run.state in TERMINAL_STATES
        lr = self._live.get(run.id)
        if lr is None and not was_terminal:
            lr = self._live[run.id] = LiveRun(info=run, group=self._group_of(run))
        group = lr.group if lr is not None else (self._ended_groups.get(run.id) or self._group_of(run))
        result = StopResult(
            run_id=run.id, state="stopping", containment=(run.containment.label if run.containment else self._containment_info(group).label)
        )
        stop_started = time.time()
        grace_left = grace_s
        if lr is not None and lr.resume_stop_started is not None:
            spent = max(0.0, time.time() - lr.resume_stop_started)
            stop_started = lr.resume_stop_started
            grace_left = max(0.0, grace_s - spent)
            result.resumed_after_s = round(spent, 3)
            lr.resume_stop_started = None
        if not was_terminal:
            self._set(run, "run_state", {"state": "stopping", "grace_s": grace_s, "stop_started": stop_started}, state="stopping")
        # with a group the kernel names the members: no full re-read of every process's identity is needed
        members = await self._members_now(run, group, lr, full=group is None)
        shim_m = next((m for m in members if m.role == "shim"), None)
        targets = [m for m in members if m.role != "shim"]
        live = [m for m in targets if alive(m.pid, m.create_time)]
        if was_terminal and not live and (group is None or not group.populated()):
            if group is not None:
                self._settle_group(run.id, group)
            return StopResult(
                run_id=run.id,
                state=run.state,
                message=f"run {run.id} already ended ({run.cause}); none of its processes is alive",
                seconds=time.monotonic() - t0,
            )

        gpu_before = await asyncio.to_thread(self.gpus.memory_used) if self.gpus.available else {}

        async def rescan() -> list[Member]:
            ms = await self._members_now(run, None, lr, full=False)
            return [m for m in ms if m.role != "shim" and alive(m.pid, m.create_time)]

        t = await stopper.terminate(live, grace_left, group=group, rescan=rescan if group is None else None, poll=self._poll_shims)
        # the shim exits by itself once its child is gone; make sure it did
        if shim_m is not None:
            shim_list = [shim_m] if alive(shim_m.pid, shim_m.create_time) else []
            if shim_list and not await stopper.wait_gone(shim_list, 2.0, None):
                signal_exact(shim_m.pid, shim_m.create_time, signal.SIGKILL)
                await stopper.wait_gone(shim_list, 2.0, None)
            if lr is not None and lr.shim is not None:
                await asyncio.to_thread(_reap, lr.shim, 2.0)
        stopper.classify(result, targets, t, report_gone=lambda m: m.role == "leader")
        info = run.containment
        if info is not None:
            result.reported = list(info.outside) + list(info.other_uid)
        if group is not None:
            kept = None if t.group_empty else f"{len(group.pids())} process(es) still in it"
            if kept is None:
                if lr is not None and info is not None:
                    f = group.figures()
                    info.cpu_seconds, info.memory_peak_bytes, info.oom_kills, info.figures_note = (
                        f.cpu_seconds,
                        f.memory_peak_bytes,
                        f.oom_kills,
                        f.note,
                    )
                why = (
                    self._settle_group(run.id, group) if was_terminal or lr is None else None
                )  # a live run's group goes when its end is journaled
                result.group_note = (
                    f"cgroup {group.path} emptied (populated 0)"
                    + (f" by {t.kill_how}" if t.needed_kill else "")
                    + ("" if why is None else f"; {why}")
                )
            else:
                result.group_note = f"cgroup {group.path} kept: {kept}"
        else:
            result.group_note = TAG_LIMIT
        await stopper.verify_gpu(self.gpus, result, t.signalled + targets, gpu_before)
        result.seconds = round(time.monotonic() - t0, 3)

        if was_terminal:
            result.state = run.state
            result.message = (
                f"run {run.id} had already ended ({run.cause}); its {len(t.signalled)} leftover process(es) were stopped; "
                + stopper.summary(result)
            )
            if group is not None:
                self._settle_group(run.id, group)
            self._emit(self.journal.append("reclaimed", run.id, msgspec.to_builtins(result)))
            return result
        assert lr is not None
        self._poll_telemetry(lr)
        rec = read_exit_record(run.run_dir)
        code = rec.get("returncode") if rec else None
        sig = rec.get("signal") if rec else None
        cause = reason
        if result.resumed_after_s is not None:
            cause += f"; finished by a restarted agent {result.resumed_after_s:.1f} s after the stop began ({grace_left:.1f} s of the {grace_s:g} s grace were left)"
        if result.needed_kill:
            cause += f"; {len(result.needed_kill)} process(es) ignored SIGTERM for {grace_s:g} s and needed SIGKILL"
        if result.survivors:
            cause += (
                f"; {len(result.survivors)} process(es) survived SIGKILL ({', '.join(f'{s.pid} {s.status}' for s in result.survivors)})"
            )
        if result.reported:
            cause += f"; {len(result.reported)} process(es) reported and not signalled"
        result.state = "stopped"
        self._record_claims(lr)
        data: dict = {"state": "stopped", "cause": cause, "stop": msgspec.to_builtins(result)}
        if info is not None:
            data["containment"] = msgspec.to_builtins(info)
        self._set(run, "run_state", data, state="stopped", cause=cause, exit_code=code, signal=sig, ended=time.time())
        if group is not None and t.group_empty:
            # _set removed it with the run's end; say if it could not
            if group.exists():
                result.group_note += f"; {group.path} could not be removed"
            else:
                result.group_note += " and removed"
        result.message = stopper.summary(result)
        if result.resumed_after_s is not None:
            result.message = (
                f"resumed a stop begun {result.resumed_after_s:.1f} s earlier by the previous agent ({grace_left:.1f} s of grace left); "
                + result.message
            )
        return result

    # ------------------------------------------------------------------ reclaim (failures 1-3)

    def _grouped_leftovers(self) -> dict[int, str]:
        """pid -> run id for every process in the group of an ended run (a leftover whatever its environment says)."""
        out: dict[int, str] = {}
        groups = dict(self.containment.groups())
        groups.update(self._ended_groups)
        for rid, group in groups.items():
            if rid in self._live:
                continue
            state = self.run_state(rid)
            if state is None:
                continue  # an unknown group: reported at adoption, not offered
            for pid in group.pids():
                out[pid] = rid
        return out

    async def leftovers(self, include_live: bool = False, host_name: str | None = None) -> list[Leftover]:
        """Every leftover process here (see agents/leftovers.py), with CPU % over a short sample."""
        self.procs.refresh(full=True)
        gpus = self.attributed_gpus() if self.gpus.available else []
        found = find_leftovers(
            host_name or self.host,
            self.procs,
            gpus,
            self.run_state,
            self.journal.get_run,
            include_live=include_live,
            grouped=self._grouped_leftovers(),
        )
        before = {lo.pid: read_stat(lo.pid) for lo in found}
        t0 = time.monotonic()
        await asyncio.sleep(0.25)
        dt = time.monotonic() - t0
        for lo in found:
            a, b = before.get(lo.pid), read_stat(lo.pid)
            if a is not None and b is not None and abs(a.create_time - b.create_time) <= CT_TOLERANCE:
                lo.cpu_percent = round(100.0 * (b.cpu_seconds - a.cpu_seconds) / dt, 1)
        return found

    async def reclaim(self, pids: list[int], grace_s: float = 10.0, include_live: bool = False, host_name: str | None = None) -> StopResult:
        """Stop exactly these leftovers: TERM, grace, KILL, verify through NVML; never a live run's process unless asked."""
        host = host_name or self.host
        if not pids:
            raise BadRequest(
                f"name the pids to reclaim: `gpudeck reclaim {host}` lists the leftovers, `gpudeck reclaim {host}:PID` stops one"
            )
        if grace_s < 0 or grace_s > 3600:
            raise BadRequest(f"grace {grace_s} s is out of range: give 0 to 3600 seconds")
        t0 = time.monotonic()
        found = {lo.pid: lo for lo in await self.leftovers(include_live=True, host_name=host)}
        chosen: list[Leftover] = []
        for pid in dict.fromkeys(pids):
            lo = found.get(pid)
            if lo is None:
                raise BadRequest(
                    f"pid {pid} is not a leftover on {host} (not a process of an ended run, not holding GPU memory outside a run): "
                    f"reclaim stops only leftovers — `gpudeck reclaim {host}` lists them; a live run is stopped with `gpudeck stop RUN`"
                )
            if lo.kind == "live" and not include_live:
                raise BadRequest(
                    f"pid {pid} belongs to live run {lo.run_id}: `gpudeck stop {lo.run_id}` stops the whole run; to stop this one process alone add --include-live"
                )
            chosen.append(lo)
        result = StopResult(run_id=None, state="reclaimed", containment=self.containment.label)
        targets: list[Member] = []
        unsignalable: list[Leftover] = []
        for lo in chosen:
            if lo.kind == "no_such_process" or lo.create_time is None:
                unsignalable.append(lo)
            else:
                targets.append(Member(pid=lo.pid, create_time=lo.create_time, role="leftover", rank=lo.rank, cmdline=lo.cmdline[:12]))
        live = [m for m in targets if alive(m.pid, m.create_time)]
        gpu_before = await asyncio.to_thread(self.gpus.memory_used) if self.gpus.available else {}
        t = await stopper.terminate(live, grace_s, poll=self._poll_shims)
        stopper.classify(result, targets, t)
        for lo in unsignalable:
            result.survivors.append(
                StoppedProcess(pid=lo.pid, cmdline=lo.cmdline, role="leftover", how="survived", status="no such process")
            )
        await stopper.verify_gpu(self.gpus, result, targets + [Member(pid=lo.pid, create_time=0.0) for lo in unsignalable], gpu_before)
        result.seconds = round(time.monotonic() - t0, 3)
        notes = [f"pid {s.pid}: {found[s.pid].note}" for s in result.survivors] + [
            f"pid {s.pid}: {found[s.pid].note}" for s in result.stopped if s.how == "zombie"
        ]
        result.message = stopper.summary(result) + ("; " + "; ".join(notes) if notes else "")
        for rid, group in list(self._ended_groups.items()):
            if not group.populated():
                self._settle_group(rid, group)
        by_run: dict[str | None, list[int]] = {}
        for lo in chosen:
            by_run.setdefault(lo.run_id, []).append(lo.pid)
        try:
            for owner, rpids in by_run.items():
                self._emit(self.journal.append("reclaimed", owner, {"pids": rpids, **msgspec.to_builtins(result)}))
        except StorageError:
            log.warning("could not journal the reclaim of %s", pids)
        return result


def _reap(popen: subprocess.Popen, timeout: float) -> None:
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def hostname() -> str:
    """This host's short name."""
    return socket.gethostname().split(".")[0]
