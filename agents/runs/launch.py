"""Provides the launch of a run: the spec validated and its argv read once, pre-flight, the record on disk, the group, the spawn through the shim.

The launch argv is parsed once per launch (:class:`LaunchPlan`); pre-flight, the
memory estimate, the environment's fingerprint and the checks all use that one
reading. The run is recorded before anything starts, so a failed start is never
unrecorded; a failed pre-flight starts nothing and is recorded as ``preflight_failed``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from gpudeck.agents.observe.procs import create_time_of
from gpudeck.agents.runs import states
from gpudeck.agents.runs.liverun import LiveRun
from gpudeck.agents.safety import envs
from gpudeck.agents.safety.containment import RunGroup
from gpudeck.agents.safety.estimate import LaunchArgv, estimate_or_reason
from gpudeck.agents.safety.preflight import UNPARSED, Unparsed, failure_summary, parse_launch_argv, run_preflight, run_python
from gpudeck.agents.wire import paths
from gpudeck.agents.wire.errors import AgentError, BadRequest, LaunchFailed, StorageError
from gpudeck.agents.wire.protocol import MAX_ARGV, MAX_NAME, EnvFingerprint, LaunchSpec, Member, PreflightResult, RunInfo, new_run_id

if TYPE_CHECKING:
    from gpudeck.agents.runs.supervisor import Supervisor


# run as a script with -I: stdlib only, so the run's own PYTHONPATH and cwd never matter
SHIM = str(Path(__file__).resolve().with_name("shim.py"))
# where the shim lived before agents/ had subpackages (gpudeck 0.1.0 up to the runs/ move): a run launched by
# such an agent and still alive across the upgrade is that run's shim all the same
SHIMS = frozenset({SHIM, str(Path(__file__).resolve().parent.parent / "shim.py")})
SHIM_START_TIMEOUT_S = 15.0
_RUN_ID_RE = re.compile(r"^r-[0-9a-f]{8}$")


MAX_ENV_DIFFS = 256  # the gate's rows a launch may name with --allow-env-diff (and record as env_diffs)
MAX_ENV_DIFF_CHARS = 4096  # one entry: a name, or a recorded "name: node values" row (envdiff cuts those at 2,000)


def check_env(env: dict[str, str]) -> None:
    """Refuse an environment a process cannot be given: names non-empty, without '=' or NUL; values without NUL."""
    for k, v in env.items():
        if not k or "=" in k or "\x00" in k or "\x00" in v:
            raise BadRequest(f"environment variable {k!r} is not valid: names cannot be empty or hold '=' or NUL")


def validate(spec: LaunchSpec) -> None:
    """Refuse a spec that cannot be started as given, naming the field and the fix."""
    if not spec.argv:
        raise BadRequest("launch needs a command: `gpudeck launch -- python train.py ...`")
    if len(spec.argv) > MAX_ARGV:
        raise BadRequest(f"launch argv has {len(spec.argv)} arguments; the limit is {MAX_ARGV}")
    if spec.name is not None and len(spec.name) > MAX_NAME:
        raise BadRequest(f"the run's name has {len(spec.name):,} characters; the limit is {MAX_NAME}: give a shorter --name")
    for a in spec.argv:
        if "\x00" in a:
            raise BadRequest("an argument contains a NUL byte; arguments are passed literally and cannot hold NUL")
    check_env(spec.env)
    for field, names in (("--allow-env-diff", spec.allow_env_diff), ("env_diffs", spec.env_diffs)):
        if len(names) > MAX_ENV_DIFFS or any(len(n) > MAX_ENV_DIFF_CHARS for n in names):
            raise BadRequest(
                f"{field} holds {len(names)} entries (limit {MAX_ENV_DIFFS}, each at most {MAX_ENV_DIFF_CHARS} characters):"
                " name only the gate's rows that differ"
            )
    if spec.gpus is not None:
        if any(g < 0 for g in spec.gpus) or len(set(spec.gpus)) != len(spec.gpus):
            raise BadRequest(f"GPU list {spec.gpus} is not valid: give distinct indices such as 0,1")
    if spec.run_id is not None and not _RUN_ID_RE.match(spec.run_id):
        raise BadRequest(f"run id {spec.run_id!r} is not valid: ids look like r-0123abcd")
    if spec.need_gib is not None and not (0 <= spec.need_gib <= 1 << 20):
        raise BadRequest(f"--need-gib {spec.need_gib} is out of range")


@dataclass
class LaunchPlan:
    """One launch's spec with what is derived from it, each computed once."""

    spec: LaunchSpec
    base_env: dict[str, str]  # the agent's environment with the spec's on top (pre-flight runs the python with it)
    parsed: LaunchArgv | None  # the argv (and a trainer's own arguments) read once; None when it cannot be read
    python: str | None  # the run's interpreter (resolved on PATH), or None when it is not a python program

    @classmethod
    def of(cls, spec: LaunchSpec) -> LaunchPlan:
        """Validate and derive, once."""
        validate(spec)
        env = dict(os.environ)
        env.update(spec.env)
        try:
            parsed = parse_launch_argv(list(spec.argv))
        except Exception:  # an argv the parser cannot read is not a python run
            parsed = None
        python = spec.python
        if python is None and parsed is not None:
            try:
                python, _why = run_python(spec, parsed)
            except Exception:
                python = None
        if python is not None and os.sep not in python:
            python = shutil.which(python, path=env.get("PATH")) or python
        return cls(spec=spec, base_env=env, parsed=parsed, python=python)

    @property
    def preflight_argv(self) -> LaunchArgv | Unparsed:
        """What pre-flight is given for the argv: the one parse, or the mark that it could not be read (never read again)."""
        return self.parsed if self.parsed is not None else UNPARSED

    def run_env(self, run_id: str, run_dir: Path) -> dict[str, str]:
        """The run's environment: the base plus its tag, telemetry path and GPU selection."""
        env = dict(self.base_env)
        env["GPUDECK_RUN_ID"] = run_id
        env["GPUDECK_RUN_DIR"] = str(run_dir)
        env["GPUDECK_TELEMETRY"] = str(run_dir / "telemetry.jsonl")
        env.setdefault("PYTHONUNBUFFERED", "1")
        # torchrun's per-attempt logs and its workers' error files go in the run's folder (torchrun reads --log-dir
        # from PET_LOG_DIR); without it each torchrun made a /tmp/torchelastic_* folder that outlived its run
        env.setdefault("PET_LOG_DIR", str(run_dir / "torchelastic"))
        if self.spec.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.spec.gpus)
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # match NVML's numbering
        return env


