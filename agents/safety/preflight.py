"""Provides pre-flight: the checks every launch passes on its host before anything starts (failures 1 and 6).

:func:`run_preflight` is logic over facts handed to it (the GPUs, already
attributed; the ended runs; the memory estimate; a python checker; port and
disk probes), so it is tested without GPUs. Each check gives one
:class:`~gpudeck.agents.wire.protocol.PreflightCheck`; a failed check's message says what is
wrong and what to do. A check that does not apply passes with
``details["skipped"]`` set and says why.

* ``gpus_exist``: every requested GPU index exists.
* ``gpu_memory``: each GPU the run uses has the memory it needs free.
* ``gpu_holders``: no FOREIGN, STALE or NO_SUCH_PROCESS process holds memory on
  them, each named (pid, user, GiB, its run and when that run ended, command)
  with the reclaim command; nor does memory that no visible process explains
  (another PID namespace or the driver: :mod:`gpudeck.agents.safety.unaccounted`,
  1 GiB or more on a GPU), named with the GiB and where to look.
  ``--force`` overrides this check, and only this one; it is recorded
  (``overridden``, ``PreflightResult.forced``, ``details["unaccounted"]``).
* ``rdzv_port``: torchrun's rendezvous port is free on this host.
* ``checkpoint_room``: the checkpoint folder's filesystem has room for one checkpoint.
* ``python_env``: the run's interpreter exists and imports torch.
* ``start_explicit``: a trainer run says how it starts, ``fresh`` or ``resume N``;
  there is no default (failure 6).
* ``resume_checkpoint``: the checkpoint a resume names exists, is complete, and passes the trainers' trust
  check (:func:`gpudeck.trainers.checkpoint_trust.verify_checkpoint`: no folder another user can write,
  ``.metadata``'s sha256 and the shards' sizes as the manifest recorded), before anything unpickles it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpudeck.agents.observe import namespace as pid_namespace
from gpudeck.agents.safety import unaccounted
from gpudeck.agents.safety.estimate import (
    CHECKPOINT_BYTES_PER_PARAM,
    TRAINER_MODULES,
    EstimateError,
    LaunchArgv,
    parse_launch_argv,
)
from gpudeck.agents.wire.protocol import (
    Gpu,
    GpuProcess,
    LaunchSpec,
    MemoryEstimate,
    NamespaceInfo,
    PreflightCheck,
    PreflightResult,
    RunInfo,
)
from gpudeck.trainers.checkpoint_trust import CheckpointTrustError, verify_checkpoint

# the checkpoint layout trainers/common/checkpoint.py writes: OUT/checkpoints/step_<N>/ with both files when complete
from gpudeck.trainers.contract import CHECKPOINT_MARKER, CHECKPOINT_METADATA, CHECKPOINTS_DIRNAME
from gpudeck.trainers.contract import STEP_RE as _STEP_RE

GIB = 2**30
CHECKPOINT_MARGIN_BYTES = GIB  # room beyond one checkpoint: logs, result.json, the next write's temp files
TORCHRUN_STATIC_PORT = 29500  # torchrun's --master-port default (static rendezvous)
TORCHRUN_C10D_PORT = 29400  # torchrun's port when --rdzv-endpoint names no port
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0", ""}

CHECK_NAMES = (
    "gpus_exist",
    "gpu_memory",
    "gpu_holders",
    "rdzv_port",
    "checkpoint_room",
    "python_env",
    "start_explicit",
    "resume_checkpoint",
)


# ----------------------------------------------------------------------------- probes


def port_is_free(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` on every interface (IPv4, and IPv6 where there is one).

    SO_REUSEADDR as torch's TCPStore sets it, so a port with only TIME_WAIT leftovers counts as free.
    """
    families = [(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::"))
    for family, addr in families:
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                continue
            return False
        finally:
            s.close()
    return True


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists (where a folder about to be made would live)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes_at(path: Path) -> int:
    """Free bytes (for an unprivileged user) on the filesystem of ``path`` or its nearest existing parent."""
    return shutil.disk_usage(nearest_existing(Path(path))).free


# ----------------------------------------------------------------------------- small words


def _gib(n: int | float | None) -> str:
    return "an unknown amount" if n is None else f"{n / GIB:.1f} GiB"


def _ago(seconds: float) -> str:
    """'40 s ago', '12 min ago', '2 h ago', '3 days ago'."""
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 90 * 60:
        return f"{s / 60:.0f} min ago"
    if s < 48 * 3600:
        return f"{s / 3600:.0f} h ago"
    return f"{s / 86400:.0f} days ago"


def _gpu_list(indices: list[int]) -> str:
    return ",".join(str(i) for i in indices)


def _cmd(cmdline: Sequence[str], limit: int = 160) -> str:
    text = " ".join(cmdline) if cmdline else "(command unknown)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _skip(name: str, why: str, **details: object) -> PreflightCheck:
    return PreflightCheck(name=name, ok=True, message=f"skipped: {why}", details={"skipped": True, **details})


# ----------------------------------------------------------------------------- what the run uses


def _gpus_used(spec: LaunchSpec, gpus: list[Gpu]) -> tuple[list[int], str]:
    """The GPU indices the run will see, and how that was decided."""
    if spec.gpus is not None:
        return list(spec.gpus), f"GPU {_gpu_list(spec.gpus)}" if spec.gpus else "no GPU (--gpus empty)"
    cvd = spec.env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        by_uuid = {g.uuid: g.index for g in gpus}
        picked = []
        for part in (x.strip() for x in cvd.split(",") if x.strip()):
            if part.isdigit():
                picked.append(int(part))
            elif part in by_uuid:
                picked.append(by_uuid[part])
            else:
                break  # CUDA stops at the first entry it cannot parse; so do we
        return picked, f"CUDA_VISIBLE_DEVICES={cvd}"
    return [g.index for g in gpus], "every GPU (no --gpus given)"


def _memory_gpus(spec: LaunchSpec, parsed: LaunchArgv | None, gpus: list[Gpu], used: list[int]) -> list[int]:
    """The GPUs that need the memory: those given, else (a trainer, no CUDA_VISIBLE_DEVICES) the first
    nproc-per-node, which its local ranks take as cuda:0..N-1; else every GPU it may see."""
    if spec.gpus is not None or "CUDA_VISIBLE_DEVICES" in spec.env or parsed is None or parsed.trainer is None:
        return used
    if parsed.launcher == "torchrun":
        nproc = parsed.nproc_per_node or "1"
        if not nproc.isdigit():
            return used
        n = int(nproc)
    else:
        n = 1
    return sorted(g.index for g in gpus)[:n]


class Unparsed:
    """The launch's argv was read and could not be (run_preflight must not read it again)."""


UNPARSED = Unparsed()


def _parsed(spec: LaunchSpec) -> LaunchArgv | None:
    try:
        return parse_launch_argv(spec.argv)
    except EstimateError:
        return None


def _is_trainer(spec: LaunchSpec, parsed: LaunchArgv | None) -> bool:
    return spec.kind in TRAINER_MODULES or (parsed is not None and parsed.trainer is not None)


def _cwd(spec: LaunchSpec) -> Path:
    return Path(spec.cwd or os.getcwd())


def _resolve(path_text: str, spec: LaunchSpec) -> Path:
    p = Path(path_text).expanduser()
    return p if p.is_absolute() else _cwd(spec) / p


@dataclass(frozen=True)
class _TrainerFlags:
    """What pre-flight needs of a trainer's own arguments."""

    out: str | None = None
    start: str | None = None  # "fresh" | "resume X" from --fresh / --resume X
    new_run_dir: bool = False
    trust_checkpoint: bool = False  # --trust-checkpoint: a foreign checkpoint may be resumed
    error: str | None = None  # the arguments could not be read


def _trainer_flags(parsed: LaunchArgv | None) -> _TrainerFlags:
    if parsed is None or parsed.trainer is None:
        return _TrainerFlags()
    try:
        a = parsed.trainer_options()  # read with the argv, once per launch
    except EstimateError as exc:
        return _TrainerFlags(error=exc.message)
    if a.fresh and a.resume is not None:
        return _TrainerFlags(out=a.out, error="--fresh and --resume are both given; the trainer takes exactly one")
    start = "fresh" if a.fresh else (f"resume {a.resume}" if a.resume is not None else None)
    return _TrainerFlags(out=a.out, start=start, new_run_dir=bool(a.new_run_dir), trust_checkpoint=bool(a.trust_checkpoint))


def _checkpoint_root(spec: LaunchSpec, out: str | None) -> Path | None:
    """The folder holding step_<N>/: OUT/checkpoints of the trainer's --out, else the spec's checkpoint_dir."""
    if out is not None:
        return _resolve(out, spec) / CHECKPOINTS_DIRNAME
    if spec.checkpoint_dir:
        root = _resolve(spec.checkpoint_dir, spec)
        # checkpoint_dir may name OUT or OUT/checkpoints
        return root / CHECKPOINTS_DIRNAME if (root / CHECKPOINTS_DIRNAME).is_dir() else root
    return None


def _scan_checkpoints(root: Path) -> tuple[list[int], list[int]]:
    """(complete steps, incomplete steps) under ``root``, ascending."""
    complete, incomplete = [], []
    try:
        children = list(root.iterdir())
    except OSError:
        return [], []
    for child in children:
        m = _STEP_RE.match(child.name)
        if not m or not child.is_dir():
            continue
        if (child / CHECKPOINT_MARKER).is_file() and (child / CHECKPOINT_METADATA).is_file():
            complete.append(int(m.group(1)))
        else:
            incomplete.append(int(m.group(1)))
    return sorted(complete), sorted(incomplete)


def _steps(steps: list[int]) -> str:
    return ", ".join(f"step_{s}" for s in steps) if steps else "none"


# ----------------------------------------------------------------------------- the checks


def _check_gpus_exist(spec: LaunchSpec, host: str, gpus: list[Gpu], gpu_error: str | None) -> PreflightCheck:
    name = "gpus_exist"
    have = sorted(g.index for g in gpus)
    if spec.gpus is None:
        if not gpus:
            return _skip(name, f"no GPUs requested; {host} has none ({gpu_error or 'NVML reports no GPU'})")
        return PreflightCheck(name=name, ok=True, message=f"no --gpus given: the run sees all {len(gpus)} GPUs of {host}")
    if not spec.gpus:
        return PreflightCheck(name=name, ok=True, message="no GPU requested (--gpus empty)")
    if not gpus:
        return PreflightCheck(
            name=name,
            ok=False,
            message=f"GPU {_gpu_list(spec.gpus)} requested, but {host} has no usable GPU ({gpu_error or 'NVML reports none'}): "
            "launch on a host with GPUs, or without --gpus to run on the CPU",
            details={"requested": list(spec.gpus), "gpu_error": gpu_error},
        )
    dupes = sorted({g for g in spec.gpus if spec.gpus.count(g) > 1})
    missing = [g for g in spec.gpus if g not in have]
    if dupes or missing:
        why = []
        if missing:
            why.append(f"GPU {_gpu_list(missing)} {'does' if len(missing) == 1 else 'do'} not exist on {host}")
        if dupes:
            why.append(f"GPU {_gpu_list(dupes)} is listed twice")
        return PreflightCheck(
            name=name,
            ok=False,
            message=f"{'; '.join(why)}: it has {len(have)} GPU{'s' if len(have) != 1 else ''} ({_gpu_list(have)}); "
            "pick distinct indices from those with --gpus",
            details={"requested": list(spec.gpus), "missing": missing, "duplicates": dupes, "have": have},
        )
    plural = len(spec.gpus) > 1
    return PreflightCheck(
        name=name, ok=True, message=f"GPU{'s' if plural else ''} {_gpu_list(spec.gpus)} exist{'' if plural else 's'} on {host}"
    )


def _holder_text(p: GpuProcess, host: str, ended: dict[str, RunInfo], now: float) -> tuple[str, str]:
    """(who holds what, the fix) for one process on a GPU."""
    user = p.user or "unknown user"
    held = _gib(p.used_bytes)
    if p.attribution == "STALE":
        run = ended.get(p.run_id or "")
        if run is not None and run.ended:
            when = f"ended {_ago(now - run.ended)}" + (f": {run.cause}" if run.cause else "")
        else:
            when = "ended"
        return f"pid {p.pid} ({user}, run {p.run_id or '?'}, {when}) holds {held}", f"`gpudeck reclaim {host}:{p.pid}`"
    if p.attribution == "RUN":
        rank = f" rank {p.rank}" if p.rank is not None else ""
        return f"pid {p.pid} ({user}, live run {p.run_id}{rank}) holds {held}", f"`gpudeck stop {p.run_id}` if it should not be there"
    if p.attribution == "NO_SUCH_PROCESS":
        return (
            f"pid {p.pid} (NVML reports it, the OS here does not: another container or PID namespace) holds {held}",
            "stop it where it runs; it cannot be reclaimed from here",
        )
    return (
        f"pid {p.pid} ({user}, not a gpudeck run) holds {held}",
        f"`gpudeck reclaim {host}:{p.pid}` if it is yours to stop, else ask {user}",
    )


def _check_gpu_memory(
    spec: LaunchSpec,
    host: str,
    gpus: list[Gpu],
    used: list[int],
    estimate: MemoryEstimate | None,
    estimate_error: str | None,
    ended: dict[str, RunInfo],
    now: float,
) -> PreflightCheck:
    name = "gpu_memory"
    if estimate is None:
        if estimate_error:
            return _skip(name, f"no estimate ({estimate_error})")
        return _skip(name, "no estimate: give --need-gib GIB to have the free memory checked")
    by_index = {g.index: g for g in gpus}
    present = [by_index[i] for i in used if i in by_index]
    if not present:
        return _skip(name, "no GPU to check", need_bytes=estimate.per_gpu_bytes)
    need = estimate.per_gpu_bytes
    how = "given with --need-gib" if estimate.method == "given with --need-gib" else "estimated"
    free = {g.index: g.memory_total - g.memory_used for g in present}
    short = [g for g in present if free[g.index] < need]
    details = {"need_bytes": need, "free_bytes": {str(i): f for i, f in free.items()}, "method": estimate.method}
    if not short:
        frees = ", ".join(f"GPU {i}: {_gib(f)}" for i, f in free.items())
        return PreflightCheck(name=name, ok=True, message=f"{frees} free; the run needs {_gib(need)} each ({how})", details=details)
    lines = []
    for g in short:
        text = f"GPU {g.index} has {_gib(free[g.index])} free, the run needs {_gib(need)} ({how})"
        holders = sorted(g.processes, key=lambda p: -(p.used_bytes or 0))
        if holders:
            parts = []
            for p in holders:
                who, remedy = _holder_text(p, host, ended, now)
                parts.append(f"{who} — {remedy}")
            text += ": " + "; ".join(parts)
        if g.unaccounted_bytes:
            text += (
                "; " if holders else ": "
            ) + f"{_gib(g.unaccounted_bytes)} is held by no visible process (another PID namespace or the driver)"
        lines.append(text)
    roomy = [g.index for g in gpus if g.memory_total - g.memory_used >= need]
    fix: list[str] = []
    if roomy and set(roomy) != set(used):
        fix.append(f"use GPUs with room (--gpus {_gpu_list(roomy)})")
    fix.append("free the memory")
    if how == "estimated":
        fix.append("shrink --batch-size or add --activation-checkpointing")
        fix.append("or give the real need with --need-gib GIB if the estimate is wrong")
    else:
        fix.append("or lower --need-gib if the run needs less")
    return PreflightCheck(name=name, ok=False, message="; ".join(lines) + ". Fix: " + ", ".join(fix), details=details)


def _check_holders(
    spec: LaunchSpec,
    host: str,
    gpus: list[Gpu],
    used: list[int],
    used_note: str,
    ended: dict[str, RunInfo],
    now: float,
    ns: NamespaceInfo | None,
    simulated: bool,
) -> PreflightCheck:
    name = "gpu_holders"
    used_set = set(used)
    on = [g for g in gpus if g.index in used_set]
    if not on:
        return _skip(name, "no GPU to check")
    blocking = [p for g in on for p in g.processes if p.attribution != "RUN"]
    hidden = unaccounted.unaccounted(on, ns, simulated)
    hidden_holders = [u for u in hidden if u.holder]
    live = sorted({p.run_id for g in on for p in g.processes if p.attribution == "RUN" and p.run_id})
    where = f"GPU {_gpu_list([g.index for g in on])}" + (f" ({used_note})" if spec.gpus is None else "")
    if not blocking and not hidden_holders:
        msg = f"no foreign or stale process on {where}"
        if live:
            msg += f" (live run{'s' if len(live) > 1 else ''} {', '.join(live)} share{'' if len(live) > 1 else 's'} them)"
        small = [u for u in hidden if not u.holder]
        if small:
            msg += "; not counted as holders: " + "; ".join(
                f"GPU {u.gpu}: {_gib(u.used_bytes)} held by no visible process"
                + (
                    f" (under the {_gib(unaccounted.UNACCOUNTED_HOLDER_BYTES)} threshold)"
                    if u.used_bytes < unaccounted.UNACCOUNTED_HOLDER_BYTES
                    else " (a listed process's memory is not reported)"
                )
                for u in small
            )
        return PreflightCheck(name=name, ok=True, message=msg, details={"live_runs": live})
    items, holders = [], []
    for p in sorted(blocking, key=lambda p: (p.gpu, -(p.used_bytes or 0))):
        who, fix = _holder_text(p, host, ended, now)
        items.append(f"GPU {p.gpu}: {who}: `{_cmd(p.cmdline)}` — {fix}")
        run = ended.get(p.run_id or "")
        holders.append(
            {
                "pid": p.pid,
                "gpu": p.gpu,
                "attribution": p.attribution,
                "user": p.user,
                "used_bytes": p.used_bytes,
                "run_id": p.run_id,
                "run_ended": run.ended if run else None,
                "run_cause": run.cause if run else None,
                "cmdline": list(p.cmdline),
                "status": p.status,
            }
        )
    # memory no visible process explains is a holder too; it has no pid, so it is listed apart ("holders" are pids)
    for u in hidden_holders:
        items.append(f"GPU {u.gpu}: {_gib(u.used_bytes)} {u.note}")
    parts = []
    if blocking:
        n = len(blocking)
        parts.append(f"{n} process{'es' if n > 1 else ''} not of a live run hold{'' if n > 1 else 's'} memory")
    if hidden_holders:
        parts.append("memory no visible process explains is held")
    body = f"{' and '.join(parts)} on {where}. " + "; ".join(items)
    details: dict[str, object] = {"holders": holders}
    if hidden_holders:
        details["unaccounted"] = [{"gpu": u.gpu, "used_bytes": u.used_bytes} for u in hidden_holders]
    fix = "Reclaim them, pick" if blocking else "Pick"
    if spec.force:
        return PreflightCheck(
            name=name,
            ok=False,
            overridden=True,
            message=f"overridden with --force (recorded): {body}",
            details={**details, "forced": True},
        )
    return PreflightCheck(
        name=name,
        ok=False,
        message=f"{body}. {fix} other GPUs with --gpus, or launch anyway with --force (recorded)",
        details=details,
    )


def _rendezvous(spec: LaunchSpec, host: str, parsed: LaunchArgv | None) -> tuple[int | None, str]:
    """The rendezvous port this host must have free, or None and why not."""
    if spec.rdzv_port is not None:
        return spec.rdzv_port, "the launch's rendezvous port"
    if parsed is None or parsed.launcher != "torchrun":
        return None, "not a torchrun launch"
    if parsed.standalone:
        return None, "torchrun --standalone picks a free port itself"
    endpoint_host, endpoint_port = None, None
    if parsed.rdzv_endpoint:
        text = parsed.rdzv_endpoint
        if text.startswith("["):  # [v6]:port
            h, _, rest = text[1:].partition("]")
            endpoint_host, endpoint_port = h, rest.lstrip(":") or None
        else:
            h, sep, port = text.rpartition(":")
            endpoint_host, endpoint_port = (h, port) if sep else (text, None)
    if endpoint_host is not None and endpoint_host not in _LOCAL_HOSTS and endpoint_host != host:
        return None, f"the rendezvous is at {endpoint_host}, not on this host"
    if parsed.rdzv_backend != "static":
        if endpoint_port and endpoint_port.isdigit():
            return int(endpoint_port), f"--rdzv-endpoint {parsed.rdzv_endpoint}"
        return TORCHRUN_C10D_PORT, f"torchrun's default rendezvous port (--rdzv-endpoint {parsed.rdzv_endpoint or 'unset'})"
    if parsed.master_port is not None:
        return parsed.master_port, f"--master-port {parsed.master_port}"
    if endpoint_port and endpoint_port.isdigit():
        return int(endpoint_port), f"--rdzv-endpoint {parsed.rdzv_endpoint}"
    return TORCHRUN_STATIC_PORT, f"torchrun's default --master-port {TORCHRUN_STATIC_PORT}"


def _check_rdzv_port(spec: LaunchSpec, host: str, parsed: LaunchArgv | None, port_free: Callable[[int], bool]) -> PreflightCheck:
    name = "rdzv_port"
    node_rank = spec.node_rank if spec.node_rank is not None else (parsed.node_rank if parsed else None)
    if node_rank:
        return _skip(name, f"node {node_rank}: the rendezvous is hosted by node 0")
    port, why = _rendezvous(spec, host, parsed)
    if port is None:
        return _skip(name, why)
    if port_free(port):
        return PreflightCheck(name=name, ok=True, message=f"port {port} ({why}) is free on {host}", details={"port": port})
    return PreflightCheck(
        name=name,
        ok=False,
        message=f"port {port} ({why}) is in use on {host} (another torchrun, or anything listening there): "
        "give a free one with --master-port PORT (torchrun), or use torchrun --standalone on a single node",
        details={"port": port},
    )


def _check_checkpoint_room(
    spec: LaunchSpec, out: str | None, estimate: MemoryEstimate | None, disk_free: Callable[[Path], int]
) -> PreflightCheck:
    name = "checkpoint_room"
    folder = _resolve(spec.checkpoint_dir, spec) if spec.checkpoint_dir else (_resolve(out, spec) / CHECKPOINTS_DIRNAME if out else None)
    if folder is None:
        return _skip(name, "no checkpoint folder (no --out, no checkpoint_dir)")
    if estimate is None or not estimate.params:
        return _skip(name, f"size of a checkpoint unknown (no parameter count) for {folder}", folder=str(folder))
    need = estimate.params * CHECKPOINT_BYTES_PER_PARAM + CHECKPOINT_MARGIN_BYTES
    where = nearest_existing(folder)
    try:
        free = disk_free(folder)
    except OSError as exc:
        return PreflightCheck(
            name=name,
            ok=False,
            message=f"cannot read the free space at {where} ({exc.strerror or exc}): fix the path or its permissions",
            details={"folder": str(folder)},
        )
    details = {"folder": str(folder), "checked_at": str(where), "free_bytes": free, "need_bytes": need}
    size = (
        f"one checkpoint of {estimate.params:,} params needs {_gib(estimate.params * CHECKPOINT_BYTES_PER_PARAM)} "
        f"({CHECKPOINT_BYTES_PER_PARAM} B/param: fp32 weights + AdamW) + {_gib(CHECKPOINT_MARGIN_BYTES)}"
    )
    if free >= need:
        return PreflightCheck(name=name, ok=True, message=f"{_gib(free)} free at {where}; {size}", details=details)
    return PreflightCheck(
        name=name,
        ok=False,
        message=f"{folder} has {_gib(free)} free (filesystem of {where}); {size}: free space there, lower --keep, "
        "or point --out at a bigger disk",
        details=details,
    )


def _shebang_python(script: Path) -> str | None:
    """The interpreter a console script (torchrun) runs with, from its first lines."""
    try:
        with open(script, "rb") as fh:
            head = fh.read(1024).decode(errors="replace")
    except OSError:
        return None
    lines = head.splitlines()
    if not lines or not lines[0].startswith("#!"):
        return None
    words = lines[0][2:].split()
    if not words:
        return None
    if os.path.basename(words[0]) == "env" and len(words) > 1:
        return shutil.which(words[1])
    if os.path.basename(words[0]).startswith("python"):
        return words[0]
    # pip's long-path form: #!/bin/sh then '''exec' "/path/to/python" "$0" "$@"
    for line in lines[1:3]:
        m = re.search(r"exec' \"?([^\" ]+)\"?", line)
        if m:
            return m.group(1)
    return None


def run_python(spec: LaunchSpec, parsed: LaunchArgv | None) -> tuple[str | None, str]:
    """The interpreter of the run and how it was found: spec.python, argv[0] if a python, else torchrun's."""
    if spec.python:
        return spec.python, "the launch's python"
    if parsed is None:
        return None, "no command"
    path = spec.env.get("PATH", os.environ.get("PATH"))
    exe = parsed.executable
    if parsed.python is not None:
        if os.sep in exe:
            return str(_resolve(exe, spec)), "argv[0]"
        found = shutil.which(exe, path=path)
        return (found or exe), "argv[0]" + (f" on PATH ({found})" if found else "")
    if os.path.basename(exe) == "torchrun":
        script = str(_resolve(exe, spec)) if os.sep in exe else shutil.which(exe, path=path)
        if script is None:
            return None, f"{exe!r} is not on PATH"
        py = _shebang_python(Path(script))
        if py:
            return py, f"the interpreter of {script}"
        sibling = Path(script).with_name("python")
        if sibling.exists():
            return str(sibling), f"the python next to {script}"
        return None, f"cannot tell which python {script} runs"
    return None, f"{exe} is neither python nor torchrun"


def _check_python(spec: LaunchSpec, parsed: LaunchArgv | None, python_check: Callable[[str], tuple[bool, str]] | None) -> PreflightCheck:
    name = "python_env"
    if not (spec.python or _is_trainer(spec, parsed)):
        return _skip(name, "a plain command names no python environment")
    python, how = run_python(spec, parsed)
    if python is None:
        return PreflightCheck(
            name=name,
            ok=False,
            message=f"cannot tell which python runs this launch ({how}): give the environment's interpreter "
            "with --python PATH, or start the command with it (`/venv/bin/python -m gpudeck.trainers.fsdp_lm ...`)",
        )
    if not _is_trainer(spec, parsed):
        # a plain command in a named environment: the interpreter must exist; torch is the trainers' need, not its
        exe = python if os.sep in python else (shutil.which(python) or "")
        if exe and os.access(exe, os.X_OK):
            return PreflightCheck(
                name=name, ok=True, message=f"{python} ({how}) exists (torch is only required for trainer runs)", details={"python": python}
            )
        return PreflightCheck(
            name=name,
            ok=False,
            message=f"{python} ({how}) does not exist or is not executable on this host: give an existing interpreter with --python",
            details={"python": python},
        )
    if python_check is None:
        return _skip(name, f"{python} ({how}) not checked", python=python)
    ok, text = python_check(python)
    return PreflightCheck(name=name, ok=ok, message=f"{python} ({how}): {text}", details={"python": python})


def _spec_start(spec: LaunchSpec) -> tuple[str | None, str | None]:
    """The spec's start normalised ("fresh" | "resume N" | "resume latest"), or an error."""
    if spec.start is None:
        return None, None
    words = spec.start.split()
    if words == ["fresh"]:
        return "fresh", None
    if len(words) == 2 and words[0] == "resume" and (words[1] == "latest" or words[1].isdigit()):
        return f"resume {int(words[1]) if words[1].isdigit() else 'latest'}", None
    return None, f"start {spec.start!r} is neither 'fresh' nor 'resume N' (or 'resume latest')"


def _check_start(spec: LaunchSpec, parsed: LaunchArgv | None, flags: _TrainerFlags) -> tuple[PreflightCheck, str | None]:
    """start_explicit, and the start the run will make."""
    name = "start_explicit"
    if not _is_trainer(spec, parsed):
        return _skip(name, "not a trainer run"), None
    if flags.error:
        return PreflightCheck(
            name=name, ok=False, message=f"cannot read the trainer's arguments: {flags.error}; fix the command line"
        ), None
    out, argv_start, new_run_dir = flags.out, flags.start, flags.new_run_dir
    given, bad = _spec_start(spec)
    if bad:
        return PreflightCheck(name=name, ok=False, message=f"{bad}: choose `fresh` or `resume at step N`"), None
    if argv_start is not None and argv_start.startswith("resume ") and argv_start != "resume latest":
        argv_start = f"resume {int(argv_start.split()[1])}"
    if given is None and argv_start is None:
        return PreflightCheck(
            name=name,
            ok=False,
            message="no start given: choose `fresh` (step 0, new checkpoints; --fresh) or `resume at step N` (--resume N); "
            "there is no default, so a resume is never taken for a fresh start or the other way round",
        ), None
    if given is not None and argv_start is not None and given != argv_start:
        return PreflightCheck(
            name=name,
            ok=False,
            message=f"the launch says start {given!r} but its command line says {argv_start!r}: make them agree",
        ), None
    start = given or argv_start
    if start == "fresh" and not new_run_dir:
        root = _checkpoint_root(spec, out)
        if root is not None and root.is_dir():
            complete, incomplete = _scan_checkpoints(root)
            if complete or incomplete:
                latest = f"`resume at step {complete[-1]}`" if complete else "a resume"
                return PreflightCheck(
                    name=name,
                    ok=False,
                    message=f"start fresh, but {root} already holds checkpoints ({_steps(complete + incomplete)}) that a fresh "
                    f"start would mix with: continue with {latest}, add --new-run-dir to move them aside, "
                    "or pick another --out",
                    details={"complete": complete, "incomplete": incomplete},
                ), start
    return PreflightCheck(name=name, ok=True, message=f"start: {start}"), start


def _check_resume(spec: LaunchSpec, out: str | None, start: str | None, trust: bool = False) -> PreflightCheck:
    name = "resume_checkpoint"
    if start is None or not start.startswith("resume"):
        return _skip(name, "not resuming")
    which = start.split()[1]
    root = _checkpoint_root(spec, out)
    if root is None:
        return PreflightCheck(
            name=name,
            ok=False,
            message=f"cannot look up the checkpoint for {start}: the command has no --out and the launch "
            "no checkpoint folder; add --out OUT (the run's output folder)",
        )
    complete, incomplete = _scan_checkpoints(root)
    details = {"folder": str(root), "complete": complete, "incomplete": incomplete}
    partial = (
        f" ({_steps(incomplete)} incomplete: no {CHECKPOINT_MARKER} or {CHECKPOINT_METADATA}, a save that did not finish)"
        if incomplete
        else ""
    )
    if which == "latest":
        if complete:
            return _check_trust(root, out, spec, complete[-1], trust, f"resume latest: step_{complete[-1]} in {root} is complete", details)
        return PreflightCheck(
            name=name,
            ok=False,
            message=f"resume latest: no complete checkpoint in {root}{partial}; start `fresh` instead, "
            "or point --out at the run's output folder",
            details=details,
        )
    step = int(which)
    if step in complete:
        return _check_trust(
            root, out, spec, step, trust, f"step_{step} in {root} is complete ({CHECKPOINT_MARKER}, {CHECKPOINT_METADATA})", details
        )
    state = "is incomplete" if step in incomplete else "does not exist"
    pick = f"resume from one of those (`resume at step {complete[-1]}`)" if complete else "start `fresh`"
    return PreflightCheck(
        name=name,
        ok=False,
        message=f"step_{step} {state} in {root}; complete checkpoints there: {_steps(complete)}{partial}; {pick}",
        details=details,
    )


def _check_trust(root: Path, out: str | None, spec: LaunchSpec, step: int, trust: bool, ok_message: str, details: dict) -> PreflightCheck:
    """The trainers' own check of a complete checkpoint, run before the launch (nothing in it is unpickled here)."""
    try:
        verdict = verify_checkpoint(root / f"step_{step}", out=_resolve(out, spec) if out is not None else None, trust=trust)
    except CheckpointTrustError as exc:
        return PreflightCheck(name="resume_checkpoint", ok=False, message=str(exc), details={**details, "refused": str(exc.path)})
    note = f"; foreign, loaded by --trust-checkpoint: {'; '.join(verdict.foreign)}" if verdict.foreign else ""
    return PreflightCheck(
        name="resume_checkpoint", ok=True, message=f"{ok_message}, its digests verified{note}", details={**details, **verdict.record()}
    )


# ----------------------------------------------------------------------------- entry points


def run_preflight(
    spec: LaunchSpec,
    *,
    host: str,
    gpus: list[Gpu],
    gpu_error: str | None,
    ended: dict[str, RunInfo],
    estimate: MemoryEstimate | None,
    python_check: Callable[[str], tuple[bool, str]] | None,
    port_free: Callable[[int], bool] = port_is_free,
    disk_free: Callable[[Path], int] = free_bytes_at,
    estimate_error: str | None = None,
    now: float | None = None,
    parsed: LaunchArgv | None | Unparsed = None,
    namespace: NamespaceInfo | None = None,
    simulated: bool = False,
) -> PreflightResult:
    """Every pre-flight check of ``spec`` on ``host``; nothing may start unless the result is ``ok``.

    ``gpus`` are this host's GPUs with their processes attributed; ``ended`` maps run ids to ended
    runs (to say when a STALE holder's run ended); ``estimate`` is the memory each GPU needs
    (:func:`gpudeck.agents.safety.estimate.estimate`), ``estimate_error`` why there is none; ``python_check``
    answers whether an interpreter imports torch (``gpudeck.agents.safety.envs.check_imports_torch``);
    ``parsed``: the launch's argv as its :class:`~gpudeck.agents.runs.launch.LaunchPlan` read it (once per launch;
    :data:`UNPARSED` when it could not be read), else it is read here; ``namespace``: the agent's PID namespace
    (read here when not given), for what the note on unaccounted memory says; ``simulated``: the GPUs are simulated.
    """
    t0 = time.monotonic()
    now = time.time() if now is None else now
    parsed = _parsed(spec) if parsed is None else (None if isinstance(parsed, Unparsed) else parsed)
    flags = _trainer_flags(parsed)
    used, used_note = _gpus_used(spec, gpus)
    start_check, start = _check_start(spec, parsed, flags)
    checks = [
        _check_gpus_exist(spec, host, gpus, gpu_error),
        _check_gpu_memory(spec, host, gpus, _memory_gpus(spec, parsed, gpus, used), estimate, estimate_error, ended, now),
        _check_holders(spec, host, gpus, used, used_note, ended, now, namespace or pid_namespace.current(), simulated),
        _check_rdzv_port(spec, host, parsed, port_free),
        _check_checkpoint_room(spec, flags.out, estimate, disk_free),
        _check_python(spec, parsed, python_check),
        start_check,
        _check_resume(spec, flags.out, start, flags.trust_checkpoint),
    ]
    return PreflightResult(
        ok=all(c.ok or c.overridden for c in checks),
        host=host,
        checks=checks,
        estimate=estimate,
        forced=any(c.overridden for c in checks),
        seconds=round(time.monotonic() - t0, 6),
    )


def failure_summary(result: PreflightResult) -> str:
    """One line for a ``preflight_failed`` run's cause: the failed checks' messages."""
    failed = [c for c in result.checks if not c.ok and not c.overridden]
    return "pre-flight failed: " + " | ".join(f"{c.name}: {c.message}" for c in failed) if failed else "pre-flight passed"
