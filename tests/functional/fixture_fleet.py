"""Provides a Fleet with fixed, made-up data (labelled as fixtures) for deterministic screen snapshots."""

from __future__ import annotations

from agents.protocol import Gpu, GpuProcess, LaunchSpec, Member, Metrics, RunInfo, RunTelemetry, Snapshot, StopResult
from console.config import HostSettings
from console.fleet import Fleet, HostLink

T0 = 1_790_000_000.0  # a fixed instant, so every rendered time is the same on every run

GIB = 2**30


def fixture_snapshot() -> Snapshot:
    run_proc = GpuProcess(pid=4412, gpu=0, used_bytes=78 * GIB, attribution="RUN", run_id="r-7f3a9c21", rank=0, user="ada", status="running", cmdline=["python", "-m", "trainers.fsdp_lm", "--model-config", "llama-1b"])
    stale = GpuProcess(pid=3301, gpu=1, used_bytes=21 * GIB, attribution="STALE", run_id="r-1b2c3d4e", rank=2, user="ada", status="sleeping", cmdline=["python", "-m", "trainers.dflash"])
    foreign = GpuProcess(pid=999, gpu=1, used_bytes=3 * GIB, attribution="FOREIGN", user="bob", status="running", cmdline=["jupyter-kernel"])
    ghost = GpuProcess(pid=123456, gpu=2, used_bytes=5 * GIB, attribution="NO_SUCH_PROCESS")
    gpus = [
        Gpu(index=0, uuid="GPU-0", name="NVIDIA H200", memory_used=79 * GIB, memory_total=141 * GIB, util_gpu=97, util_mem=60, temperature_c=64, power_w=612.0, unaccounted_bytes=1 * GIB, processes=[run_proc]),
        Gpu(index=1, uuid="GPU-1", name="NVIDIA H200", memory_used=24 * GIB, memory_total=141 * GIB, util_gpu=0, util_mem=0, temperature_c=31, power_w=75.0, unaccounted_bytes=0, processes=[stale, foreign]),
        Gpu(index=2, uuid="GPU-2", name="NVIDIA H200", memory_used=5 * GIB, memory_total=141 * GIB, util_gpu=0, util_mem=0, temperature_c=30, power_w=74.0, unaccounted_bytes=0, processes=[ghost]),
        Gpu(index=3, uuid="GPU-3", name="NVIDIA H200", memory_used=0, memory_total=141 * GIB, util_gpu=0, util_mem=0, temperature_c=29, power_w=70.0, unaccounted_bytes=0),
    ]
    return Snapshot(host="gpu1", ts=T0, epoch="e", gpus=gpus, runs=[fixture_runs()[0]], sample_ms=0.21)


def fixture_runs() -> list[RunInfo]:
    tel = RunTelemetry(step=1200, loss=2.3456, tokens_per_s=71_313.0, tps_history=[60_000.0 + 500 * i for i in range(24)], world_size=1)
    live = RunInfo(id="r-7f3a9c21", host="gpu1", state="running", name="llama-1b", spec=LaunchSpec(argv=["python", "-m", "trainers.fsdp_lm", "--model-config", "llama-1b", "--fresh"], kind="fsdp", gpus=[0]), created=T0 - 3600, started=T0 - 3600, ended=T0 - 1, members=[Member(pid=4412, create_time=T0 - 3600, role="leader")], telemetry=tel)
    failed = RunInfo(id="r-1b2c3d4e", host="gpu1", state="failed", name="drafter", spec=LaunchSpec(argv=["python", "-m", "trainers.dflash", "--fresh"], kind="dflash", gpus=[1, 2]), created=T0 - 7200, started=T0 - 7200, ended=T0 - 5400, cause="exit code 1 (CUDA out of memory)", exit_code=1)
    stopped = RunInfo(id="r-00aa11bb", host="gpu1", state="stopped", spec=LaunchSpec(argv=["sleep", "1000"]), created=T0 - 9000, started=T0 - 9000, ended=T0 - 8000, cause="stopped by operator; 1 process(es) ignored SIGTERM for 30 s and needed SIGKILL")
    return [live, failed, stopped]


class FixtureLink(HostLink):
    """A host link that never connects: its status is set from fixtures."""

    def start(self) -> None:
        return None


class FixtureFleet(Fleet):
    """Fleet over fixture data: one up host with four GPUs, one unreachable host."""

    def __init__(self) -> None:
        self.history = None
        up = FixtureLink(HostSettings(name="gpu1"))
        up.status.state = "up"
        up.status.snapshot = fixture_snapshot()
        up.status.last_seen = T0
        down = FixtureLink(HostSettings(name="gpu2"))
        down.status.state = "unreachable"
        down.status.error = "connect timed out after 10 s (fixture)"
        down.status.since = T0
        self.links = {"gpu1": up, "gpu2": down}

    def start(self) -> None:
        return None

    async def runs(self, host: str, limit: int = 1000) -> list[RunInfo]:
        return fixture_runs() if host == "gpu1" else []

    async def run(self, host: str, run_id: str) -> RunInfo:
        return next(r for r in fixture_runs() if r.id == run_id)

    async def output(self, host, run_id, offset=0, follow=True):  # type: ignore[no-untyped-def]
        from agents.protocol import OutputChunk

        text = "".join(f"step {i:5d} loss {10 / (i + 1):.4f}\n" for i in range(40))
        yield OutputChunk(run_id=run_id, offset=0, next_offset=len(text), data=text, run_ended=True)

    async def metrics(self, host: str, run_id: str, max_points: int = 300) -> Metrics:
        steps = list(range(1, 121))
        return Metrics(run_id=run_id, steps=steps, loss=[10.0 / (s ** 0.5) for s in steps], tokens_per_s=[60_000.0 + (s % 7) * 900 for s in steps], mfu=[None] * len(steps), total_steps=len(steps))

    async def stop(self, host: str, run_id: str, grace_s: float = 30.0) -> StopResult:
        raise NotImplementedError