def check_executable(spec: LaunchSpec, env: dict[str, str], host: str) -> str | None:
    """Why the command cannot start here (cwd missing, not executable, not on PATH), or None."""
    cwd = spec.cwd or os.getcwd()
    if not os.path.isdir(cwd):
        return f"working directory {cwd} does not exist on {host}"
    exe = spec.argv[0]
    if os.sep in exe:
        path = exe if os.path.isabs(exe) else os.path.join(cwd, exe)
        if not os.path.exists(path):
            return f"{exe} does not exist on {host} (looked in {cwd})"
        if not os.access(path, os.X_OK):
            return f"{exe} is not executable on {host}: chmod +x it or run it through its interpreter"
        return None
    if shutil.which(exe, path=env.get("PATH")) is None:
        return f"{exe!r} is not on PATH on {host}: give its full path or activate its environment"
    return None


def fsync_write(path: Path, data: bytes) -> None:
    """Write a file atomically and durably (temp file, fsync, rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)  # spec.json holds --env values
    os.fchmod(fd, 0o600)
    with open(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def spawn(run: RunInfo, env: dict[str, str], group: RunGroup | None) -> tuple[int, subprocess.Popen]:
    """Start the run's shim in a new session; its child joins ``group`` before exec. Returns (child pid, shim)."""
    run_dir = Path(run.run_dir or "")
    r, w = os.pipe()
    try:
        out = open(paths.private_file(run_dir / "output.log"), "ab", buffering=0)
    except OSError as exc:
        os.close(r)
        os.close(w)
        raise LaunchFailed(f"cannot open {run_dir / 'output.log'} ({exc.strerror})") from exc
    cg = [group.procs_file] if group is not None else []
    try:
        shim = subprocess.Popen(
            [sys.executable, "-I", SHIM, str(w), str(run_dir / "exit.json"), *cg, "--", *run.spec.argv],
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
    line = read_line(r, SHIM_START_TIMEOUT_S)
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


def read_line(fd: int, timeout: float) -> str:
    """Read one line from a pipe with a deadline (the shim's start report)."""
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


async def preflight(sup: Supervisor, spec: LaunchSpec, host_name: str | None = None, plan: LaunchPlan | None = None) -> PreflightResult:
    """Every pre-flight check of ``spec`` here; nothing is started. ``host_name``: what the client calls this host."""
    plan = plan or LaunchPlan.of(spec)
    gpus = await asyncio.to_thread(sup.attributed_gpus) if sup.gpus.available else []  # 500 holders are read off the loop
    ended: dict[str, RunInfo] = {}
    for g in gpus:
        for p in g.processes:
            if p.run_id and p.run_id not in ended:
                r = sup.journal.get_run(p.run_id)
                if r is not None:
                    ended[p.run_id] = r
    run_env = plan.base_env
    est, why = await asyncio.to_thread(estimate_or_reason, spec, None, plan.parsed)
    return await asyncio.to_thread(
        run_preflight,
        spec,
        host=host_name or sup.host,
        gpus=gpus,
        gpu_error=sup.gpus.error,
        ended=ended,
        estimate=est,
        estimate_error=why,
        python_check=lambda py: envs.check_imports_torch(py, env=run_env),
        parsed=plan.preflight_argv,
        simulated=sup.gpus.simulated,
    )


def fingerprint_for(sup: Supervisor, spec: LaunchSpec, plan: LaunchPlan | None = None) -> EnvFingerprint | None:
    """The run's python environment, fingerprinted (None when the run is not a python program)."""
    plan = plan or LaunchPlan.of(spec)
    python = plan.python
    if python is None:
        return None
    try:  # under the run's environment: its LD_LIBRARY_PATH decides which libnccl `import torch` loads
        return envs.fingerprint(python, driver=sup.gpus.driver_version, env=plan.base_env)
    except AgentError as exc:
        return EnvFingerprint(python=python, error=exc.message, taken=time.time())


async def launch(sup: Supervisor, spec: LaunchSpec, request_id: str = "", host_name: str | None = None) -> tuple[RunInfo, bool]:
    """Pre-flight, then start a run; returns (run, duplicate). A known request_id returns its first run.

    A failed pre-flight starts nothing; the run is recorded as ``preflight_failed`` with the reasons.
    """
    plan = LaunchPlan.of(spec)  # validated, its argv parsed and its environment built: once
    async with sup.launch_lock:
        if request_id:
            earlier = sup.journal.run_by_request(request_id)
            if earlier is not None:
                return sup.with_containment(earlier), True
        if spec.run_id is not None and sup.journal.get_run(spec.run_id) is not None:
            raise BadRequest(f"run {spec.run_id} already exists on {sup.host}")
        pf = await preflight(sup, spec, host_name, plan)
        if not pf.ok:
            return await record_preflight_failed(sup, spec, request_id, pf), False
        env = await asyncio.to_thread(fingerprint_for, sup, spec, plan)
        return await launch_new(sup, plan, request_id, pf, env)


def _record(sup: Supervisor, spec: LaunchSpec, request_id: str, state: str, now: float, **fields: object) -> RunInfo:
    """A new run's record (not yet journaled)."""
    return RunInfo(
        id=spec.run_id or new_run_id(),
        host=sup.host,
        state=state,  # type: ignore[arg-type]
        spec=spec,
        name=spec.name,
        created=now,
        request_id=request_id or None,
        **fields,  # type: ignore[arg-type]
    )


async def record_preflight_failed(sup: Supervisor, spec: LaunchSpec, request_id: str, pf: PreflightResult) -> RunInfo:
    now = time.time()
    cause = failure_summary(pf)
    run = _record(sup, spec, request_id, "preflight_failed", now, cause=cause, ended=now, preflight=pf)
    await sup.runs.create(run, states.PREFLIGHT_REFUSED)  # on disk before the reply; the loop never waits on the disk
    sup.runs.emit_many(
        [
            ("preflight", run.id, {"result": msgspec.to_builtins(pf)}),
            (
                "run_state",
                run.id,
                {
                    "state": "preflight_failed",
                    "cause": cause,
                    "ended": now,
                    "cause_class": "preflight",
                    "evidence": states.PREFLIGHT_REFUSED,
                },
            ),
        ],
        f"run {run.id}'s pre-flight failure",
    )
    return run


async def launch_new(
    sup: Supervisor, plan: LaunchPlan, request_id: str, pf: PreflightResult | None = None, env_fp: EnvFingerprint | None = None
) -> tuple[RunInfo, bool]:
    spec = plan.spec
    run = _record(sup, spec, request_id, "starting", time.time(), preflight=pf, env=env_fp)
    run_id = run.id
    run_dir = sup.runs_dir / run_id
    run.run_dir = str(run_dir)
    try:
        if os.path.lexists(run_dir):
            raise FileExistsError(errno.EEXIST, "a run folder of that id exists already", str(run_dir))
        paths.ensure_private_dir(run_dir)  # 0700 whatever the umask: spec.json holds the run's --env values
        fsync_write(run_dir / "spec.json", msgspec.json.encode(spec))
    except FileExistsError as exc:  # not removed: it is another run's folder (a reused --run-id, or a node launched twice here)
        raise StorageError(
            f"the run folder {run_dir} exists already: run {run_id} was launched on this host before; "
            "launch again without a fixed run id (a new one is drawn), or remove the folder if that run is gone; nothing was started"
        ) from exc
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise StorageError(
            f"cannot create the run folder {run_dir} ({exc.strerror}): free space or fix permissions in {sup.runs_dir}; nothing was started"
        ) from exc
    # the record exists before anything starts: a failed start is never unrecorded
    try:
        await sup.runs.create(run, states.LAUNCHED)  # on disk before anything starts; the loop keeps serving meanwhile
    except StorageError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise StorageError(f"{exc.message}; nothing was started") from exc
    lr = sup.runs.add(LiveRun(info=run, launching=True))
    try:
        return await start_recorded(sup, lr, plan, run_dir, pf, env_fp)
    finally:
        lr.end_launching()


async def start_recorded(
    sup: Supervisor, lr: LiveRun, plan: LaunchPlan, run_dir: Path, pf: PreflightResult | None, env_fp: EnvFingerprint | None
) -> tuple[RunInfo, bool]:
    run = lr.info
    run_id = run.id
    spec = plan.spec
    group: RunGroup | None = None
    problem: str | None  # why the launch cannot go on, or None
    if sup.containment.has_groups:
        try:
            group = sup.containment.create(run_id)
        except OSError as exc:
            problem = f"cannot create the run's cgroup under {getattr(sup.containment, 'base', '?')} ({exc.strerror}); set GPUDECK_CONTAINMENT=tag to run without one"
            fail_launch(sup, run, problem)
            raise LaunchFailed(f"{problem}; run {run_id} is recorded as failed") from exc
    lr.set_group(group)
    run.containment = sup.containment_info(group)
    extra: list[tuple[str, str | None, dict]] = [("containment", run_id, {"containment": msgspec.to_builtins(run.containment)})]
    if pf is not None:
        extra.append(("preflight", run_id, {"result": msgspec.to_builtins(pf)}))
    if env_fp is not None:
        extra.append(("env_fingerprint", run_id, {"env": msgspec.to_builtins(env_fp)}))
    sup.runs.emit_many(extra, f"run {run_id}'s containment/pre-flight/environment records")

    env = plan.run_env(run_id, run_dir)
    # a cwd on a hung NFS/FUSE mount must not freeze the agent: the checks run off the event loop
    try:
        problem = await asyncio.wait_for(asyncio.to_thread(check_executable, spec, env, sup.host), 20.0)
    except TimeoutError:
        problem = f"checking the working directory {spec.cwd} and {spec.argv[0]!r} did not return within 20 s (a hung file system?)"
    if problem is not None:
        fail_launch(sup, run, problem)
        raise LaunchFailed(f"{problem}; run {run_id} is recorded as failed")
    try:
        pid, shim = await asyncio.to_thread(sup.spawn_shim, run, env)
    except LaunchFailed as exc:
        fail_launch(sup, run, exc.message)
        raise LaunchFailed(f"{exc.message}; run {run_id} is recorded as failed") from exc
    lr.attach_shim(shim)
    now = time.time()
    members = [Member(pid=shim.pid, create_time=create_time_of(shim.pid) or 0.0, role="shim", first_seen=now, cmdline=("gpudeck-shim",))]
    leader_ct = create_time_of(pid)
    if leader_ct is not None:
        members.append(
            Member(
                pid=pid,
                create_time=leader_ct,
                role="leader",
                first_seen=now,
                cmdline=tuple(spec.argv),
                found_by="cgroup" if group else "tag",
            )
        )
    sup.runs.transition(run, "running", states.SPAWNED, {"pid": pid}, started=time.time(), members=members)
    return run, False


def fail_launch(sup: Supervisor, run: RunInfo, cause: str) -> None:
    why = f"launch failed: {cause}"
    sup.runs.transition(run, "failed", states.LAUNCH_ERROR, {"cause": why}, cause=why, ended=time.time())
