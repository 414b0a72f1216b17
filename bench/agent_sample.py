"""Benchmark: the cost of one full host snapshot against what users run today, in the same run.

Peers, each measured here on the same host and GPU state:
  * ``nvidia-smi --query-gpu`` + ``--query-compute-apps`` (two execs, what scripts poll)
  * one exec of ``gpustat --json``
  * an in-process nvitop refresh: ``Device.all()``, ``processes()``, ``GpuProcess.take_snapshots``
  * bare NVML + psutil calls (the floor)
gpudeck: ``SnapshotBuilder.build()`` — every GPU, every GPU process attributed to its run.
Then the agent's own CPU at a 1 s snapshot interval, measured from /proc over a real agent process.

Usage: python bench/agent_sample.py [--hold-gib 20] [--cpu-seconds 30] [--extra-procs 5000] [--foreign-tagged 500] [--profile FILE]
       [--ledger-peer] [--sim-gpus 8] [--gpu-procs 64]
Prints one line per figure; ratios are peer / gpudeck. ``--extra-procs N`` starts N sleeping processes
for the CPU measurement (stopped by pid afterwards), ``--foreign-tagged N`` N more tagged for another agent's runs; ``--profile FILE`` runs the measured agent under
cProfile (thread CPU time) in every thread, over the measured window only, and prints where its time went (the
profile's own cost inflates the CPU figure). ``--ledger-peer`` measures, over the same window, this tree's agent
with the GPU ledger off (``GPUDECK_LEDGER=off``, for this benchmark only), and every agent's journal writes per
minute; ``--sim-gpus N --gpu-procs M`` runs the measured agents on N SIMULATED GPUs with M processes holding them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil

from gpudeck.agents.observe.gpus import GpuSampler
from gpudeck.agents.observe.procs import ProcTable
from gpudeck.agents.runs.supervisor import Supervisor
from gpudeck.agents.server.snapshot import SnapshotBuilder
from gpudeck.agents.storage.journal import Journal
from gpudeck.agents.wire.client import AgentClient
from gpudeck.agents.wire.protocol import LaunchSpec, WatchSnapshots

HOLD = (
    "import sys, time, torch\n"
    "x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device='cuda'); x.fill_(1)\n"
    "torch.cuda.synchronize(); print('ready', flush=True); time.sleep(3600)\n"
)


def timeit(fn, n: int, warm: int = 3) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Mean and p99 in milliseconds."""
    for _ in range(warm):
        fn()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1000)
    xs.sort()
    return statistics.fmean(xs), xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def line(name: str, mean: float, p99: float, ours: float | None = None, n: int = 0) -> None:
    ratio = f"  ({mean / ours:.1f}x gpudeck)" if ours else ""
    print(f"agent_sample {name:<28} {mean:9.3f} ms mean  {p99:9.3f} ms p99  n={n}{ratio}", flush=True)


