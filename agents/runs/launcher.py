"""Provides the launch steps: validate a spec once, build the run's environment once, spawn it through the shim into its group.

The launch argv is parsed once per launch (:class:`LaunchPlan`); what the
supervisor, the fingerprint and the checks need of it comes from that one parse.
"""

from __future__ import annotations

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

from gpudeck.agents.safety.containment import RunGroup
from gpudeck.agents.safety.estimate import LaunchArgv
from gpudeck.agents.safety.preflight import UNPARSED, Unparsed, parse_launch_argv, run_python
from gpudeck.agents.wire import paths
from gpudeck.agents.wire.errors import BadRequest, LaunchFailed
from gpudeck.agents.wire.protocol import MAX_ARGV, LaunchSpec, RunInfo

# run as a script with -I: stdlib only, so the run's own PYTHONPATH and cwd never matter
SHIM = str(Path(__file__).resolve().with_name("shim.py"))
# where the shim lived before agents/ had subpackages (gpudeck 0.1.0 up to the runs/ move): a run launched by
# such an agent and still alive across the upgrade is that run's shim all the same
SHIMS = frozenset({SHIM, str(Path(__file__).resolve().parent.parent / "shim.py")})
SHIM_START_TIMEOUT_S = 15.0
_RUN_ID_RE = re.compile(r"^r-[0-9a-f]{8}$")


def validate(spec: LaunchSpec) -> None:
    """Refuse a spec that cannot be started as given, naming the field and the fix."""
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
