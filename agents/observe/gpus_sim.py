"""Provides the simulated GPU sampler, for machines where no GPU can exist (CI, the fleet benchmark).

It has the interface of :class:`gpudeck.agents.observe.gpus.GpuSampler` and is selected only by
``GPUDECK_SIMULATE_GPUS=N[:NAME[:GiB]][;unaccounted=G:GiB[,G:GiB...]]`` (see
:func:`gpudeck.agents.observe.gpus.make_sampler`).
Everything it reports is labelled: every GPU name starts with ``SIMULATED``,
every uuid with ``GPU-SIM-``, ``driver_version`` is ``"simulated"`` and
``simulated`` is True (the agent copies it into ``Snapshot.simulated``).

What it reports comes from real processes, so the scenarios gpudeck exists for
run on CPU with real process trees:

- memory: a live process whose environment holds
  ``GPUDECK_SIM_GPU_MEM=<gpu>:<GiB>[,<gpu>:<GiB>...]`` holds that much on those
  GPUs, and is listed as a compute process there. A process in disk sleep (or
  stopped) keeps holding; one that has exited releases at once, even while it is
  a zombie not yet reaped by its parent (as on a real GPU: the driver tears the
  context down at exit, and NVML stops listing the process; a zombie holds no
  memory); a pid that is gone, or reused, releases.
- unaccounted memory: ``;unaccounted=0:7.6`` makes GPU 0 hold 7.6 GiB that no
  process explains, for as long as the agent runs, as a real GPU does when the
  holder is in another PID namespace (a container without ``--pid=host``) or is
  a context the driver keeps: counted in ``memory_used`` and
  ``unaccounted_bytes``, listed as no process.
- scope: several simulated machines can share one real one (parallel tests,
  the fleet benchmark's agents). A holder belongs to the machine named by its
  ``GPUDECK_SIM_SCOPE``, else its ``GPUDECK_HOME``; a sampler counts the
  holders of its own scope and those with neither, never another scope's.
- utilisation: ``min(100, CPU% of the GPU's holders)`` over the last sample
  window, so a busy holder shows load and a sleeping or stopped one shows 0 %.
- temperature and power: made up from utilisation (30 °C and 10 % of the
  power limit idle, 75 °C and 90 % at full load); ``util_mem`` is 40 % of
  utilisation. They are plausible, not measured.

A sample reads ``/proc/loadavg`` (the newest pid), refreshes the shared
:class:`~gpudeck.agents.observe.procs.ProcTable` only when a process was created since the last
sample (so a new holder is seen in the very next sample), and reads one
``/proc/PID/stat`` per holder; it never scans all of ``/proc`` with psutil.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from gpudeck.agents.observe.procs import CT_TOLERANCE, SIM_GPU_MEM_TAG, ProcTable, read_stat, sim_scope
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Gpu, GpuProcess

log = logging.getLogger("gpudeck.agent")

SIMULATE_ENV = "GPUDECK_SIMULATE_GPUS"
DRIVER_VERSION = "simulated"
NAME_PREFIX = "SIMULATED "
DEFAULT_NAME = "H100-80GB"
DEFAULT_GIB = 80.0
MAX_GPUS = 64
# CPU time is counted in clock ticks (10 ms), so utilisation is measured over at least this long;
# samples closer together repeat the last figure instead of jumping between 0 and 100
UTIL_WINDOW_S = 0.5
_GIB_BY_FAMILY = (("B200", 180.0), ("H200", 141.0), ("H100", 80.0), ("A100", 80.0), ("L40", 48.0))
_POWER_BY_FAMILY = (("B200", 1000.0), ("H200", 700.0), ("H100", 700.0), ("A100", 400.0), ("L40", 350.0))
_EXITED = ("zombie", "dead")  # an exited process holds no GPU memory (NVML drops it at exit, reaped or not)
_FORMS = (
    "N, N:NAME or N:NAME:GiB, optionally followed by ;unaccounted=G:GiB[,G:GiB...] "
    '(e.g. "8", "8:H200:141", "2:A100-80GB:80", "2:H200:141;unaccounted=0:7.6")'
)
UNACCOUNTED_KEY = "unaccounted"


class SimulatedGpuSpecError(AgentError):
    """``GPUDECK_SIMULATE_GPUS`` does not say how many GPUs to simulate."""

    code = "bad_config"


@dataclass(frozen=True)
class SimGpuSpec:
    """How many simulated GPUs, what they are called, and how much memory each has."""

    count: int
    name: str
    memory_gib: float
    unaccounted: tuple[tuple[int, int], ...] = ()  # (GPU, bytes) held by no process (another PID namespace, the driver)

    @property
    def text(self) -> str:
        """The spec in its ``N:NAME:GiB[;unaccounted=G:GiB,...]`` form."""
        extra = ",".join(f"{g}:{b / 2**30:g}" for g, b in self.unaccounted)
        return f"{self.count}:{self.name}:{self.memory_gib:g}" + (f";{UNACCOUNTED_KEY}={extra}" if extra else "")


def _default_gib(name: str) -> float:
    m = re.search(r"(\d+)\s*GB", name, re.IGNORECASE)
    if m:
        return float(m.group(1))
    upper = name.upper()
    return next((gib for family, gib in _GIB_BY_FAMILY if family in upper), DEFAULT_GIB)


def parse_sim_spec(text: str) -> SimGpuSpec:
    """Parse ``N[:NAME[:GiB]][;unaccounted=G:GiB,...]``; raises :class:`SimulatedGpuSpecError` naming the accepted forms."""

    def bad(why: str) -> SimulatedGpuSpecError:
        return SimulatedGpuSpecError(
            f"{SIMULATE_ENV}={text!r} is not a simulated GPU spec ({why}): use {_FORMS}, or unset {SIMULATE_ENV} to use the real GPUs through NVML"
        )

    base, semi, extra = text.strip().partition(";")
    parts = base.strip().split(":")
    if len(parts) > 3:
        raise bad("more than three ':'-separated parts")
    try:
        count = int(parts[0])
    except ValueError:
        raise bad(f"N={parts[0]!r} is not a whole number") from None
    if not 1 <= count <= MAX_GPUS:
        raise bad(f"N must be 1 to {MAX_GPUS}")
    name = parts[1].strip() if len(parts) > 1 else DEFAULT_NAME
    if not name:
        raise bad("NAME is empty")
    if len(parts) > 2:
        try:
            gib = float(parts[2])
        except ValueError:
            raise bad(f"GiB={parts[2]!r} is not a number") from None
        if not 0 < gib < 1 << 20:  # also refuses nan and inf
            raise bad("GiB must be a positive number")
    else:
        gib = _default_gib(name)
    unaccounted: dict[int, int] = {}
    if semi:
        key, eq, value = extra.strip().partition("=")
        if key.strip() != UNACCOUNTED_KEY or not eq or not value.strip():
            raise bad(f"after ';' only {UNACCOUNTED_KEY}=G:GiB[,G:GiB...] is understood")
        for item in value.split(","):
            g_text, colon, b_text = item.strip().partition(":")
            try:
                g, b = int(g_text), float(b_text)
            except ValueError:
                raise bad(f"{UNACCOUNTED_KEY} item {item.strip()!r} is not GPU:GiB") from None
            if not colon or not 0 <= g < count:
                raise bad(f"{UNACCOUNTED_KEY} names GPU {g_text.strip()!r}; the GPUs are 0-{count - 1}")
            if not 0 < b <= gib:  # also refuses nan and inf
                raise bad(f"{UNACCOUNTED_KEY} GiB must be more than 0 and at most the GPU's {gib:g} GiB")
            unaccounted[g] = unaccounted.get(g, 0) + round(b * 2**30)
    return SimGpuSpec(count=count, name=name, memory_gib=gib, unaccounted=tuple(sorted(unaccounted.items())))


@dataclass(frozen=True)
class _Holding:
    """One live holder at one sample: its pid, status, CPU% and bytes per GPU."""

    pid: int
    status: str
    util: float
    held: tuple[tuple[int, int], ...]


@dataclass
class _CpuMark:
    """The CPU time of a holder when its utilisation window began, and the last figure."""

    cpu_seconds: float
    at: float  # time.monotonic()
    util: float


class SimulatedGpuSampler:
    """Simulated GPUs whose memory and load are what real processes declare and do (labelled SIMULATED)."""

    simulated = True

    def __init__(self, spec: SimGpuSpec | str, procs: ProcTable) -> None:
        self.spec = parse_sim_spec(spec) if isinstance(spec, str) else spec
        self.procs = procs
        self.scope = sim_scope(os.environ)  # this simulated machine: holders of another scope are not ours
        self.error: str | None = None
        self.driver_version: str | None = DRIVER_VERSION
        self.memory_total = int(self.spec.memory_gib * 2**30)
        upper = self.spec.name.upper()
        self.power_limit_w = next((w for family, w in _POWER_BY_FAMILY if family in upper), 350.0)
        # stable for a spec and the same on every host: a fleet keys GPUs by (host, uuid)
        digest = hashlib.sha1(f"{self.spec.name}|{self.spec.memory_gib:g}".encode()).hexdigest()[:8]
        self._uuids = [f"GPU-SIM-{digest}-{i}" for i in range(self.spec.count)]
        self._name = NAME_PREFIX + self.spec.name
        self._lock = threading.Lock()
        self._marks: dict[tuple[int, float], _CpuMark] = {}
        self._warned: set[tuple[int, float]] = set()
        self.last_sample: tuple[float, list[Gpu]] | None = None  # (monotonic time, the newest sample), whoever took it
        self._hidden = dict(self.spec.unaccounted)  # GPU -> bytes no process explains

    @property
    def description(self) -> str:
        """One line for logs and status: what is simulated and from what."""
        hidden = (
            "; "
            + ", ".join(f"GPU {g}: {b / 2**30:g} GiB" for g, b in self.spec.unaccounted)
            + " held by no process (as if in another PID namespace)"
            if self.spec.unaccounted
            else ""
        )
        return (
            f"{self.spec.count} SIMULATED GPU(s) ({SIMULATE_ENV}={self.spec.text}): memory is what processes declare "
            f"in {SIM_GPU_MEM_TAG}, utilisation their CPU%, temperature and power are made up{hidden}"
        )

    @property
    def available(self) -> bool:
        """Always True: the simulated GPUs are there."""
        return True

    @property
    def count(self) -> int:
        """Number of simulated GPUs."""
        return self.spec.count

    def _holdings(self) -> list[_Holding]:
        # thread-safe, one read of /proc/loadavg when no process was made, and never waits for a refresh in progress
        self.procs.refresh()
        now = time.monotonic()
        wall = time.time()
        out: list[_Holding] = []
        seen: set[tuple[int, float]] = set()
        with self._lock:
            for e in self.procs.sim_holders():
                decl = e.sim_gpu_mem
                if decl is None or (e.sim_scope is not None and e.sim_scope != self.scope):
                    continue
                key = (e.pid, e.create_time)
                if decl.error is not None or any(g >= self.spec.count for g, _ in decl.held):
                    self._warn_once(key, decl.error)
                if not decl.held:
                    continue
                # the table is refreshed at most every REFRESH_S; the stat read says whether the holder is still there
                st = read_stat(e.pid)
                if st is None or abs(st.create_time - e.create_time) > CT_TOLERANCE or st.status in _EXITED:
                    continue  # exited (a zombie too), gone, or the pid now names another process: its memory is released
                seen.add(key)
                mark = self._marks.get(key)
                if mark is None:
                    # first sight: the lifetime average, so a long-running busy holder shows load at once
                    util = 100.0 * st.cpu_seconds / max(wall - e.create_time, 1e-3)
                    self._marks[key] = _CpuMark(st.cpu_seconds, now, util)
                elif now - mark.at >= UTIL_WINDOW_S:
                    util = 100.0 * (st.cpu_seconds - mark.cpu_seconds) / (now - mark.at)
                    self._marks[key] = _CpuMark(st.cpu_seconds, now, util)
                else:
                    util = mark.util
                held = tuple((g, b) for g, b in decl.held if g < self.spec.count)
                out.append(_Holding(pid=e.pid, status=st.status, util=max(0.0, util), held=held))
            for gone in self._marks.keys() - seen:
                del self._marks[gone]
        return out

    def _warn_once(self, key: tuple[int, float], error: str | None) -> None:
        if key in self._warned:
            return
        if len(self._warned) > 4096:
            self._warned.clear()
        self._warned.add(key)
        if error is not None:
            log.warning("pid %d holds nothing on the simulated GPUs: %s", key[0], error)
        else:
            log.warning(
                "pid %d declares memory on a simulated GPU that does not exist (there are %d: 0-%d); that part is ignored",
                key[0],
                self.spec.count,
                self.spec.count - 1,
            )

    def memory_used(self) -> dict[int, int]:
        """Used bytes per simulated GPU (what live holders declare and the unaccounted memory, at most the GPU's total)."""
        used = {g: self._hidden.get(g, 0) for g in range(self.spec.count)}
        for h in self._holdings():
            for g, b in h.held:
                used[g] += b
        return {g: min(b, self.memory_total) for g, b in used.items()}

    def gpu_pids(self) -> dict[int, list[int]]:
        """Pids holding memory per simulated GPU."""
        return {g.index: [p.pid for p in g.processes] for g in self.sample()}

    def sample(self) -> list[Gpu]:
        """One reading of every simulated GPU with its holders (unattributed, like NVML's)."""
        procs: list[list[GpuProcess]] = [[] for _ in range(self.spec.count)]
        util = [0.0] * self.spec.count
        for h in self._holdings():
            for g, b in h.held:
                procs[g].append(GpuProcess(pid=h.pid, gpu=g, used_bytes=b, kind="compute"))
                util[g] += h.util
        out: list[Gpu] = []
        for i in range(self.spec.count):
            u = min(100, round(util[i]))
            declared = sum(p.used_bytes or 0 for p in procs[i])
            # over-declared memory is clamped like a real GPU's total; the holders keep their declarations
            used = min(declared + self._hidden.get(i, 0), self.memory_total)
            out.append(
                Gpu(
                    index=i,
                    uuid=self._uuids[i],
                    name=self._name,
                    memory_used=used,
                    memory_total=self.memory_total,
                    util_gpu=u,
                    util_mem=round(0.4 * u),
                    temperature_c=30 + round(0.45 * u),
                    power_w=round(self.power_limit_w * (0.1 + 0.8 * u / 100), 1),
                    power_limit_w=self.power_limit_w,
                    unaccounted_bytes=max(0, used - declared),
                    processes=tuple(procs[i]),
                )
            )
        self.last_sample = (time.monotonic(), out)  # the GPU ledger's idle look reuses it (agents/runs/tick.py)
        return out