async def main_async(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gd-bench-", dir="/tmp"))
    sampler = GpuSampler()
    print(f"agent_sample host GPUs: {sampler.count} ({sampler.error or 'NVML ok'})", flush=True)
    journal = Journal(tmp / "journal.db", "bench")
    procs = ProcTable()
    sup = Supervisor(journal, tmp / "runs", "bench", sampler, procs)
    builder = SnapshotBuilder("bench", journal.epoch, sampler, procs, sup)
    run = None
    if sampler.available and args.hold_gib > 0:
        run, _ = await sup.launch(LaunchSpec(argv=[sys.executable, "-c", HOLD, str(args.hold_gib)], gpus=[0], cwd=str(tmp)))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            await asyncio.to_thread(sup.refresh)
            snap = builder.build()
            held = [p for g in snap.gpus for p in g.processes if p.run_id == run.id and (p.used_bytes or 0) >= args.hold_gib * 0.9 * 2**30]
            if held:
                print(
                    f"agent_sample holder: pid {held[0].pid} {held[0].used_bytes / 2**30:.1f} GiB attributed {held[0].attribution} {run.id}",
                    flush=True,
                )
                break
            await asyncio.sleep(0.5)
        else:
            print("agent_sample holder did not appear on the GPU within 120 s", flush=True)
    sup.refresh()

    ours, ours99 = timeit(builder.build, args.n)
    line("gpudeck snapshot", ours, ours99, None, args.n)
    snap = builder.build()
    nprocs = sum(len(g.processes) for g in snap.gpus)
    print(
        f"agent_sample gpudeck snapshot covers {len(snap.gpus)} GPU(s), {nprocs} GPU process(es), {len(snap.runs)} live run(s)", flush=True
    )

    if sampler.available:
        import pynvml

        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(sampler.count)]

        def bare() -> None:
            for h in handles:
                pynvml.nvmlDeviceGetMemoryInfo(h)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    try:
                        psutil.Process(p.pid).create_time()
                    except psutil.Error:
                        pass

        m, p = timeit(bare, args.n)
        line("bare NVML+psutil (floor)", m, p, ours, args.n)

    smi = shutil.which("nvidia-smi")
    if smi:

        def smi_pair() -> None:
            subprocess.run(
                [
                    smi,
                    "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw",
                    "--format=csv,noheader,nounits",
                ],
                capture_output=True,
                check=True,
            )
            subprocess.run(
                [smi, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, check=True
            )

        m, p = timeit(smi_pair, 20, warm=1)
        line("nvidia-smi query pair", m, p, ours, 20)
    else:
        print("agent_sample nvidia-smi not found", flush=True)

    try:
        import gpustat as _g  # noqa: F401

        gpustat_cmd: list[str] | None = [sys.executable, "-m", "gpustat", "--json"]
    except ImportError:
        gpustat_cmd = [shutil.which("gpustat") or "gpustat", "--json"] if shutil.which("gpustat") else None
    if gpustat_cmd and sampler.available:
        probe = subprocess.run(gpustat_cmd, capture_output=True, text=True)
        if probe.returncode != 0:
            print(f"agent_sample gpustat failed (exit {probe.returncode}): {(probe.stderr or probe.stdout).strip()[-400:]}", flush=True)
        else:
            m, p = timeit(lambda: subprocess.run(gpustat_cmd, capture_output=True, check=True), 5, warm=1)
            line("gpustat --json exec", m, p, ours, 5)
    else:
        print("agent_sample gpustat: not installed or no GPU", flush=True)

    try:
        from nvitop import Device, GpuProcess
    except ImportError:
        print("agent_sample nvitop: not installed", flush=True)
    else:
        if sampler.available:

            def nvitop_refresh() -> None:
                devices = Device.all()
                for d in devices:
                    d.memory_used()
                    d.memory_total()
                    d.gpu_utilization()
                    d.temperature()
                    d.power_usage()
                    GpuProcess.take_snapshots(d.processes().values(), failsafe=True)

            m, p = timeit(nvitop_refresh, max(50, args.n // 10))
            line("nvitop refresh (in-process)", m, p, ours, max(50, args.n // 10))

    if run is not None:
        await sup.stop(run.id, grace_s=5)
    journal.close()

    if args.cpu_seconds > 0:
        extra_env: dict[str, str] = {}
        if args.sim_gpus:
            # the measured agents' simulated machine: holders declared by the benchmark's sleepers, no one else's
            extra_env = {"GPUDECK_SIMULATE_GPUS": f"{args.sim_gpus}:H100-80GB:80", "GPUDECK_SIM_SCOPE": f"bench-{os.getpid()}"}
        extra = start_sleepers(args.extra_procs, args.foreign_tagged)
        extra += start_gpu_holders(args.gpu_procs, args.sim_gpus, extra_env.get("GPUDECK_SIM_SCOPE", ""))
        try:
            n_host = len([n for n in os.listdir("/proc") if n.isdigit()])
            cpu = await agent_cpu(
                args.cpu_seconds,
                profile=args.profile,
                warmup=args.warmup,
                peer=args.peer_tree,
                ledger_peer=args.ledger_peer,
                extra_env=extra_env,
            )
        finally:
            stop_sleepers(extra)
        print(
            f"agent_sample agent CPU at 1 s snapshot interval: {cpu['this']:.3f}% of one core over {args.cpu_seconds} s "
            f"({n_host} processes on the host, {len(extra)} of them started by the benchmark)",
            flush=True,
        )
        if "ledger-off" in cpu:
            print(
                f"agent_sample ledger off (GPUDECK_LEDGER=off, this tree) CPU at 1 s snapshot interval, same window: "
                f"{cpu['ledger-off']:.3f}% of one core"
                + (f" (ledger on / off: {cpu['this'] / cpu['ledger-off']:.2f}x)" if cpu["ledger-off"] else "")
                + f"; {args.sim_gpus} SIMULATED GPU(s), {args.gpu_procs} GPU process(es)",
                flush=True,
            )
        if "peer" in cpu:
            print(
                f"agent_sample peer agent ({args.peer_tree}) CPU at 1 s snapshot interval, same window: {cpu['peer']:.3f}% of one core "
                f"({cpu['peer'] / cpu['this']:.2f}x this tree's)"
                if cpu["this"]
                else "",
                flush=True,
            )
    shutil.rmtree(tmp, ignore_errors=True)


def _newest_id() -> int | None:
    try:
        return int(Path("/proc/loadavg").read_text().split()[4])
    except (OSError, ValueError, IndexError):
        return None


def start_sleepers(n: int, foreign_tagged: int = 0) -> list[subprocess.Popen]:
    """``n`` idle processes (``sleep``), the host's process count a big machine has; ``foreign_tagged`` more that
    carry the ``GPUDECK_RUN_ID`` tag of runs the measured agent does not know (another agent's runs on a shared
    host: 10 runs, no ``GPUDECK_RUN_DIR`` of the agent's)."""
    out: list[subprocess.Popen] = []
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    try:
        for _ in range(n):
            out.append(subprocess.Popen(["sleep", "3600"], **quiet))  # type: ignore[call-overload]
        for i in range(foreign_tagged):
            env = {**os.environ, "GPUDECK_RUN_ID": f"r-f0re1gn{i % 10}", "RANK": str(i // 10)}
            out.append(subprocess.Popen(["sleep", "3600"], env=env, **quiet))  # type: ignore[call-overload]
    except BaseException:
        stop_sleepers(out)
        raise
    if n:
        print(f"agent_sample started {n} sleeping processes", flush=True)
    if foreign_tagged:
        print(f"agent_sample started {foreign_tagged} sleeping processes tagged for 10 runs of another agent", flush=True)
    return out


def start_gpu_holders(n: int, gpus: int, scope: str) -> list[subprocess.Popen]:
    """``n`` sleeping processes each holding 1 GiB on a simulated GPU (round robin over ``gpus``), in the benchmark's
    own simulated machine (``GPUDECK_SIM_SCOPE``: no other agent on the host counts them)."""
    if not n:
        return []
    if not gpus or not scope:
        raise SystemExit("--gpu-procs needs --sim-gpus")
    out: list[subprocess.Popen] = []
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    base = {k: v for k, v in os.environ.items() if k != "GPUDECK_HOME"}
    try:
        for i in range(n):
            env = {**base, "GPUDECK_SIM_GPU_MEM": f"{i % gpus}:1", "GPUDECK_SIM_SCOPE": scope}
            out.append(subprocess.Popen(["sleep", "3600"], env=env, **quiet))  # type: ignore[call-overload]
    except BaseException:
        stop_sleepers(out)
        raise
    print(f"agent_sample started {n} sleeping processes holding 1 GiB each on {gpus} SIMULATED GPU(s)", flush=True)
    return out


def stop_sleepers(procs: list[subprocess.Popen]) -> None:
    """Stop exactly the processes start_sleepers started, by pid."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


# the agent under cProfile in every thread (the sampler and journal threads do the work now), stats merged at exit
PROFILED_AGENT = r"""
import cProfile, pstats, sys, threading, time
from pathlib import Path
profiles = []
_run = threading.Thread.run
def run(self):
    p = cProfile.Profile(time.thread_time); profiles.append(p); p.enable()
    try:
        _run(self)
    finally:
        p.disable()
threading.Thread.run = run
main = cProfile.Profile(time.thread_time); profiles.append(main); main.enable()
import signal
# the benchmark sends SIGUSR2 as its window opens: what start-up cost (imports, the first read of every process) is dropped
signal.signal(signal.SIGUSR2, lambda *_: [p.clear() for p in profiles])
from gpudeck.agents.server.daemon import serve
def dump():
    # serve() calls this on every way out, also its os._exit one (worker threads still busy), which skips finally
    main.disable()
    st = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        try:
            st.add(p)
        except TypeError:  # a thread that never ran a profiled call
            pass
    st.dump_stats(sys.argv[1])
serve(Path(sys.argv[2]), on_exit=dump)
"""


async def _start_agent(
    label: str, code_root: Path, profile: str | None, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    """An agent of the code under ``code_root`` (this tree, or a peer's ``gpudeck/agents``) in its own GPUDECK_HOME."""
    home = Path(tempfile.mkdtemp(prefix=f"gd-cpu-{label}-", dir="/tmp"))
    pythonpath = os.pathsep.join(p for p in (str(code_root), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "GPUDECK_HOME": str(home), "PYTHONPATH": pythonpath, **(extra_env or {})}
    errlog = open(home / "agent.stderr", "wb")
    cmd = (
        [sys.executable, "-c", PROFILED_AGENT, profile, str(home / "agent")]
        if profile
        else [sys.executable, "-m", "gpudeck.agents", "serve", "--state-dir", str(home / "agent")]
    )
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=errlog, stderr=errlog, cwd=str(home)), home


async def _watch(client: AgentClient, seconds: float) -> int:
    n = 0
    t0 = time.monotonic()
    async for _snap in client.stream(WatchSnapshots(interval_s=1.0)):
        n += 1
        if time.monotonic() - t0 >= seconds:
            break
    return n


def _last_seq(home: Path) -> int:
    """The newest seq committed to an agent's journal (read-only): events written so far."""
    import sqlite3

    conn = sqlite3.connect(f"file:{home / 'agent' / 'journal.db'}?mode=ro", uri=True, timeout=10)
    try:
        return int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])
    finally:
        conn.close()


async def agent_cpu(
    seconds: float,
    profile: str | None = None,
    warmup: float = 2.0,
    peer: Path | None = None,
    ledger_peer: bool = False,
    extra_env: dict[str, str] | None = None,
) -> dict[str, float]:
    """CPU share of a real agent process that streams a snapshot every second to one watcher: this tree's agent
    and, with ``peer``, the agent of another tree's code measured over the same window (the same host churn); with
    ``ledger_peer``, this tree's agent with the GPU ledger off (``GPUDECK_LEDGER=off``) over the same window.
    ``extra_env``: for every agent (simulated GPUs). Prints each agent's journal writes (events) per minute."""
    agents = {"this": await _start_agent("this", ROOT, profile, extra_env)}
    if peer is not None:
        agents["peer"] = await _start_agent("peer", peer, None, extra_env)
    if ledger_peer:
        agents["ledger-off"] = await _start_agent("ledger-off", ROOT, None, {**(extra_env or {}), "GPUDECK_LEDGER": "off"})
    clients: dict[str, AgentClient] = {}
    try:
        for label, (_proc, home) in agents.items():
            for _ in range(1200):  # a minute: with thousands of processes (and a profiler) start-up reads each once
                try:
                    clients[label] = await AgentClient.connect_unix(state_dir=home / "agent", autostart=False)
                    break
                except Exception:
                    await asyncio.sleep(0.05)
            if label not in clients:
                raise SystemExit(f"{label} agent did not start: {(home / 'agent.stderr').read_text()[-2000:]}")
        await asyncio.sleep(warmup)  # past start-up (reading every process once)
        ps = {label: psutil.Process(proc.pid) for label, (proc, _home) in agents.items()}
        if profile:
            os.kill(agents["this"][0].pid, signal.SIGUSR2)  # the profile covers the window only
        ids0 = _newest_id()
        seq0 = {label: _last_seq(home) for label, (_proc, home) in agents.items()}
        c0 = {label: p.cpu_times() for label, p in ps.items()}
        t0 = time.monotonic()
        sent = await asyncio.gather(*(_watch(c, seconds) for c in clients.values()))
        c1 = {label: p.cpu_times() for label, p in ps.items()}
        wall = time.monotonic() - t0
        await asyncio.sleep(0.5)  # what the window queued is committed (the writer batches)
        seq1 = {label: _last_seq(home) for label, (_proc, home) in agents.items()}
        ids1 = _newest_id()
        if ids0 is not None and ids1 is not None:
            made = ids1 - ids0 if ids1 >= ids0 else ids1 + int(Path("/proc/sys/kernel/pid_max").read_text()) - ids0
            print(
                f"agent_sample the host handed out {made} new pids/tids during the window ({made / wall:.1f}/s): the agent reads each once",
                flush=True,
            )
        out: dict[str, float] = {}
        for label, n in zip(clients, sent, strict=True):
            used = (c1[label].user - c0[label].user) + (c1[label].system - c0[label].system)
            print(f"agent_sample {label} agent sent {n} snapshots in {wall:.1f} s; CPU {used:.3f} s", flush=True)
            wrote = seq1[label] - seq0[label]
            print(f"agent_sample {label} agent journal writes: {wrote} events in {wall:.1f} s ({wrote * 60 / wall:.1f}/min)", flush=True)
            out[label] = 100.0 * used / wall
        return out
    finally:
        for c in clients.values():
            await c.close()
        for proc, home in agents.values():
            proc.terminate()
            proc.wait(30)
            shutil.rmtree(home, ignore_errors=True)
        if profile:
            import pstats

            print(f"agent_sample profile of the agent (all threads) in {profile}; top by own time:", flush=True)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold-gib", type=float, default=20.0, help="GiB a run-attributed holder process keeps on GPU 0")
    ap.add_argument("-n", type=int, default=2000, help="snapshots to time")
    ap.add_argument("--cpu-seconds", type=float, default=30.0, help="how long to measure the agent's CPU (0: skip)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds between the agent answering and the CPU window")
    ap.add_argument(
        "--extra-procs", type=int, default=0, help="sleeping processes to start for the CPU measurement (stopped by pid after it)"
    )
    ap.add_argument(
        "--foreign-tagged", type=int, default=0, help="sleeping processes tagged for runs the agent does not know (another agent's)"
    )
    ap.add_argument(
        "--peer-tree",
        type=Path,
        default=None,
        help="also measure, over the same window, the agent of another version: a folder holding gpudeck/agents "
        "(e.g. mkdir -p D/gpudeck && git archive REV agents | tar -x -C D/gpudeck)",
    )
    ap.add_argument(
        "--ledger-peer",
        action="store_true",
        help="also measure this tree's agent with the GPU ledger off (GPUDECK_LEDGER=off), same window",
    )
    ap.add_argument(
        "--sim-gpus", type=int, default=0, help="run the measured agents on this many SIMULATED GPUs (0: NVML, as the host has)"
    )
    ap.add_argument("--gpu-procs", type=int, default=0, help="with --sim-gpus: this many sleeping processes holding 1 GiB each on them")
    ap.add_argument("--profile", default=None, help="write a cProfile of the measured agent (every thread) here and print its top")
    args = ap.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
