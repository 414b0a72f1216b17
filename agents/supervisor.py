"""Provides the run supervisor: launch, watch, stop exactly one run, and re-adopt after a restart.

A run is started through :mod:`agents.shim` in a new session, with
``GPUDECK_RUN_ID`` and ``GPUDECK_TELEMETRY`` in its environment. Every process
carrying the tag is a member, found wherever it was re-parented. Members are
recorded as ``(pid, create_time)``; nothing is signalled whose create_time no
longer matches. Stop is TERM to every member, a grace period, KILL to what is
left, a wait until they are gone, then a verification through NVML that none
of them holds GPU memory any more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from agents import envs
from agents.causes import cause_class, classify_output, host_oom_note
from agents.errors import AgentError, BadRequest, LaunchFailed, NotFound, StorageError
from agents.estimate import estimate_or_reason
from agents.gpus import GpuSource
from agents.health import Baseline, Observation, RunHealth, claims_report, observe
from agents.journal import Journal
from agents.leftovers import find_leftovers
from agents.preflight import failure_summary, parse_launch_argv, run_preflight, run_python
from agents.procs import CT_TOLERANCE, ProcTable, alive, create_time_of, read_stat, signal_exact, status_of
from agents.protocol import (
    LIVE_STATES,
    MAX_ARGV,
    TERMINAL_STATES,
    Alert,
    ClaimRow,
    EnvFingerprint,
    Event,
    Gpu,
    GpuFreed,
    GpuProcess,
    LaunchSpec,
    Leftover,
    Member,
    PreflightResult,
    RunInfo,
    StoppedProcess,
    StopResult,
)
from agents.telemetry import TelemetryTail

log = logging.getLogger("gpudeck.agent")

# run as a script with -I: stdlib only, so the run's own PYTHONPATH and cwd never matter
_SHIM = str(Path(__file__).resolve().with_name("shim.py"))
SHIM_START_TIMEOUT_S = 15.0
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the kernel to take them
GPU_SETTLE_S = 5.0  # after the processes are gone, how long to wait for NVML to drop them
STEP_EVENT_EVERY_S = 10.0  # step records reach the journal at most this often per run (all other records always)
RANK_DEATH_STOP_GRACE_S = 30.0  # --on-rank-death stop: the grace the survivors get to checkpoint
_RUN_ID_RE = __import__("re").compile(r"^r-[0-9a-f]{8}$")

def new_run_id() -> str:
    """A short, unique run id such as ``r-7f3a9c21``."""
    return "r-" + uuid.uuid4().hex[:8]


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


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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
    ) -> None:
        self.journal = journal
        self.runs_dir = Path(runs_dir)
        self.host = host
        self.gpus = gpus
        self.procs = procs if procs is not None else ProcTable()
        self._on_event = on_event or (lambda ev: None)
        self._runs: dict[str, RunInfo] = {}  # live runs, mirrored from the journal
        self._ended_ids: set[str] = set()  # ended runs whose members may linger (STALE)
        self._shims: dict[str, subprocess.Popen] = {}
        self._stopping: dict[str, asyncio.Task] = {}
        self._launch_lock = asyncio.Lock()
        self._tails: dict[str, TelemetryTail] = {}
        self._journaled_offset: dict[str, int] = {}
        self._last_step_event: dict[str, float] = {}
        self._health: dict[str, RunHealth] = {}
        self._last_obs: dict[str, Observation] = {}
        self._baselines: dict[str, Baseline | None] = {}
        self._first_death: dict[str, Alert] = {}
        self._bg: set[asyncio.Task] = set()
        self._launching: set[str] = set()  # recorded, not yet spawned: the tick must not judge them (no shim yet)
        # fills in a GPU process's attribution (RUN/STALE/FOREIGN/NO_SUCH_PROCESS); set by the agent
        self.attribute: Callable[[GpuProcess], None] = lambda p: None

    # ------------------------------------------------------------------ journal helpers

    def _emit(self, ev: Event | None) -> None:
        if ev is not None:
            self._on_event(ev)

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
            self._runs.pop(run.id, None)
            self._ended_ids.add(run.id)
            self._health.pop(run.id, None)
            self._last_obs.pop(run.id, None)
            self._baselines.pop(run.id, None)
            self._first_death.pop(run.id, None)
            self._tails.pop(run.id, None)
            self._journaled_offset.pop(run.id, None)
            self._last_step_event.pop(run.id, None)
        self._emit(ev)

    def live_runs(self) -> list[RunInfo]:
        """Runs that are not over, as the supervisor tracks them."""
        return list(self._runs.values())

    def run_state(self, run_id: str) -> str | None:
        """State of a run this agent knows; None for an unknown id."""
        run = self._runs.get(run_id)
        if run is not None:
            return run.state
        if run_id in self._ended_ids:
            return "ended"
        r = self.journal.get_run(run_id)
        if r is None:
            return None
        if r.state in TERMINAL_STATES:
            self._ended_ids.add(run_id)
        return r.state

    def resolve(self, ref: str) -> RunInfo:
        """A run by id, unique id prefix, or name; NotFound/BadRequest say what to do."""
        run = self.journal.get_run(ref)
        if run is not None:
            return self._runs.get(run.id, run)
        matches = self.journal.find_runs(ref)
        if not matches:
            raise NotFound(f"no run {ref!r} on {self.host}: `gpudeck runs` lists the runs")
        if len(matches) > 1:
            ids = ", ".join(m.id for m in matches[:5])
            raise BadRequest(f"{ref!r} matches {len(matches)} runs ({ids}): give more of the id")
        return self._runs.get(matches[0].id, matches[0])

    # ------------------------------------------------------------------ launch

    def _validate(self, spec: LaunchSpec) -> None:
        if not spec.argv:
            raise BadRequest("launch needs a command: `gpudeck launch -- python train.py ...`")
        if len(spec.argv) > MAX_ARGV:
            raise BadRequest(f"launch argv has {len(spec.argv)} arguments; the limit is {MAX_ARGV}")
        for a in spec.argv:
            if "\x00" in a:
                raise BadRequest("an argument contains a NUL byte; arguments are passed literally and cannot hold NUL")
        for k, v in spec.env.items():
            if not k or "=" in k or "\x00" in k or "\x00" in v:
                raise BadRequest(f"environment variable {k!r} is not valid: names cannot be empty or hold '=' or NUL")
        if spec.gpus is not None:
            if any(g < 0 for g in spec.gpus) or len(set(spec.gpus)) != len(spec.gpus):
                raise BadRequest(f"GPU list {spec.gpus} is not valid: give distinct indices such as 0,1")
        if spec.run_id is not None and not _RUN_ID_RE.match(spec.run_id):
            raise BadRequest(f"run id {spec.run_id!r} is not valid: ids look like r-0123abcd")
        if spec.need_gib is not None and not (0 <= spec.need_gib <= 1 << 20):
            raise BadRequest(f"--need-gib {spec.need_gib} is out of range")

    def _check_executable(self, spec: LaunchSpec, env: dict[str, str]) -> str | None:
        cwd = spec.cwd or os.getcwd()
        if not os.path.isdir(cwd):
            return f"working directory {cwd} does not exist on {self.host}"
        exe = spec.argv[0]
        if os.sep in exe:
            path = exe if os.path.isabs(exe) else os.path.join(cwd, exe)
            if not os.path.exists(path):
                return f"{exe} does not exist on {self.host} (looked in {cwd})"
            if not os.access(path, os.X_OK):
                return f"{exe} is not executable on {self.host}: chmod +x it or run it through its interpreter"
            return None
        if shutil.which(exe, path=env.get("PATH")) is None:
            return f"{exe!r} is not on PATH on {self.host}: give its full path or activate its environment"
        return None

    def attributed_gpus(self) -> list[Gpu]:
        """One GPU sample with every process attributed (call on the agent's loop thread)."""
        gpus = self.gpus.sample()
        for g in gpus:
            for p in g.processes:
                self.attribute(p)
        return gpus

    def _run_env(self, spec: LaunchSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update(spec.env)
        return env

    async def preflight(self, spec: LaunchSpec, host_name: str | None = None) -> PreflightResult:
        """Every pre-flight check of ``spec`` here; nothing is started. ``host_name``: what the client calls this host."""
        self._validate(spec)
        gpus = self.attributed_gpus() if self.gpus.available else []
        ended: dict[str, RunInfo] = {}
        for g in gpus:
            for p in g.processes:
                if p.run_id and p.run_id not in ended:
                    r = self.journal.get_run(p.run_id)
                    if r is not None:
                        ended[p.run_id] = r
        run_env = self._run_env(spec)
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

    def fingerprint_for(self, spec: LaunchSpec) -> EnvFingerprint | None:
        """The run's python environment, fingerprinted (None when the run is not a python program)."""
        python = spec.python
        if python is None:
            try:
                python, _why = run_python(spec, parse_launch_argv(list(spec.argv)))
            except Exception:  # an argv the parser cannot read is not a python run
                python = None
        if python is None:
            return None
        if os.sep not in python:
            python = shutil.which(python, path=self._run_env(spec).get("PATH")) or python
        try:
            return envs.fingerprint(python, driver=self.gpus.driver_version)
        except AgentError as exc:
            return EnvFingerprint(python=python, error=exc.message, taken=time.time())

    async def launch(self, spec: LaunchSpec, request_id: str = "", host_name: str | None = None) -> tuple[RunInfo, bool]:
        """Pre-flight, then start a run; returns (run, duplicate). A known request_id returns its first run.

        A failed pre-flight starts nothing; the run is recorded as ``preflight_failed`` with the reasons.
        """
        self._validate(spec)
        async with self._launch_lock:
            if request_id:
                earlier = self.journal.run_by_request(request_id)
                if earlier is not None:
                    return self._runs.get(earlier.id, earlier), True
            if spec.run_id is not None and self.journal.get_run(spec.run_id) is not None:
                raise BadRequest(f"run {spec.run_id} already exists on {self.host}")
            pf = await self.preflight(spec, host_name)
            if not pf.ok:
                return self._record_preflight_failed(spec, request_id, pf), False
            env = await asyncio.to_thread(self.fingerprint_for, spec)
            return await self._launch_new(spec, request_id, pf, env)

    def _record_preflight_failed(self, spec: LaunchSpec, request_id: str, pf: PreflightResult) -> RunInfo:
        now = time.time()
        cause = failure_summary(pf)
        run = RunInfo(
            id=spec.run_id or new_run_id(), host=self.host, state="preflight_failed", spec=spec, name=spec.name, created=now,
            request_id=request_id or None, cause=cause, ended=now, preflight=pf,
        )
        self._emit(self.journal.create_run(run))
        for ev in self.journal.append_many([
            ("preflight", run.id, {"result": msgspec.to_builtins(pf)}),
            ("run_state", run.id, {"state": "preflight_failed", "cause": cause, "ended": now, "cause_class": "preflight"}),
        ]):
            self._emit(ev)
        self._ended_ids.add(run.id)
        return run

    async def _launch_new(self, spec: LaunchSpec, request_id: str, pf: PreflightResult | None = None, env_fp: EnvFingerprint | None = None) -> tuple[RunInfo, bool]:
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
            _fsync_write(run_dir / "spec.json", msgspec.json.encode(spec))
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise StorageError(f"cannot create the run folder {run_dir} ({exc.strerror}): free space or fix permissions in {self.runs_dir}; nothing was started") from exc
        # the record exists before anything starts: a failed start is never unrecorded
        try:
            self._emit(self.journal.create_run(run))
        except StorageError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise StorageError(f"{exc.message}; nothing was started") from exc
        self._runs[run_id] = run
        self._launching.add(run_id)
        try:
            return await self._start_recorded(run, spec, run_dir, now, pf, env_fp)
        finally:
            self._launching.discard(run_id)

    async def _start_recorded(self, run: RunInfo, spec: LaunchSpec, run_dir: Path, now: float, pf: PreflightResult | None, env_fp: EnvFingerprint | None) -> tuple[RunInfo, bool]:
        run_id = run.id
        extra: list[tuple[str, str | None, dict]] = []
        if pf is not None:
            extra.append(("preflight", run_id, {"result": msgspec.to_builtins(pf)}))
        if env_fp is not None:
            extra.append(("env_fingerprint", run_id, {"env": msgspec.to_builtins(env_fp)}))
        if extra:
            try:
                for ev in self.journal.append_many(extra):
                    self._emit(ev)
            except StorageError:
                log.warning("run %s: could not journal its pre-flight/environment records", run_id)

        env = dict(os.environ)
        env.update(spec.env)
        env["GPUDECK_RUN_ID"] = run_id
        env["GPUDECK_RUN_DIR"] = str(run_dir)
        env["GPUDECK_TELEMETRY"] = str(run_dir / "telemetry.jsonl")
        env.setdefault("PYTHONUNBUFFERED", "1")
        if spec.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # match NVML's numbering
        # a cwd on a hung NFS/FUSE mount must not freeze the agent: the checks run off the event loop
        try:
            problem = await asyncio.wait_for(asyncio.to_thread(self._check_executable, spec, env), 20.0)
        except asyncio.TimeoutError:
            problem = f"checking the working directory {spec.cwd} and {spec.argv[0]!r} did not return within 20 s (a hung file system?)"
        if problem is not None:
            self._fail_launch(run, problem)
            raise LaunchFailed(f"{problem}; run {run_id} is recorded as failed")
        try:
            pid, shim = await asyncio.to_thread(self._spawn, run, env)
        except LaunchFailed as exc:
            self._fail_launch(run, exc.message)
            raise LaunchFailed(f"{exc.message}; run {run_id} is recorded as failed") from exc
        self._shims[run_id] = shim
        members = [
            Member(pid=shim.pid, create_time=create_time_of(shim.pid) or 0.0, role="shim", first_seen=now, cmdline=["gpudeck-shim"]),
        ]
        leader_ct = create_time_of(pid)
        if leader_ct is not None:
            members.append(Member(pid=pid, create_time=leader_ct, role="leader", first_seen=time.time(), cmdline=list(spec.argv)))
        self._set(run, "run_state", {"state": "running", "pid": pid}, state="running", started=time.time(), members=members)
        return run, False

    def _fail_launch(self, run: RunInfo, cause: str) -> None:
        self._set(run, "run_state", {"state": "failed", "cause": f"launch failed: {cause}"}, state="failed", cause=f"launch failed: {cause}", ended=time.time())

    def _spawn(self, run: RunInfo, env: dict[str, str]) -> tuple[int, subprocess.Popen]:
        run_dir = Path(run.run_dir or "")
        r, w = os.pipe()
        try:
            out = open(run_dir / "output.log", "ab", buffering=0)
        except OSError as exc:
            os.close(r)
            os.close(w)
            raise LaunchFailed(f"cannot open {run_dir / 'output.log'} ({exc.strerror})") from exc
        try:
            shim = subprocess.Popen(
                [sys.executable, "-I", _SHIM, str(w), str(run_dir / "exit.json"), "--", *run.spec.argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=run.spec.cwd or None,
                env=env,
                start_new_session=True,
                pass_fds=(w,),
                close_fds=True,
            )
        except OSError as exc:
            os.close(r)
            os.close(w)
            out.close()
            raise LaunchFailed(f"cannot start the run shim ({exc})") from exc
        os.close(w)
        out.close()
        line = _read_line(r, SHIM_START_TIMEOUT_S)
        os.close(r)
        try:
            status = json.loads(line) if line else {}
        except ValueError:
            status = {}
        if "pid" in status:
            return int(status["pid"]), shim
        reason = status.get("error") or f"the run shim did not report within {SHIM_START_TIMEOUT_S:.0f} s"
        if shim.poll() is None:
            shim.kill()
        shim.wait()
        raise LaunchFailed(f"cannot start {run.spec.argv[0]!r}: {reason}")

    # ------------------------------------------------------------------ watching

    def refresh(self) -> None:
        """One supervision tick: find new members, notice ended runs, apply the health rules. Runs on the agent's event loop."""
        self.procs.refresh()
        gpus: list[Gpu] | None = None
        for run in list(self._runs.values()):
            if run.state not in ("running", "starting", "stopping"):
                continue
            self.poll_telemetry(run)
            if run.id in self._stopping or run.id in self._launching:
                continue
            self._discover_members(run)
            if not self._run_alive(run):
                self._finish(run)
                continue
            if gpus is None:
                gpus = self.attributed_gpus() if self.gpus.available else []
            self._check_health(run, gpus)

    # ------------------------------------------------------------------ health (failures 4 and 7)

    def _check_health(self, run: RunInfo, gpus: list[Gpu]) -> None:
        health = self._health.get(run.id)
        if health is None:
            health = self._health[run.id] = RunHealth(run.id)
        now = time.time()
        obs = observe(run, now, gpus, lambda m: alive(m.pid, m.create_time), stopping=run.state == "stopping")
        self._last_obs[run.id] = obs
        raised = health.update(obs, self._baseline(run))
        cleared = health.cleared_since_last()
        if raised or cleared:
            items: list[tuple[str, str | None, dict]] = [("alert", run.id, {"alert": msgspec.to_builtins(a)}) for a in raised]
            items += [("alert_cleared", run.id, {"alert": msgspec.to_builtins(a)}) for a in cleared]
            try:
                for ev in self.journal.append_many(items):
                    self._emit(ev)
            except StorageError:
                log.warning("run %s: could not journal %d alert event(s)", run.id, len(items))
            for a in raised:
                log.warning("run %s: %s", run.id, a.message)
                if a.kind == "rank_exited" and run.id not in self._first_death:
                    self._first_death[run.id] = a
        run.alerts = health.active
        if health.wants_stop and run.id not in self._stopping:
            death = self._first_death.get(run.id)
            why = f"a rank died ({death.message.split(':')[0]})" if death else "a rank died"
            self._spawn_bg(self.stop(run.id, RANK_DEATH_STOP_GRACE_S, reason=f"stopped by gpudeck: {why} and the run was launched with --on-rank-death stop"))

    def _spawn_bg(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _baseline(self, run: RunInfo) -> Baseline | None:
        """The median throughput of the newest earlier run with the same config (looked up once per run)."""
        if run.id in self._baselines:
            return self._baselines[run.id]
        tel = run.telemetry
        if tel is None or not tel.config_hash:
            return None  # not known yet: look again next tick
        found = self.journal.throughput_baseline(tel.config_hash, tel.world_size, exclude=run.id)
        self._baselines[run.id] = Baseline(run_id=found[0], median_tokens_per_s=found[1], config_hash=tel.config_hash) if found else None
        return self._baselines[run.id]

    def verify(self, ref: str) -> tuple[RunInfo, list[ClaimRow]]:
        """Claims vs observed: live from the last observation, or as recorded when the run ended."""
        run = self.resolve(ref)
        obs = self._last_obs.get(run.id)
        if obs is not None:
            return run, claims_report(obs)
        ev = self.journal.last_event(run.id, "claims")
        if ev is not None:
            return run, [msgspec.convert(r, ClaimRow) for r in ev.data.get("rows", [])]
        if run.state in LIVE_STATES:
            gpus = self.attributed_gpus() if self.gpus.available else []
            return run, claims_report(observe(run, time.time(), gpus, lambda m: alive(m.pid, m.create_time)))
        return run, []

    def _record_claims(self, run: RunInfo) -> None:
        obs = self._last_obs.get(run.id)
        if obs is None:
            return
        try:
            rows = claims_report(obs)
            self._emit(self.journal.append("claims", run.id, {"rows": msgspec.to_builtins(rows)}))
        except (StorageError, Exception):  # the claims are a report; never let them block the end of a run
            log.exception("run %s: claims report failed", run.id)

    def poll_telemetry(self, run: RunInfo) -> None:
        """Fold new telemetry into the run's summary; journal what history needs, exactly once."""
        tail = self._tails.get(run.id)
        if tail is None:
            tail = self._tails[run.id] = TelemetryTail(Path(run.run_dir or "") / "telemetry.jsonl")
            last = self.journal.last_event(run.id, "telemetry")
            self._journaled_offset[run.id] = int(last.data.get("offset", 0)) if last else 0
        records = tail.poll()
        run.telemetry = tail.summary
        if not records:
            return
        floor = self._journaled_offset.get(run.id, 0)
        now = time.monotonic()
        items: list[tuple[str, str | None, dict]] = []
        for rec, offset in records:
            if offset <= floor or rec.get("type") == "heartbeat":
                continue
            if rec.get("type") == "step":
                if now - self._last_step_event.get(run.id, -1e9) < STEP_EVENT_EVERY_S:
                    continue
                self._last_step_event[run.id] = now
            items.append(("telemetry", run.id, {"record": rec, "offset": offset}))
        if items:
            for ev in self.journal.append_many(items):
                self._emit(ev)
            self._journaled_offset[run.id] = items[-1][2]["offset"]

    def _discover_members(self, run: RunInfo) -> bool:
        new: list[Member] = []
        updated: list[Member] = []
        for e in self.procs.tagged(run.id):
            known = next((m for m in run.members if m.pid == e.pid and abs(m.create_time - e.create_time) <= CT_TOLERANCE), None)
            if known is not None:
                if known.rank is None and e.rank is not None and known.role == "worker":
                    # first seen between fork and exec, with its parent's environment: now it has exec'd
                    known.rank, known.local_rank, known.cmdline = e.rank, e.local_rank, _cmdline(e.pid)
                    updated.append(known)
                continue
            info_cmd = _cmdline(e.pid)
            new.append(Member(pid=e.pid, create_time=e.create_time, role="worker", rank=e.rank, local_rank=e.local_rank, first_seen=time.time(), cmdline=info_cmd))
        if not new and not updated:
            return False
        # workers that came and went (shell helpers, finished DataLoader workers) leave the list;
        # the journal's "members" events keep their history
        members = [m for m in run.members if m.role in ("shim", "leader") or alive(m.pid, m.create_time)] + new

        def brief(ms: list[Member]) -> list[dict]:
            return [{"pid": m.pid, "rank": m.rank, "local_rank": m.local_rank, "cmdline": m.cmdline[:8]} for m in ms]

        data = {"added": brief(new)}
        if updated:
            data["updated"] = brief(updated)  # members already journaled, now with their rank: replaced, not added
        self._set(run, "members", data, members=members)
        return True

    def _shim_member(self, run: RunInfo) -> Member | None:
        return next((m for m in run.members if m.role == "shim"), None)

    def _leader_member(self, run: RunInfo) -> Member | None:
        return next((m for m in run.members if m.role == "leader"), None)

    def _run_alive(self, run: RunInfo) -> bool:
        shim = self._shims.get(run.id)
        if shim is not None:
            return shim.poll() is None
        m = self._shim_member(run) or self._leader_member(run)
        if m is None:  # only tagged workers are known (the agent died while starting it)
            return any(alive(x.pid, x.create_time) for x in run.members)
        return alive(m.pid, m.create_time)

    def _exit_record(self, run: RunInfo) -> dict | None:
        try:
            with open(Path(run.run_dir or "") / "exit.json", encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def _finish(self, run: RunInfo, *, agent_was_down: bool = False, stopped_cause: str | None = None) -> None:
        self.poll_telemetry(run)  # the last records (done, error) before the run is closed
        # the shim is let go only once the end is journaled: a journal that cannot be written now (disk full)
        # must not cost the exit code on the next try
        shim = self._shims.get(run.id)
        if shim is not None:
            shim.poll()
        rec = self._exit_record(run)
        if rec is None and shim is not None and shim.returncode is not None and shim.returncode != 127:
            # exit.json could not be written (disk full), but this agent reaped the shim: its code is the run's
            rc = shim.returncode
            sig_name = None
            if rc > 128:
                try:
                    sig_name = signal.Signals(rc - 128).name
                except ValueError:
                    sig_name = None
            rec = {"returncode": None if sig_name else rc, "signal": sig_name, "ended": time.time(), "note": "exit.json could not be written"}
        tail = read_tail(Path(run.run_dir or "") / "output.log")
        reason = classify_output(tail)
        now = time.time()
        if rec is not None and rec.get("launch_error"):
            state, cause, code, sig = "failed", f"launch failed: {rec['launch_error']}", None, None
        elif rec is not None:
            code, sig = rec.get("returncode"), rec.get("signal")
            ended = rec.get("ended") or now
            now = ended
            if code == 0:
                state, cause = "succeeded", "exit code 0"
            elif sig:
                state, cause = "failed", f"killed by {sig}"
            else:
                state, cause = "failed", f"exit code {code}"
            if state == "failed" and reason:
                cause += f" ({reason})"
            if agent_was_down:
                cause += "; ended while the agent was down"
        else:
            code, sig = None, None
            evidence = self._telemetry_evidence(run)
            state = "lost"
            cause = "agent lost track: the run ended while the agent was down and left no exit status"
            if evidence:
                cause += f"; {evidence}"
            if reason:
                cause += f"; output shows {reason}"
        if state == "failed":
            death = self._first_death.get(run.id)
            health = self._health.get(run.id)
            gone = health.first_gone(run) if health is not None and death is None else None
            if death is not None:
                cause += f"; rank {death.rank} died first ({death.message.split(':')[0]})"
            elif gone is not None:
                cause += f"; rank {gone[0]} died first (pid {gone[1]}; the others were torn down after it)"
                if (run.spec.nnodes or 1) > 1:
                    self._node_death_alert(run, gone, cause, now)
            killed = sig == "SIGKILL" or "exitcode: -9" in tail or "Signals.SIGKILL" in tail
            oom = host_oom_note([m.pid for m in run.members], run.started or run.created) if killed else None
            if oom:
                cause = f"{cause} (host OOM killer: {oom})"
        if rec is not None and rec.get("note"):
            cause += f"; {rec['note']} (is the agent's state dir full?)"
        if stopped_cause is not None:
            state, cause = "stopped", f"{stopped_cause} ({cause})"
        lingering = [m for m in run.members if m.role != "shim" and alive(m.pid, m.create_time)]
        data: dict = {"state": state, "cause": cause, "exit_code": code, "signal": sig}
        if lingering:
            data["lingering"] = [m.pid for m in lingering]
        self._record_claims(run)
        self._set(run, "run_state", data, state=state, cause=cause, exit_code=code, signal=sig, ended=now)
        self._shims.pop(run.id, None)

    def _node_death_alert(self, run: RunInfo, gone: tuple[int, int, float], cause: str, now: float) -> None:
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
        try:
            for ev in self.journal.append_many([("alert", run.id, {"alert": msgspec.to_builtins(alert)})]):
                self._emit(ev)
        except StorageError:
            log.warning("run %s: could not journal the node-death alert", run.id)
        log.warning("run %s: %s", run.id, alert.message)

    def _telemetry_evidence(self, run: RunInfo) -> str:
        tail = read_tail(Path(run.run_dir or "") / "telemetry.jsonl", 16 * 1024)
        last_step = None
        for line in tail.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("type") == "done":
                return f"the trainer reported done at step {rec.get('final_step')}"
            if rec.get("type") == "error":
                return f"the trainer reported an error: {str(rec.get('message'))[:200]}"
            if rec.get("type") == "step":
                last_step = rec.get("step")
        return f"last step reported: {last_step}" if last_step is not None else ""

    # ------------------------------------------------------------------ re-adoption

    def adopt(self) -> list[str]:
        """After an agent (re)start: take over live runs, settle runs that ended meanwhile."""
        self.procs.refresh(full=True)
        notes: list[str] = []
        for run in self.journal.list_runs(limit=100000, states=LIVE_STATES):
            self._runs[run.id] = run
            if run.state == "starting" and not run.members and not self.procs.tagged(run.id):
                # the agent died between the record and the start, and no process carries the tag
                self._set(run, "run_state", {"state": "failed", "cause": "launch interrupted: the agent stopped while starting it"},
                          state="failed", cause="launch interrupted: the agent stopped while starting it; nothing was started", ended=time.time())
                notes.append(f"{run.id}: launch interrupted")
                continue
            self._discover_members(run)
            if self._run_alive(run) or any(alive(m.pid, m.create_time) for m in run.members if m.role == "leader"):
                if run.state == "stopping":
                    notes.append(f"{run.id}: stop was in progress; finishing it")
                    self._set(run, "run_adopted", {"state": run.state, "resume_stop": True})
                else:
                    self._set(run, "run_adopted", {"state": "running"}, state="running")
                    notes.append(f"{run.id}: re-adopted")
            else:
                was_stopping = run.state == "stopping"
                self._finish(run, agent_was_down=True, stopped_cause="stopped by operator (the stop finished while the agent was down)" if was_stopping else None)
                notes.append(f"{run.id}: ended while the agent was down ({run.state})")
        for run in self.journal.list_runs(limit=2000, states=TERMINAL_STATES):
            self._ended_ids.add(run.id)
        return notes

    def pending_stops(self) -> list[RunInfo]:
        """Runs left in ``stopping`` by an earlier agent; the server finishes those stops."""
        return [r for r in self._runs.values() if r.state == "stopping"]

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
            task.add_done_callback(lambda _t, rid=run.id: self._stopping.pop(rid, None))
        return await asyncio.shield(task)

    async def _terminate(self, live: list[Member], grace_s: float) -> tuple[list[Member], list[Member], list[Member]]:
        """TERM to every process, the grace, KILL to what is left; returns (gone after TERM, needed KILL, gone after KILL)."""
        for m in live:
            signal_exact(m.pid, m.create_time, signal.SIGTERM)
        gone_after_term = await self._wait_gone(live, grace_s)
        needed_kill = [m for m in live if m not in gone_after_term]
        for m in needed_kill:
            signal_exact(m.pid, m.create_time, signal.SIGKILL)
        gone_after_kill = await self._wait_gone(needed_kill, KILL_WAIT_S) if needed_kill else []
        return gone_after_term, needed_kill, gone_after_kill

    async def _stop(self, run: RunInfo, grace_s: float, reason: str = "stopped by operator") -> StopResult:
        t0 = time.monotonic()
        was_terminal = run.state in TERMINAL_STATES
        if not was_terminal:
            self._runs.setdefault(run.id, run)
            self._set(run, "run_state", {"state": "stopping", "grace_s": grace_s}, state="stopping")
        # a fresh full scan: every process that carries the tag, wherever it went
        self.procs.refresh(full=True)
        if not was_terminal:
            self._discover_members(run)
        else:
            for e in self.procs.tagged(run.id):
                if not any(m.pid == e.pid and abs(m.create_time - e.create_time) <= CT_TOLERANCE for m in run.members):
                    run.members.append(Member(pid=e.pid, create_time=e.create_time, rank=e.rank, local_rank=e.local_rank, cmdline=_cmdline(e.pid)))
        members = list(run.members)
        shim_m = self._shim_member(run)
        targets = [m for m in members if m.role != "shim"]
        live = [m for m in targets if alive(m.pid, m.create_time)]
        if was_terminal and not live:
            return StopResult(run_id=run.id, state=run.state, message=f"run {run.id} already ended ({run.cause}); none of its processes is alive", seconds=time.monotonic() - t0)

        gpu_before = await asyncio.to_thread(self.gpus.memory_used) if self.gpus.available else {}
        result = StopResult(run_id=run.id, state="stopping")
        gone_after_term, needed_kill, gone_after_kill = await self._terminate(live, grace_s)
        # the shim exits by itself once its child is gone; make sure it did
        if shim_m is not None:
            shim_list = [shim_m] if alive(shim_m.pid, shim_m.create_time) else []
            if shim_list and not await self._wait_gone(shim_list, 2.0):
                signal_exact(shim_m.pid, shim_m.create_time, signal.SIGKILL)
                await self._wait_gone(shim_list, 2.0)
            popen = self._shims.pop(run.id, None)
            if popen is not None:
                await asyncio.to_thread(_reap, popen, 2.0)
        for m in targets:
            cmd = m.cmdline[:12]
            if m not in live:
                if m.role != "leader":
                    continue  # a worker that had already exited is not news
                result.stopped.append(StoppedProcess(pid=m.pid, cmdline=cmd, role=m.role, how="already_gone"))
            elif m in gone_after_term:
                result.stopped.append(StoppedProcess(pid=m.pid, cmdline=cmd, role=m.role, how="zombie" if status_of(m.pid, m.create_time) == "zombie" else "SIGTERM"))
            elif m in gone_after_kill:
                result.stopped.append(StoppedProcess(pid=m.pid, cmdline=cmd, role=m.role, how="SIGKILL"))
            else:
                result.survivors.append(StoppedProcess(pid=m.pid, cmdline=cmd, role=m.role, how="survived", status=status_of(m.pid, m.create_time)))
        result.needed_kill = [m.pid for m in needed_kill]
        await self._verify_gpu(result, members, gpu_before)
        result.seconds = round(time.monotonic() - t0, 3)

        if was_terminal:
            result.state = run.state
            result.message = f"run {run.id} had already ended ({run.cause}); its {len(live)} leftover process(es) were stopped"
        else:
            self.poll_telemetry(run)
            rec = self._exit_record(run)
            code = rec.get("returncode") if rec else None
            sig = rec.get("signal") if rec else None
            cause = reason
            if result.needed_kill:
                cause += f"; {len(result.needed_kill)} process(es) ignored SIGTERM for {grace_s:g} s and needed SIGKILL"
            if result.survivors:
                cause += f"; {len(result.survivors)} process(es) survived SIGKILL ({', '.join(f'{s.pid} {s.status}' for s in result.survivors)})"
            result.state = "stopped"
            self._record_claims(run)
            self._set(
                run,
                "run_state",
                {"state": "stopped", "cause": cause, "stop": msgspec.to_builtins(result)},
                state="stopped",
                cause=cause,
                exit_code=code,
                signal=sig,
                ended=time.time(),
            )
            result.message = _summary(result)
        if was_terminal:
            self._emit(self.journal.append("reclaimed", run.id, msgspec.to_builtins(result)))
        return result

    async def _wait_gone(self, members: list[Member], timeout: float) -> list[Member]:
        """Wait until members are dead (zombies count as dead); return those that went."""
        deadline = time.monotonic() + timeout
        pending = list(members)
        gone: list[Member] = []
        delay = 0.01
        while pending:
            still = []
            for m in pending:
                (still if alive(m.pid, m.create_time) else gone).append(m)
            pending = still
            if not pending or time.monotonic() >= deadline:
                break
            # reap our own child (the shim) so it does not linger as a zombie
            for popen in self._shims.values():
                popen.poll()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        return gone

    async def _verify_gpu(self, result: StopResult, members: list[Member], before: dict[int, int]) -> None:
        if not self.gpus.available:
            result.gpu_verified = False
            result.gpu_note = f"GPU memory not verified: {self.gpus.error}"
            return
        pids = {m.pid for m in members}
        deadline = time.monotonic() + GPU_SETTLE_S
        while True:
            gpus = await asyncio.to_thread(self.gpus.sample)
            holders = [p for g in gpus for p in g.processes if p.pid in pids]
            if not holders or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        after = {g.index: g.memory_used for g in gpus}
        result.still_on_gpu = [GpuProcess(pid=p.pid, gpu=p.gpu, used_bytes=p.used_bytes, attribution="STALE", run_id=result.run_id) for p in holders]
        for idx, b in sorted(before.items()):
            a = after.get(idx, b)
            result.freed.append(GpuFreed(gpu=idx, before_bytes=b, after_bytes=a, freed_bytes=max(0, b - a)))
        result.freed_bytes = sum(f.freed_bytes for f in result.freed)
        result.gpu_verified = not holders
        if holders:
            result.gpu_note = "still holding GPU memory: " + ", ".join(f"pid {p.pid} on GPU {p.gpu} ({(p.used_bytes or 0) / 2**30:.1f} GiB)" for p in holders)
        else:
            result.gpu_note = f"verified through NVML: no process of the run holds GPU memory; {result.freed_bytes / 2**30:.2f} GiB freed"


    # ------------------------------------------------------------------ reclaim (failures 1-3)

    async def leftovers(self, include_live: bool = False, host_name: str | None = None) -> list[Leftover]:
        """Every leftover process here (see agents/leftovers.py), with CPU % over a short sample."""
        self.procs.refresh(full=True)
        gpus = self.attributed_gpus() if self.gpus.available else []
        found = find_leftovers(host_name or self.host, self.procs, gpus, self.run_state, self.journal.get_run, include_live=include_live)
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
            raise BadRequest(f"name the pids to reclaim: `gpudeck reclaim {host}` lists the leftovers, `gpudeck reclaim {host}:PID` stops one")
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
                raise BadRequest(f"pid {pid} belongs to live run {lo.run_id}: `gpudeck stop {lo.run_id}` stops the whole run; to stop this one process alone add --include-live")
            chosen.append(lo)
        result = StopResult(run_id=None, state="reclaimed")
        targets: list[Member] = []
        unsignalable: list[Leftover] = []
        for lo in chosen:
            if lo.kind == "no_such_process" or lo.create_time is None:
                unsignalable.append(lo)
            else:
                targets.append(Member(pid=lo.pid, create_time=lo.create_time, role="leftover", rank=lo.rank, cmdline=lo.cmdline[:12]))
        live = [m for m in targets if alive(m.pid, m.create_time)]
        gpu_before = await asyncio.to_thread(self.gpus.memory_used) if self.gpus.available else {}
        gone_term, needed_kill, gone_kill = await self._terminate(live, grace_s)
        for m in targets:
            st = status_of(m.pid, m.create_time)
            if m not in live:
                how = "zombie" if st == "zombie" else "already_gone"
                result.stopped.append(StoppedProcess(pid=m.pid, cmdline=m.cmdline, role="leftover", how=how, status=st))
            elif m in gone_term:
                result.stopped.append(StoppedProcess(pid=m.pid, cmdline=m.cmdline, role="leftover", how="zombie" if st == "zombie" else "SIGTERM"))
            elif m in gone_kill:
                result.stopped.append(StoppedProcess(pid=m.pid, cmdline=m.cmdline, role="leftover", how="SIGKILL"))
            else:
                result.survivors.append(StoppedProcess(pid=m.pid, cmdline=m.cmdline, role="leftover", how="survived", status=st))
        for lo in unsignalable:
            result.survivors.append(StoppedProcess(pid=lo.pid, cmdline=lo.cmdline, role="leftover", how="survived", status="no such process"))
        result.needed_kill = [m.pid for m in needed_kill]
        await self._verify_gpu(result, targets + [Member(pid=lo.pid, create_time=0.0) for lo in unsignalable], gpu_before)
        result.seconds = round(time.monotonic() - t0, 3)
        notes = [f"pid {s.pid}: {found[s.pid].note}" for s in result.survivors] + [
            f"pid {s.pid}: {found[s.pid].note}" for s in result.stopped if s.how == "zombie"
        ]
        result.message = _summary(result) + ("; " + "; ".join(notes) if notes else "")
        by_run: dict[str | None, list[int]] = {}
        for lo in chosen:
            by_run.setdefault(lo.run_id, []).append(lo.pid)
        try:
            for rid, rpids in by_run.items():
                self._emit(self.journal.append("reclaimed", rid, {"pids": rpids, **msgspec.to_builtins(result)}))
        except StorageError:
            log.warning("could not journal the reclaim of %s", pids)
        return result


def _summary(result: StopResult) -> str:
    parts = [f"stopped {len(result.stopped)} process(es)"]
    if result.needed_kill:
        parts.append(f"{len(result.needed_kill)} needed SIGKILL ({', '.join(map(str, result.needed_kill))})")
    if result.survivors:
        parts.append(f"{len(result.survivors)} SURVIVED: " + ", ".join(f"{s.pid} ({s.status})" for s in result.survivors))
    parts.append(result.gpu_note)
    return "; ".join(parts)


def _reap(popen: subprocess.Popen, timeout: float) -> None:
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a][:32]
    except OSError:
        return []


def _read_line(fd: int, timeout: float) -> str:
    """Read one line from a pipe with a deadline (the shim's start report)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    finally:
        sel.close()
    return buf.decode("utf-8", "replace").strip()


def hostname() -> str:
    """This host's short name."""
    return socket.gethostname().split(".")[0]
