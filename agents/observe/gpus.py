"""Provides the NVML sampler: every GPU's memory, load and processes, cheaply.

``nvmlInit`` runs once and device handles and static facts (uuid, name, total
memory, power limit) are cached, so a sample is only the calls whose answers
change. Without NVML (no driver, no GPU, as on CI) the sampler reports no GPUs
and the reason, and everything else in the agent keeps working.

:func:`make_sampler` picks the sampler: this one, or the labelled simulated
one (``agents/observe/gpus_sim.py``) when ``GPUDECK_SIMULATE_GPUS`` asks for it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gpudeck.agents.observe.gpus_sim import SIMULATE_ENV, SimulatedGpuSampler, SimulatedGpuSpecError, parse_sim_spec
from gpudeck.agents.observe.procs import ProcTable
from gpudeck.agents.wire.protocol import Gpu, GpuProcess

__all__ = ["GpuSampler", "GpuSource", "SimulatedGpuSampler", "SimulatedGpuSpecError", "make_sampler"]

try:  # nvidia-ml-py is a dependency, but keep the agent alive if its import fails
    import pynvml
except Exception as exc:  # pragma: no cover - exercised only on broken installs
    pynvml = None
    _IMPORT_ERROR: str | None = f"nvidia-ml-py cannot be imported: {exc}"
else:
    _IMPORT_ERROR = None


@dataclass
class _Device:
    index: int
    handle: object
    uuid: str
    name: str
    memory_total: int
    power_limit_w: float | None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuSource(Protocol):
    """What the agent needs of a GPU sampler, real (:class:`GpuSampler`) or simulated."""

    error: str | None
    driver_version: str | None
    simulated: bool

    @property
    def available(self) -> bool: ...

    @property
    def count(self) -> int: ...

    def memory_used(self) -> dict[int, int]: ...

    def gpu_pids(self) -> dict[int, list[int]]: ...

    def sample(self) -> list[Gpu]: ...


class GpuSampler:
    """Samples all GPUs through NVML; ``error`` says why there are none."""

    simulated = False

    def __init__(self) -> None:
        self.error: str | None = None
        self.driver_version: str | None = None
        self._devices: list[_Device] = []
        self._lock = threading.Lock()
        self._mem_v2 = False
        self.last_sample: tuple[float, list[Gpu]] | None = None  # (monotonic time, the newest sample), whoever took it
        if pynvml is None:
            self.error = _IMPORT_ERROR
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.error = f"no NVIDIA GPU: NVML could not start ({exc})"
            return
        except Exception as exc:  # e.g. libnvidia-ml.so missing raises NVMLError_LibraryNotFound or OSError
            self.error = f"no NVIDIA GPU: NVML could not start ({exc})"
            return
        try:
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            self.driver_version = None
        try:
            count = pynvml.nvmlDeviceGetCount()
            for i in range(count):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
                except pynvml.NVMLError:
                    limit = None
                self._devices.append(
                    _Device(
                        index=i,
                        handle=h,
                        uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                        name=_text(pynvml.nvmlDeviceGetName(h)),
                        memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                        power_limit_w=limit,
                    )
                )
        except pynvml.NVMLError as exc:
            self.error = f"NVML started but listing GPUs failed: {exc}"
            self._devices = []
            return
        if not self._devices:
            self.error = "no NVIDIA GPU: NVML reports 0 devices"
            return
        # memory v2 splits out driver-reserved memory, so "used" is what processes and contexts hold
        try:
            pynvml.nvmlDeviceGetMemoryInfo(self._devices[0].handle, version=pynvml.nvmlMemory_v2)
            self._mem_v2 = True
        except Exception:
            self._mem_v2 = False

    @property
    def available(self) -> bool:
        """True when NVML works and at least one GPU is there."""
        return bool(self._devices)

    @property
    def count(self) -> int:
        """Number of GPUs."""
        return len(self._devices)

    def memory_used(self) -> dict[int, int]:
        """Used bytes per GPU index (a cheap sample for before/after comparisons)."""
        out: dict[int, int] = {}
        with self._lock:
            for d in self._devices:
                try:
                    out[d.index] = int(self._meminfo(d.handle).used)
                except pynvml.NVMLError:
                    continue
        return out

    def _meminfo(self, handle: object) -> Any:  # pynvml's memory-info struct
        if self._mem_v2:
            try:
                return pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            except TypeError:  # an older binding (or a library that wrapped it) without ``version``
                self._mem_v2 = False
        return pynvml.nvmlDeviceGetMemoryInfo(handle)

    def gpu_pids(self) -> dict[int, list[int]]:
        """Pids NVML lists per GPU index (compute and graphics)."""
        return {g.index: [p.pid for p in g.processes] for g in self.sample()}

    def sample(self) -> list[Gpu]:
        """One reading of every GPU with its process list (unattributed)."""
        out: list[Gpu] = []
        with self._lock:
            for d in self._devices:
                h = d.handle
                try:
                    mem = self._meminfo(h)
                except pynvml.NVMLError:
                    continue
                util_gpu = util_mem = temp = None
                power = None
                try:
                    u = pynvml.nvmlDeviceGetUtilizationRates(h)
                    util_gpu, util_mem = int(u.gpu), int(u.memory)
                except pynvml.NVMLError:
                    pass
                try:
                    temp = int(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
                except pynvml.NVMLError:
                    pass
                try:
                    power = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
                except pynvml.NVMLError:
                    pass
                procs: dict[int, GpuProcess] = {}
                kinds: tuple[tuple[Literal["compute", "graphics"], Callable[[object], Any]], ...] = (
                    ("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
                    ("graphics", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
                )
                for kind, fn in kinds:
                    try:
                        plist = fn(h)
                    except pynvml.NVMLError:
                        continue
                    for p in plist:
                        used = p.usedGpuMemory
                        if used is None or used >= (1 << 63):  # NVML_VALUE_NOT_AVAILABLE
                            used = None
                        prev = procs.get(p.pid)
                        if prev is None:
                            procs[p.pid] = GpuProcess(
                                pid=int(p.pid), gpu=d.index, used_bytes=None if used is None else int(used), kind=kind
                            )
                        elif used is not None:
                            prev.used_bytes = (prev.used_bytes or 0) + int(used)
                plist_out = list(procs.values())
                accounted = sum(p.used_bytes or 0 for p in plist_out)
                out.append(
                    Gpu(
                        index=d.index,
                        uuid=d.uuid,
                        name=d.name,
                        memory_used=int(mem.used),
                        memory_total=d.memory_total,
                        util_gpu=util_gpu,
                        util_mem=util_mem,
                        temperature_c=temp,
                        power_w=power,
                        power_limit_w=d.power_limit_w,
                        unaccounted_bytes=max(0, int(mem.used) - accounted),
                        processes=tuple(plist_out),
                    )
                )
        self.last_sample = (time.monotonic(), out)  # the GPU ledger's idle look reuses it (agents/runs/tick.py)
        return out


def make_sampler(procs: ProcTable, env: Mapping[str, str] = os.environ) -> GpuSampler | SimulatedGpuSampler:
    """The simulated sampler when ``GPUDECK_SIMULATE_GPUS`` is set (a malformed spec raises
    :class:`SimulatedGpuSpecError`), the real NVML one otherwise."""
    spec = env.get(SIMULATE_ENV, "")
    if not spec.strip():  # unset or empty: the real GPUs
        return GpuSampler()
    return SimulatedGpuSampler(parse_sim_spec(spec), procs)
