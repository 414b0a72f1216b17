"""The simulated GPU sampler against real holder processes (GPUDECK_SIM_GPU_MEM), and its spec parsing."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpudeck.agents.observe.gpus import GpuSampler, make_sampler
from gpudeck.agents.observe.gpus_sim import UTIL_WINDOW_S, SimulatedGpuSampler, SimulatedGpuSpecError, parse_sim_spec
from gpudeck.agents.observe.procs import SIM_GPU_MEM_TAG, ProcTable, parse_sim_gpu_mem, read_stat, signal_exact
from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import Gpu

HOLDER = Path(__file__).resolve().parents[1] / "e2e" / "progs" / "sim_gpu_holder.py"
GIB = 2**30


class Holders:
    """Starts sim_gpu_holder.py processes and kills every one of them (by pid) at the end."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[str]] = []
        self.extra: list[tuple[int, float]] = []  # forked children: (pid, create_time)

    def start(self, mem: str | None, *args: str, seconds: float = 120.0) -> tuple[subprocess.Popen[str], int | None]:
        """Start a holder with GPUDECK_SIM_GPU_MEM=mem; returns it and its forked child's pid, once ready.

        Every holder ends by itself after ``seconds``, so none outlives a test run that was killed.
        """
        env = {k: v for k, v in os.environ.items() if k != SIM_GPU_MEM_TAG}
        if mem is not None:
            env[SIM_GPU_MEM_TAG] = mem
        p = subprocess.Popen([sys.executable, str(HOLDER), "--seconds", str(seconds), *args], env=env, stdout=subprocess.PIPE, text=True)
        self.popens.append(p)
        assert p.stdout is not None
        child = None
        for line in p.stdout:
            key, _, value = line.strip().partition(" ")
            if key == "pid":
                assert int(value) == p.pid
            elif key == "child":
                child = int(value)
                self.extra.append((child, psutil.Process(child).create_time()))
            elif key == "ready":
                return p, child
        raise AssertionError(f"holder exited before it was ready (rc {p.wait()})")

    def close(self) -> None:
        for pid, ct in self.extra:
            signal_exact(pid, ct, signal.SIGKILL)
            wait_gone(pid)
        for p in self.popens:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Wait until the pid no longer exists (it need not be our child)."""
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass


@pytest.fixture
def holders() -> Iterator[Holders]:
    h = Holders()
    yield h
    h.close()


@pytest.fixture
def procs() -> ProcTable:
    t = ProcTable()
    t.refresh()
    return t


def by_index(gpus: list[Gpu]) -> dict[int, Gpu]:
    return {g.index: g for g in gpus}


def settled(s: SimulatedGpuSampler) -> dict[int, Gpu]:
    """A sample whose utilisation window lies wholly after this call began.

    A sample less than a window after the last mark keeps the old window open (one that may reach back
    to before, say, a SIGSTOP); waiting a window first makes the next sample close it and open a new one.
    """
    time.sleep(UTIL_WINDOW_S + 0.1)
    s.sample()
    time.sleep(UTIL_WINDOW_S + 0.2)
    return by_index(s.sample())


# ----------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("text", "count", "name", "gib"),
    [
        ("8", 8, "H100-80GB", 80.0),
        ("8:H200:141", 8, "H200", 141.0),
        ("2:A100-80GB:80", 2, "A100-80GB", 80.0),
        ("4:A100-40GB", 4, "A100-40GB", 40.0),
        ("4:H200", 4, "H200", 141.0),
        (" 1:T4:15.5 ", 1, "T4", 15.5),
    ],
)
def test_spec_forms(text: str, count: int, name: str, gib: float) -> None:
    spec = parse_sim_spec(text)
    assert (spec.count, spec.name, spec.memory_gib) == (count, name, gib)


@pytest.mark.parametrize(
    "text", ["", "abc", "0", "-2", "65", "8:", "8::80", "8:H200:x", "8:H200:0", "8:H200:-1", "8:H200:nan", "8:H200:141:1", "2.5"]
)
def test_malformed_spec_is_a_typed_error_naming_the_forms(text: str) -> None:
    with pytest.raises(SimulatedGpuSpecError) as err:
        parse_sim_spec(text)
    assert isinstance(err.value, AgentError)
    assert "N:NAME:GiB" in err.value.message and "GPUDECK_SIMULATE_GPUS" in err.value.message
    if text:  # an empty variable means "unset" to make_sampler
        with pytest.raises(SimulatedGpuSpecError):
            make_sampler(ProcTable(), {"GPUDECK_SIMULATE_GPUS": text})


def test_make_sampler_picks_simulated_only_when_asked(procs: ProcTable) -> None:
    sim = make_sampler(procs, {"GPUDECK_SIMULATE_GPUS": "8:H200:141"})
    assert isinstance(sim, SimulatedGpuSampler) and sim.simulated and sim.count == 8 and sim.available
    assert sim.error is None and sim.driver_version == "simulated"
    for env in ({}, {"GPUDECK_SIMULATE_GPUS": ""}):
        real = make_sampler(procs, env)
        assert isinstance(real, GpuSampler) and real.simulated is False
        if not real.available:  # this machine has no NVML: no driver version either
            assert real.driver_version is None and real.error


def test_simulated_gpus_are_labelled_and_stable(procs: ProcTable) -> None:
    a = SimulatedGpuSampler("3:A100-80GB:80", procs).sample()
    b = SimulatedGpuSampler(parse_sim_spec("3:A100-80GB:80"), ProcTable()).sample()
    assert [g.name for g in a] == ["SIMULATED A100-80GB"] * 3
    assert [g.uuid for g in a] == [g.uuid for g in b]  # host- and process-independent
    assert len({g.uuid for g in a}) == 3 and all(g.uuid.startswith("GPU-SIM-") and g.uuid.endswith(f"-{g.index}") for g in a)
    assert SimulatedGpuSampler("3:H200:141", procs).sample()[0].uuid != a[0].uuid
    assert all(g.memory_total == 80 * GIB and g.memory_used == 0 and not g.processes for g in a)


def test_declaration_parsing() -> None:
    assert parse_sim_gpu_mem("1:10, 3:2.5,1:1").held == ((1, 11 * GIB), (3, int(2.5 * GIB)))
    for bad in ("", "garbage", "1", "a:3", "1:-2", "1:nan", "-1:3", "1:3,"):
        d = parse_sim_gpu_mem(bad)
        assert d.held == () and d.error and "<gpu>:<GiB>" in d.error


# ----------------------------------------------------------------------------- real holders


def test_memory_appears_on_the_declared_gpus_within_one_sample(holders: Holders, procs: ProcTable) -> None:
    s = SimulatedGpuSampler("4:H200:141", procs)
    assert s.memory_used() == {0: 0, 1: 0, 2: 0, 3: 0}
    a, _ = holders.start("1:10,3:2.5")
    b, _ = holders.start("3:1")
    gpus = by_index(s.sample())
    assert [gpus[i].memory_used for i in range(4)] == [0, 10 * GIB, 0, int(3.5 * GIB)]
    assert [(p.pid, p.used_bytes) for p in gpus[1].processes] == [(a.pid, 10 * GIB)]
    assert sorted((p.pid, p.used_bytes) for p in gpus[3].processes) == sorted([(a.pid, int(2.5 * GIB)), (b.pid, GIB)])
    assert not gpus[0].processes and not gpus[2].processes
    assert s.memory_used() == {0: 0, 1: 10 * GIB, 2: 0, 3: int(3.5 * GIB)}
    pids = s.gpu_pids()
    assert (pids[0], pids[1], pids[2], sorted(pids[3])) == ([], [a.pid], [], sorted([a.pid, b.pid]))
    assert {e.pid for e in procs.sim_holders()} == {a.pid, b.pid}
    assert procs.get(os.getpid()) is None or procs.get(os.getpid()).sim_gpu_mem is None  # type: ignore[union-attr]


def test_malformed_or_out_of_range_declarations_hold_nothing_there(holders: Holders, procs: ProcTable) -> None:
    s = SimulatedGpuSampler("2", procs)
    bad, _ = holders.start("lots")
    wide, _ = holders.start("1:4,7:20")
    gpus = by_index(s.sample())
    assert gpus[0].memory_used == 0 and gpus[1].memory_used == 4 * GIB
    assert [p.pid for p in gpus[1].processes] == [wide.pid]
    entry = procs.get(bad.pid)
    assert entry is not None and entry.sim_gpu_mem is not None and entry.sim_gpu_mem.error


def test_util_is_high_for_a_busy_holder_and_zero_for_a_sleeping_one(holders: Holders, procs: ProcTable) -> None:
    s = SimulatedGpuSampler("2", procs)
    holders.start("0:20", "--busy")
    holders.start("1:20")
    gpus = settled(s)
    busy, idle = gpus[0], gpus[1]
    print(f"\nbusy holder: util {busy.util_gpu}% {busy.temperature_c} C {busy.power_w} W; sleeping: util {idle.util_gpu}%")
    # the simulated load follows the holder's CPU share, which a busy test machine squeezes: busy is >0, sleeping ~0
    assert busy.util_gpu is not None and busy.util_gpu > (idle.util_gpu or 0) and busy.util_gpu >= 5
    assert idle.util_gpu is not None and idle.util_gpu <= 5
    assert busy.temperature_c > idle.temperature_c and busy.power_w > idle.power_w  # type: ignore[operator]


def test_a_stopped_holder_keeps_its_memory_and_shows_no_load(holders: Holders, procs: ProcTable) -> None:
    s = SimulatedGpuSampler("1", procs)
    p, _ = holders.start("0:30", "--busy")
    assert settled(s)[0].util_gpu >= 5  # type: ignore[operator]  # busy (its CPU share, squeezed on a loaded machine)
    os.kill(p.pid, signal.SIGSTOP)
    try:
        g = settled(s)[0]
        assert g.util_gpu == 0 and g.memory_used == 30 * GIB
    finally:
        os.kill(p.pid, signal.SIGCONT)


def test_memory_is_freed_when_the_holder_exits_even_before_it_is_reaped(holders: Holders, procs: ProcTable) -> None:
    s = SimulatedGpuSampler("2", procs)
    p, _ = holders.start("0:40,1:8")
    assert s.memory_used() == {0: 40 * GIB, 1: 8 * GIB}
    p.kill()
    deadline = time.monotonic() + 10
    while (st := read_stat(p.pid)) is not None and st.status != "zombie" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st is not None and st.status == "zombie"
    g = by_index(s.sample())
    # not reaped yet, but exited: a real GPU's driver releases the context at exit and NVML no longer lists it
    assert g[0].memory_used == 0 and not g[0].processes
    assert s.memory_used() == {0: 0, 1: 0}
    p.wait()  # reap it, by pid
    assert s.memory_used() == {0: 0, 1: 0}
    assert all(not g.processes for g in s.sample())


def test_an_orphaned_child_that_ignores_sigterm_stays_a_stale_holder(holders: Holders, procs: ProcTable) -> None:
    s = SimulatedGpuSampler("8:H200:141", procs)
    p, child = holders.start("5:60", "--fork-holder", "--ignore-term")
    assert child is not None
    assert sorted(s.gpu_pids()[5]) == sorted([p.pid, child])
    assert s.memory_used()[5] == 120 * GIB
    p.kill()
    p.wait()
    assert s.gpu_pids()[5] == [child]  # the orphan still holds, wherever it was re-parented
    assert s.memory_used()[5] == 60 * GIB
    ct = psutil.Process(child).create_time()
    assert signal_exact(child, ct, signal.SIGTERM)
    time.sleep(0.3)
    assert s.gpu_pids()[5] == [child]  # SIGTERM ignored
    assert signal_exact(child, ct, signal.SIGKILL)
    wait_gone(child)
    assert s.memory_used()[5] == 0 and s.gpu_pids()[5] == []


def test_a_holder_exits_on_its_own_after_seconds(holders: Holders, procs: ProcTable) -> None:
    s = SimulatedGpuSampler("1", procs)
    p, _ = holders.start("0:1", seconds=0.5)
    assert s.memory_used()[0] == GIB
    assert p.wait(timeout=10) == 0
    assert s.memory_used()[0] == 0


def test_a_worker_thread_sample_sees_the_exit_and_a_new_holder(holders: Holders, procs: ProcTable) -> None:
    """The agent samples in its sampler thread: the table (thread-safe) is refreshed from there."""
    s = SimulatedGpuSampler("1", procs)
    p, _ = holders.start("0:5")
    assert s.memory_used()[0] == 5 * GIB
    p.kill()
    p.wait()
    out: list[dict[int, int]] = []
    t = threading.Thread(target=lambda: out.append(s.memory_used()))
    t.start()
    t.join()
    assert out == [{0: 0}]
    q, _ = holders.start("0:7")
    t = threading.Thread(target=lambda: out.append(s.memory_used()))
    t.start()
    t.join()
    # the table was refreshed from the thread: it sees the new holder and not the exited one (only this test's
    # processes are compared: another test's holder, running in parallel on this machine, may be listed too)
    listed = [e.pid for e in procs.sim_holders()]
    assert out[-1] == {0: 7 * GIB} and q.pid in listed and p.pid not in listed


def test_sample_cost_with_8_gpus_and_a_few_holders(holders: Holders, procs: ProcTable) -> None:
    s = SimulatedGpuSampler("8:H200:141", procs)
    for i in range(4):
        holders.start(f"{2 * i}:40,{2 * i + 1}:40")
    n = 200  # a figure to read, no goal (bench/ holds those): enough calls for a p99 without minutes under load
    for _ in range(10):
        s.sample()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        gpus = s.sample()
        xs.append((time.perf_counter() - t0) * 1e6)
    assert sum(g.memory_used for g in gpus) == 8 * 40 * GIB
    ys = []
    for _ in range(50):
        t0 = time.perf_counter()
        procs.refresh()
        ys.append((time.perf_counter() - t0) * 1e6)
    xs.sort()
    print(
        f"\nSimulatedGpuSampler.sample(): 8 GPUs, 4 holders, {n} calls: mean {statistics.fmean(xs):.1f} us, "
        f"p99 {xs[int(n * 0.99)]:.1f} us (no process was created meanwhile, so no table refresh; one refresh alone: "
        f"mean {statistics.fmean(ys):.1f} us over {len(procs)} pids)"
    )


def test_a_holder_of_another_simulated_machine_is_not_counted(holders: Holders, procs: ProcTable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDECK_SIM_SCOPE", "machine-a")
    s = SimulatedGpuSampler("2", procs)
    monkeypatch.setenv("GPUDECK_SIM_SCOPE", "machine-b")  # the holders inherit the test's environment
    holders.start("0:5")
    monkeypatch.setenv("GPUDECK_SIM_SCOPE", "machine-a")
    holders.start("1:7")
    procs.refresh()
    g = by_index(s.sample())
    assert g[0].memory_used == 0 and g[1].memory_used == 7 * GIB
