"""Provides the trainers' side of gpudeck's triage: stacks on a signal, compute vs collective-wait time, Flight Recorder.

``install_stack_dump(rank) -> dict``
    registers ``faulthandler`` on ``STACK_SIGNAL`` (SIGUSR2) to append every
    thread's Python stack to ``RUN_DIR/stacks/rank<R>.<PID>.txt`` (RUN_DIR: the
    folder of ``GPUDECK_TELEMETRY``); returns the manifest fields that tell the
    agent so (``stack_signal``). The handler is faulthandler's C handler: it
    writes even while the main thread blocks in a collective or holds the GIL
    in a C call, and needs no ptrace. The agent signals only a pid whose
    manifest carries ``stack_signal``. Nothing is registered without
    ``GPUDECK_TELEMETRY``.

``CollectiveClock``
    the seconds this process's main thread has spent waiting on
    torch.distributed collectives: ``Work.wait`` (every synchronous collective
    and every ``async_op=True`` handle FSDP waits on goes through it) is timed
    with ``time.perf_counter``. On CPU (gloo) ``wait`` blocks until the peers
    arrive, so a step's ``wait_s`` is the time spent waiting for them and
    ``compute_s = step wall time - wait_s``. On CUDA (NCCL) ``wait`` does not
    block the host (it orders streams), so the wall-clock split would be
    meaningless: ``measures_wall`` is False and the trainers report no
    ``compute_s`` there (CUDA events around the compute are not implemented yet).

``flight_recorder_env(run_dir)``
    the environment that turns on torch's NCCL Flight Recorder at a small
    buffer (``TORCH_NCCL_TRACE_BUFFER_SIZE``) and has it dump into the run's
    folder on a collective timeout; set before ``init_process_group``, NCCL only.

``maybe_sleep_for_test(step, rank)``
    test hook: ``GPUDECK_TEST_SLEEP_AT_STEP=N:R[:SECONDS]`` makes rank R sleep
    (default 3600 s) before step N, outside any collective: a hang for the tests.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from typing import IO, Any

from gpudeck.trainers.contract import stack_file

STACK_SIGNAL = signal.SIGUSR2
SLEEP_ENV = "GPUDECK_TEST_SLEEP_AT_STEP"
FR_BUFFER_ENTRIES = 2000  # Flight Recorder entries kept per rank (torch's own default is 0: off)

_dump_file: IO[str] | None = None  # kept open for the process's life: faulthandler writes to its fd


def run_dir() -> str | None:
    """The run's folder gpudeck gave this process (the folder of GPUDECK_TELEMETRY), or None."""
    path = os.environ.get("GPUDECK_TELEMETRY")
    return os.path.dirname(os.path.abspath(path)) if path else None


def install_stack_dump(rank: int) -> dict[str, Any]:
    """Register faulthandler on SIGUSR2 into the run's folder; the manifest fields that say so ({} when not under gpudeck)."""
    global _dump_file
    folder = run_dir()
    if folder is None or _dump_file is not None:
        return {"stack_signal": STACK_SIGNAL.name} if _dump_file is not None else {}
    path = stack_file(folder, rank, os.getpid())
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    _dump_file = open(path, "a", encoding="utf-8")
    faulthandler.register(STACK_SIGNAL, file=_dump_file, all_threads=True, chain=False)
    return {"stack_signal": STACK_SIGNAL.name}


class CollectiveClock:
    """Seconds the main thread spent in torch.distributed ``Work.wait`` (see the module docstring)."""

    _installed = False
    _waited = 0.0
    _calls = 0  # waits timed (bench/triage.py counts them per step)

    def __init__(self, on_cuda: bool) -> None:
        self.measures_wall = not on_cuda
        if self.measures_wall:
            self._install()

    @classmethod
    def _install(cls) -> None:
        if cls._installed:
            return
        import torch.distributed as dist

        work = dist.Work
        original = work.wait
        main = threading.main_thread().ident

        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != main:
                return original(self, *args, **kwargs)
            CollectiveClock._calls += 1
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                CollectiveClock._waited += time.perf_counter() - t0

        work.wait = wait  # type: ignore[method-assign]
        cls._installed = True

    def mark(self) -> tuple[float, int]:
        """(seconds waited, waits timed) so far: take one at a step's start, give it to :meth:`split` at its end."""
        return CollectiveClock._waited, CollectiveClock._calls

    def split(self, step_seconds: float, start: tuple[float, int]) -> dict[str, float | int]:
        """A step's ``compute_s``, ``wait_s`` and ``waits`` (collective waits timed) for its record ({} on CUDA)."""
        if not self.measures_wall:
            return {}
        wait = max(0.0, CollectiveClock._waited - start[0])
        return {"compute_s": round(max(0.0, step_seconds - wait), 5), "wait_s": round(wait, 5), "waits": CollectiveClock._calls - start[1]}


def flight_recorder_env(folder: str | None) -> dict[str, str]:
    """Environment for torch's NCCL Flight Recorder: a small buffer, dumped into the run's folder on a timeout."""
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FR_BUFFER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if folder is not None:
        env["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(folder, "flight_recorder", "rank_")
    return env


def enable_flight_recorder() -> None:
    """Set Flight Recorder's environment (user settings win); call before init_process_group on CUDA."""
    folder = run_dir()
    for key, value in flight_recorder_env(folder).items():
        os.environ.setdefault(key, value)
    if folder is not None:
        os.makedirs(os.path.join(folder, "flight_recorder"), mode=0o700, exist_ok=True)


def maybe_sleep_for_test(step: int, rank: int) -> None:
    """Test hook: sleep before step N on rank R when GPUDECK_TEST_SLEEP_AT_STEP=N:R[:SECONDS] is set."""
    spec = os.environ.get(SLEEP_ENV)
    if not spec:
        return
    parts = spec.split(":")
    at, only_rank = int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1] else None
    seconds = float(parts[2]) if len(parts) > 2 else 3600.0
    if step == at and (only_rank is None or only_rank == rank):
        time.sleep(seconds)
