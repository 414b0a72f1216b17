"""Provides how an ended run's cause is found and classified (failure 8: never "(no output)").

``classify_output`` reads the tail of a run's output for a known failure;
``cause_class`` turns a cause text into the short class that history queries
use (``gpudeck history cause:oom``).
"""

from __future__ import annotations

import re

# Failure causes recognised in the tail of a run's output, most specific first.
_OUTPUT_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDA error: out of memory"), "CUDA out of memory"),
    (re.compile(r"Watchdog caught collective operation timeout|NCCL.*[Tt]imeout|ProcessGroupNCCL.*timed out"), "NCCL timeout"),
    (re.compile(r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError"), "NCCL error"),
    (re.compile(r"ChildFailedError"), "a rank died (torchrun ChildFailedError)"),
    (re.compile(r"Traceback \(most recent call last\)"), "Python exception"),
]

# cause text -> class, checked in order (the first match wins)
_CLASSES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^pre-?flight", re.I), "preflight"),
    (re.compile(r"CUDA out of memory"), "oom"),
    (re.compile(r"host OOM killer|out-of-memory killer|oom-kill", re.I), "host_oom"),
    (re.compile(r"NCCL timeout"), "nccl_timeout"),
    (re.compile(r"NCCL error"), "nccl"),
    (re.compile(r"rank \d+ died first|a rank died|rank died", re.I), "rank_died"),
    (re.compile(r"--on-hang stop"), "hang"),
    (re.compile(r"^stopped by operator"), "operator"),
    (re.compile(r"^launch (failed|interrupted)"), "launch_failed"),
    (re.compile(r"agent lost track|node lost|unreachable and never reported", re.I), "lost"),
    (re.compile(r"killed by SIG"), "signal"),
    (re.compile(r"Python exception"), "exception"),
    (re.compile(r"^exit code 0\b"), "ok"),
    (re.compile(r"^exit code"), "exit_code"),
]

CLASSES = (
    "preflight",
    "oom",
    "host_oom",
    "nccl_timeout",
    "nccl",
    "rank_died",
    "hang",
    "operator",
    "launch_failed",
    "lost",
    "signal",
    "exception",
    "ok",
    "exit_code",
)


def classify_output(tail: str) -> str | None:
    """The most specific known failure cause found in a run's last output, if any."""
    for pattern, cause in _OUTPUT_PATTERNS:
        if pattern.search(tail):
            if cause == "Python exception":
                last = [ln for ln in tail.strip().splitlines() if ln and not ln.startswith(" ")]
                return f"Python exception: {last[-1][:200]}" if last else cause
            return cause
    return None


def cause_class(state: str | None, cause: str | None) -> str | None:
    """The class of a cause (``oom``, ``signal``, ``operator``, ...); None while the run is live or unexplained."""
    if state == "preflight_failed":
        return "preflight"
    if state == "lost":
        return "lost"
    if not cause:
        return None
    for pattern, cls in _CLASSES:
        if pattern.search(cause):
            return cls
    return None


_OOM_KILL = re.compile(
    r"(?:Out of memory|Memory cgroup out of memory|oom-kill).*?(?:Killed process|task_memcg=|pid=)\s*(\d+)|Killed process (\d+)"
)


def _kernel_log() -> str:
    """The kernel ring buffer, when this user may read it ('' otherwise)."""
    import subprocess

    try:
        cp = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return cp.stdout if cp.returncode == 0 else ""


def oom_kill_count() -> int | None:
    """The kernel's count of OOM kills since boot (/proc/vmstat oom_kill)."""
    try:
        with open("/proc/vmstat") as fh:
            for line in fh:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


_STAMP = re.compile(r"^\[\s*(\d+\.\d+)\]")


def host_oom_note(pids: list[int], since: float | None = None) -> str | None:
    """Evidence that the host's (or a cgroup's) OOM killer took one of ``pids`` after ``since``, from the kernel log."""
    wanted = {int(p) for p in pids}
    if not wanted:
        return None
    boot = None
    if since is not None:
        import psutil

        boot = psutil.boot_time()
    for line in _kernel_log().splitlines():
        stamp = _STAMP.match(line)
        if boot is not None and stamp is not None and boot + float(stamp.group(1)) < since - 5:  # type: ignore[operator]
            continue  # an older kill of a pid that has since been reused
        for m in _OOM_KILL.finditer(line):
            pid = int(m.group(1) or m.group(2))
            if pid in wanted:
                return f"the kernel log says pid {pid} was killed for lack of memory: {line.strip()[-160:]}"
    return None
