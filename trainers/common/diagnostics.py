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

``step_clock(on_cuda)``: a step's ``compute_s`` and ``wait_s``, two methods:

``CollectiveClock`` (CPU, gloo)
    the seconds this process's main thread has spent waiting on
    torch.distributed collectives: ``Work.wait`` (every synchronous collective
    and every ``async_op=True`` handle FSDP waits on goes through it) is timed
    with ``time.perf_counter``. On CPU (gloo) ``wait`` blocks until the peers
    arrive, so a step's ``wait_s`` is the time spent waiting for them and
    ``compute_s = step wall time - wait_s``.

``CudaComputeClock`` (CUDA, NCCL)
    on CUDA ``Work.wait`` does not block the host (it orders streams), so the
    wall-clock split would be meaningless, and CUDA events around the whole
    forward+backward would count the time the compute stream sits stalled
    behind FSDP's all-gathers and reduce-scatters. Instead two CUDA events on
    the compute stream bracket the step, and two more bracket every point where
    the compute stream is made to wait on a collective: FSDP2's
    ``FSDPParamGroup.wait_for_unshard`` (the all-gather wait before a block's
    forward and backward, with its copy-out), ``FSDPParamGroup.post_backward``
    (the wait for the previous reduce-scatter's buffers) and
    ``FSDPState._root_post_backward_final_callback`` (the wait for the last
    reduce-scatters), patched at class level while a step is open, plus the
    trainer's own collectives (the gradient-norm and gradient all-reduces, the
    split topology's sends and receives) inside :meth:`CudaComputeClock.stall`.
    Events on one stream complete in order, so each bracket's elapsed time is
    the stall (plus the small copy-out/in kernels it encloses), and
    ``compute_s = elapsed(step) - sum(stalls)``, ``wait_s = sum(stalls)``.
    One step in ``CUDA_TIMING_EVERY`` (4) is timed: bracketing every step cost
    2.1% of tokens/s on the H200 (bench/RESULTS.md section 20), one in four
    costs a quarter of that; ``GPUDECK_COMPUTE_TIMING=every:K`` times one in K.
    A timed step's events are read at the end of the next step (the host has
    long passed them: ``Event.query`` is True), so measuring adds no
    synchronisation; that record carries the timed step's figures and says so
    (``timed_step``); the other records carry none. Events come from a pool
    and are reused.
    ``GPUDECK_COMPUTE_TIMING=0`` turns either clock off (bench/triage.py's
    overhead comparison); ``GPUDECK_COMPUTE_TIMING=ab:N`` (the benchmark's
    same-run comparison) times the CUDA steps in alternate blocks of N
    (blocks 0, 2, 4, ... of the process's steps are timed): between blocks
    the patched FSDP methods cost one attribute check.

``install_flight_recorder_dump(rank) -> dict``
    torch's Flight Recorder (NCCL, and gloo since torch 2.9) is enabled at
    ``FR_BUFFER_ENTRIES`` by :func:`enable_flight_recorder`; this starts a
    daemon thread that polls ``RUN_DIR/flight_recorder/request`` (written by the
    agent: a nonce) and, on a new nonce, writes this rank's last
    ``FR_DUMP_ENTRIES`` entries of each recorder (torch keeps two: the CPU one for
    gloo, ``_dump_fr_trace_json``, and NCCL's, ``_dump_nccl_trace_json``;
    trimmed to the fields the summary needs) as JSON to ``RUN_DIR/flight_recorder/rank<R>.<PID>.json``
    (written beside and renamed in). No ptrace, no signal, no help from the main
    thread: gloo's and NCCL's waits release the GIL. JSON only: the agent never
    unpickles.

``flight_recorder_env(run_dir)``
    the environment that turns on the Flight Recorder at a small buffer and has
    NCCL dump into the run's folder on a collective timeout; set before
    ``init_process_group``.

``maybe_sleep_for_test(step, rank)``
    test hook: ``GPUDECK_TEST_SLEEP_AT_STEP=N:R[:SECONDS]`` makes rank R sleep
    (default 3600 s) before step N, outside any collective: a hang for the tests.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, Protocol

from gpudeck.trainers.common import compat
from gpudeck.trainers.contract import flight_recorder_dump_file, flight_recorder_request_file, stack_file

STACK_SIGNAL = signal.SIGUSR2
SLEEP_ENV = "GPUDECK_TEST_SLEEP_AT_STEP"
FR_BUFFER_ENTRIES = 2000  # Flight Recorder entries kept per rank (torch's own default is 0: off)
FR_DUMP_ENTRIES = 256  # the newest entries a dump on request carries (the summary needs the last few per group)
FR_POLL_S = 0.25  # how often the dump thread looks for the agent's request
CUDA_TIMING_EVERY = 4  # on CUDA one step in this many is timed: timing every step cost 2.1% of tokens/s (RESULTS 20)
TIMING_ENV = "GPUDECK_COMPUTE_TIMING"  # "0": no compute_s/wait_s (the overhead benchmark's "without")

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


class StepClock(Protocol):
    """What the trainers call: ``mark()`` at a step's start, ``stall()`` around their own collectives, ``split()`` at its end."""

    method: str

    def mark(self) -> Any: ...

    def split(self, step_seconds: float, start: Any, step: int | None = None) -> dict[str, float | int]: ...

    def stall(self) -> contextlib.AbstractContextManager[None]: ...


class CollectiveClock:
    """Seconds the main thread spent in torch.distributed ``Work.wait`` (see the module docstring)."""

    _installed = False
    _waited = 0.0
    _calls = 0  # waits timed (bench/triage.py counts them per step)

    method = "wall time minus torch.distributed Work.wait (CPU)"

    def __init__(self, on_cuda: bool = False) -> None:
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

    def split(self, step_seconds: float, start: Any, step: int | None = None) -> dict[str, float | int]:
        """A step's ``compute_s``, ``wait_s`` and ``waits`` (collective waits timed) for its record ({} on CUDA)."""
        if not self.measures_wall:
            return {}
        wait = max(0.0, CollectiveClock._waited - start[0])
        return {"compute_s": round(max(0.0, step_seconds - wait), 5), "wait_s": round(wait, 5), "waits": CollectiveClock._calls - start[1]}

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """A trainer's own collective: on CPU its Work.wait is timed already, nothing to add."""
        yield


class NoClock:
    """No compute/wait measurement (``GPUDECK_COMPUTE_TIMING=0``): the same calls, nothing recorded."""

    method = "off"

    def mark(self) -> None:
        """Nothing to mark."""

    def split(self, step_seconds: float, start: Any, step: int | None = None) -> dict[str, float | int]:
        """No fields."""
        return {}

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """Nothing to bracket."""
        yield


class CudaComputeClock:
    """compute_s on CUDA: events bracketing the step on the compute stream, minus the brackets around its stalls."""

    method = "CUDA events on the compute stream: the step minus the stalls at FSDP2's and the trainer's collective waits"
    current: CudaComputeClock | None = None

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._pool: list[Any] = []
        self._open: list[Any] | None = None  # this step's events: [start, (before, after)*, end]
        self._depth = 0  # nested stall brackets (post_backward inside the final callback) count once
        self._pending: tuple[int, list[Any]] | None = None  # the last timed step, read at the next step's end
        self._step = 0
        self._marks = 0
        spec = os.environ.get(TIMING_ENV, "")
        self._ab = _spec_int(spec, "ab:", 0)  # the benchmark's alternate blocks of steps (0: none)
        self.every = _spec_int(spec, "every:", CUDA_TIMING_EVERY)  # one step in this many is timed
        self.patched = compat.patch_fsdp_stalls(self._bracketing)  # the private FSDP2 names: trainers/common/compat.py
        CudaComputeClock.current = self  # the patched methods bracket for the newest clock (a trainer has one)

    def _event(self) -> Any:
        ev = self._pool.pop() if self._pool else self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def _bracketing(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            clock = CudaComputeClock.current
            if clock is None or clock._open is None:  # no step open: nothing to bracket
                return original(*args, **kwargs)
            with clock.stall():
                return original(*args, **kwargs)

        return wrapped

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """Bracket a wait of the compute stream on a collective (a no-op outside a step)."""
        if self._open is None or self._depth > 0:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth += 1
        self._open.append(self._event())
        try:
            yield
        finally:
            self._open.append(self._event())
            self._depth -= 1

    def mark(self) -> None:
        """Open a step: its start event on the current stream (not in the untimed blocks of ``ab:N``)."""
        k, self._marks = self._marks, self._marks + 1
        self._depth = 0
        if (self._ab and (k // self._ab) % 2) or k % self.every:
            self._open = None
            return
        self._open = [self._event()]

    def _read(self, events: list[Any]) -> dict[str, float] | None:
        if not events[-1].query():
            return None
        total = events[0].elapsed_time(events[-1])
        stalls = sum(events[i].elapsed_time(events[i + 1]) for i in range(1, len(events) - 2, 2))
        self._pool.extend(events)
        return {"compute_s": round(max(0.0, total - stalls) / 1000, 5), "wait_s": round(stalls / 1000, 5)}

    def split(self, step_seconds: float, start: Any, step: int | None = None) -> dict[str, float | int]:
        """Close this step; return the last timed step's ``compute_s``/``wait_s`` once its events are done (``timed_step``: which step), or {}."""
        self._step += 1
        out: dict[str, float | int] = {}
        if self._pending is not None:
            got = self._read(self._pending[1])
            if got is not None:
                out = {**got, "timed_step": self._pending[0], "stalls": (len(self._pending[1]) - 2) // 2}
                self._pending = None
        if self._open is not None:
            events, self._open = self._open + [self._event()], None
            if len(events) % 2 == 0:  # an odd count is a bracket left open (an exception inside it): the step is dropped
                self._pending = (step if step is not None else self._step, events)
        return out


def _spec_int(spec: str, prefix: str, default: int) -> int:
    """N from ``GPUDECK_COMPUTE_TIMING=<prefix>N`` (a positive integer), else ``default``."""
    tail = spec[len(prefix) :] if spec.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and int(tail) > 0 else default


def step_clock(on_cuda: bool) -> StepClock:
    """The clock for this device: CUDA events on CUDA, timed Work.wait on CPU; NoClock with GPUDECK_COMPUTE_TIMING=0."""
    if os.environ.get(TIMING_ENV, "1") == "0":
        return NoClock()
    return CudaComputeClock() if on_cuda else CollectiveClock(on_cuda=False)


def _torch_before_2_8() -> bool:
    """Whether the installed torch predates TORCH_FR_BUFFER_SIZE (2.8 reads it, and warns on the old name on every start)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (2, 8)


def flight_recorder_env(folder: str | None) -> dict[str, str]:
    """Environment for torch's Flight Recorder: a small buffer (NCCL and gloo), NCCL's dump into the run's folder on a timeout."""
    size = str(FR_BUFFER_ENTRIES)
    env = {"TORCH_FR_BUFFER_SIZE": size, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if _torch_before_2_8():  # the name torch read before 2.8
        env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = size
    if folder is not None:
        env["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(folder, "flight_recorder", "rank_")
    return env


def enable_flight_recorder() -> None:
    """Set Flight Recorder's environment (user settings win); call before init_process_group."""
    folder = run_dir()
    for key, value in flight_recorder_env(folder).items():
        os.environ.setdefault(key, value)
    if folder is not None:
        os.makedirs(os.path.join(folder, "flight_recorder"), mode=0o700, exist_ok=True)


_FR_FIELDS = ("collective_seq_id", "p2p_seq_id", "pg_id", "process_group", "profiling_name", "state", "retired", "is_p2p")
_fr_thread: threading.Thread | None = None


def flight_recorder_snapshot(rank: int, nonce: str) -> dict[str, Any]:
    """This rank's newest Flight Recorder entries (every recorder's, trimmed), as the dump file carries them."""
    entries: list[dict[str, Any]] = []
    versions, errors = [], []
    for dump in compat.flight_recorder_dumps():
        try:
            raw = json.loads(dump(includeCollectives=True, onlyActive=False))
        except Exception as exc:  # one recorder failing leaves the other's entries
            errors.append(f"{getattr(dump, '__name__', 'dump')}: {type(exc).__name__}: {exc}"[:180])
            continue
        versions.append(str(raw.get("version", "")))
        entries += [{k: e.get(k) for k in _FR_FIELDS if k in e} for e in (raw.get("entries") or [])[-FR_DUMP_ENTRIES:]]
    snap: dict[str, Any] = {"nonce": nonce, "rank": rank, "pid": os.getpid(), "version": ",".join(versions), "entries": entries}
    if not versions:
        snap["error"] = "; ".join(errors)[:380] or "this torch has no Flight Recorder dump"
    return snap


def _read_request(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 64).decode("ascii", "replace").strip() or None
    finally:
        os.close(fd)


def install_flight_recorder_dump(rank: int) -> dict[str, Any]:
    """Start the thread that dumps the Flight Recorder on the agent's request; the manifest fields that say so."""
    global _fr_thread
    folder = run_dir()
    if folder is None or not compat.flight_recorder_dumps():
        return {}
    if _fr_thread is not None:
        return {"flight_recorder": "request_file"}
    request = flight_recorder_request_file(folder)
    target = flight_recorder_dump_file(folder, rank, os.getpid())
    os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
    seen = _read_request(request)  # a request from before this rank started is not for it

    def watch() -> None:
        nonlocal seen
        while True:
            time.sleep(FR_POLL_S)
            nonce = _read_request(request)
            if nonce is None or nonce == seen:
                continue
            seen = nonce
            try:
                snap = flight_recorder_snapshot(rank, nonce)
            except Exception as exc:  # a dump that fails says why instead of ending the thread
                snap = {"nonce": nonce, "rank": rank, "pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"[:300], "entries": []}
            tmp = f"{target}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(snap, f, separators=(",", ":"))
            os.replace(tmp, target)

    _fr_thread = threading.Thread(target=watch, name="gpudeck-flight-recorder", daemon=True)
    _fr_thread.start()
    return {"flight_recorder": "request_file"}


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
