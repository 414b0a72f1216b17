"""Provides a Fleet and a History with fixed, made-up data (labelled as fixtures) for deterministic screens.

Everything here is invented for the pictures: hosts, GPUs, pids, runs, the
pre-flight verdict, the leftovers, the reclaim and verify answers. Every
error message says "(fixture)". Times are offsets from ``T0``, and the
snapshot tests pin the console's clock at ``T0 + 300``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from gpudeck.agents.wire.errors import AgentError
from gpudeck.agents.wire.protocol import (
    Alert,
    ClaimRow,
    EnvFingerprint,
    Event,
    Gpu,
    GpuFreed,
    GpuProcess,
    LaunchReply,
    LaunchSpec,
    Leftover,
    LeftoverList,
    Member,
    MemoryEstimate,
    Metrics,
    OutputChunk,
    PreflightCheck,
    PreflightResult,
    RunInfo,
    RunTelemetry,
    Snapshot,
    StoppedProcess,
    StopResult,
    VerifyReply,
)
from gpudeck.console.core.config import HostSettings
from gpudeck.console.fleet.fleet import Fleet, HostLink
from gpudeck.console.history.replica import History

T0 = 1_790_000_000.0  # a fixed instant, so every rendered time is the same on every run
GIB = 2**30
LIVE = "r-7f3a9c21"
FAILED = "r-1b2c3d4e"
STOPPED = "r-00aa11bb"
GOOD = "r-90c0ffee"  # a succeeded fsdp run in the history: the known-good one


def env_fixture(
    torch: str = "2.6.0+cu124", cuda: str = "12.4", nccl: str = "2.21.5", driver: str = "550.54.15", extra: dict[str, str] | None = None
) -> EnvFingerprint:
    packages = {
        "torch": torch,
        "transformers": "4.46.3",
        "numpy": "2.1.3",
        "safetensors": "0.4.5",
        "nvidia-nccl-cu12": nccl,
        **(extra or {}),
    }
    return EnvFingerprint(
        python="/opt/venv/bin/python3",
        python_version="3.11.10",
        prefix="/opt/venv",
        torch=torch,
        torch_cuda=cuda,
        nccl=nccl,
        cudnn="9.1.0",
        transformers="4.46.3",
        driver=driver,
        packages=packages,
        freeze=[f"{k}=={v}" for k, v in sorted(packages.items())],
        freeze_hash=("a1b2c3d4" if torch.startswith("2.6") else "e5f6a7b8") * 8,
        taken=T0 - 3600,
    )


def fixture_alerts() -> list[Alert]:
    return [
        Alert(
            kind="throughput_drop",
            message="tokens/s fell to 41% of this run's baseline (71,313 -> 29,100) for 5 min: a rank or the data loader is stalling (fixture)",
            ts=T0 - 120,
            severity="warning",
        ),
        Alert(
            kind="rank_exited",
            message="rank 2 (pid 4414) exited with code 1 at step 1180; the run goes on with 3 of 4 ranks — stop it or relaunch (fixture)",
            ts=T0 - 200,
            severity="critical",
            rank=2,
            pid=4414,
        ),
    ]


def fixture_runs() -> list[RunInfo]:
    tel = RunTelemetry(
        step=1200,
        loss=2.3456,
        tokens_per_s=71_313.0,
        tps_history=[60_000.0 + 500 * i for i in range(24)],
        world_size=4,
        params_total=771_000_000,
    )
    live = RunInfo(
        id=LIVE,
        host="gpu1",
        state="running",
        name="llama-1b",
        spec=LaunchSpec(
            argv=["/opt/venv/bin/python3", "-m", "gpudeck.trainers.fsdp_lm", "--model-config", "llama-1b", "--lr", "3e-4", "--fresh"],
            kind="fsdp",
            gpus=[0],
            start="fresh",
            python="/opt/venv/bin/python3",
            parent=GOOD,
        ),
        created=T0 - 3600,
        started=T0 - 3600,
        members=[Member(pid=4412, create_time=T0 - 3600, role="leader")],
        telemetry=tel,
        alerts=fixture_alerts(),
        env=env_fixture("2.7.0+cu128", "12.8", "2.26.2", "570.86.10", {"triton": "3.3.0"}),
    )
    failed = RunInfo(
        id=FAILED,
        host="gpu1",
        state="failed",
        name="drafter",
        spec=LaunchSpec(argv=["python", "-m", "gpudeck.trainers.dflash", "--fresh"], kind="dflash", gpus=[1, 2], start="fresh"),
        created=T0 - 7200,
        started=T0 - 7200,
        ended=T0 - 5400,
        cause="exit code 1 (CUDA out of memory)",
        exit_code=1,
    )
    stopped = RunInfo(
        id=STOPPED,
        host="gpu1",
        state="stopped",
        spec=LaunchSpec(argv=["sleep", "1000"]),
        created=T0 - 9000,
        started=T0 - 9000,
        ended=T0 - 8000,
        cause="stopped by operator; 1 process(es) ignored SIGTERM for 30 s and needed SIGKILL",
    )
    return [live, failed, stopped]


def fixture_snapshot() -> Snapshot:
    run_proc = GpuProcess(
        pid=4412,
        gpu=0,
        used_bytes=78 * GIB,
        attribution="RUN",
        run_id=LIVE,
        rank=0,
        user="ada",
        status="running",
        create_time=T0 - 3600,
        cmdline=["python", "-m", "gpudeck.trainers.fsdp_lm", "--model-config", "llama-1b"],
    )
    stale = GpuProcess(
        pid=3301,
        gpu=1,
        used_bytes=21 * GIB,
        attribution="STALE",
        run_id=FAILED,
        rank=2,
        user="ada",
        status="sleeping",
        create_time=T0 - 7200,
        cmdline=["python", "-m", "gpudeck.trainers.dflash"],
    )
    foreign = GpuProcess(
        pid=999,
        gpu=1,
        used_bytes=3 * GIB,
        attribution="FOREIGN",
        user="bob",
        status="running",
        create_time=T0 - 86400 * 2,
        cmdline=["jupyter-kernel"],
    )
    ghost = GpuProcess(pid=123456, gpu=2, used_bytes=5 * GIB, attribution="NO_SUCH_PROCESS")
    gpus = [
        Gpu(
            index=0,
            uuid="GPU-0",
            name="NVIDIA H200",
            memory_used=79 * GIB,
            memory_total=141 * GIB,
            util_gpu=97,
            util_mem=60,
            temperature_c=64,
            power_w=612.0,
            power_limit_w=700.0,
            unaccounted_bytes=1 * GIB,
            processes=[run_proc],
        ),
        Gpu(
            index=1,
            uuid="GPU-1",
            name="NVIDIA H200",
            memory_used=24 * GIB,
            memory_total=141 * GIB,
            util_gpu=0,
            util_mem=0,
            temperature_c=31,
            power_w=75.0,
            power_limit_w=700.0,
            unaccounted_bytes=0,
            processes=[stale, foreign],
        ),
        Gpu(
            index=2,
            uuid="GPU-2",
            name="NVIDIA H200",
            memory_used=5 * GIB,
            memory_total=141 * GIB,
            util_gpu=0,
            util_mem=0,
            temperature_c=30,
            power_w=74.0,
            power_limit_w=700.0,
            unaccounted_bytes=0,
            processes=[ghost],
        ),
        Gpu(
            index=3,
            uuid="GPU-3",
            name="NVIDIA H200",
            memory_used=0,
            memory_total=141 * GIB,
            util_gpu=0,
            util_mem=0,
            temperature_c=29,
            power_w=70.0,
            power_limit_w=700.0,
            unaccounted_bytes=0,
        ),
    ]
    return Snapshot(host="gpu1", ts=T0, epoch="e", gpus=gpus, runs=[fixture_runs()[0]], sample_ms=0.21)


def sim_snapshot() -> Snapshot:
    gpus = [
        Gpu(
            index=i,
            uuid=f"GPU-SIM-0-{i}",
            name="SIMULATED H200",
            memory_used=0,
            memory_total=141 * GIB,
            util_gpu=0,
            util_mem=0,
            temperature_c=30,
            power_w=70.0,
            power_limit_w=700.0,
            unaccounted_bytes=0,
        )
        for i in range(2)
    ]
    return Snapshot(host="sim1", ts=T0, epoch="s", gpus=gpus, simulated=True, sample_ms=0.05)


def fixture_preflight(spec: LaunchSpec) -> PreflightResult:
    """A verdict where only the GPU-holder check fails (so --force is offered)."""
    checks = [
        PreflightCheck(name="gpus_exist", ok=True, message="GPU 1 exists on gpu1"),
        PreflightCheck(name="gpu_memory", ok=True, message="GPU 1: 117.0 GiB free, the run needs 34.2 GiB"),
        PreflightCheck(
            name="gpu_holders",
            ok=False,
            message="GPU 1 is held by pid 3301 (STALE: run r-1b2c3d4e, failed 1h25m ago, 21.0 GiB) and pid 999 (FOREIGN, bob, 3.0 GiB) — `gpudeck reclaim gpu1:3301` (fixture)",
        ),
        PreflightCheck(name="rdzv_port", ok=True, message="port 29500 is free"),
        PreflightCheck(name="checkpoint_room", ok=True, message="skipped: no checkpoint folder", details={"skipped": True}),
        PreflightCheck(name="python_env", ok=True, message="/opt/venv/bin/python3 imports torch 2.7.0+cu128"),
        PreflightCheck(name="start_explicit", ok=True, message=f"start: {spec.start or 'n/a'}"),
        PreflightCheck(name="resume_checkpoint", ok=True, message="skipped: a fresh start", details={"skipped": True}),
    ]
    est = MemoryEstimate(
        per_gpu_bytes=int(34.2 * GIB),
        params=1_100_000_000,
        method="llama config: 1.10e9 params x 16 B (fp32 master + AdamW) / 1 GPU + activations (fixture)",
    )
    return PreflightResult(ok=False, host="gpu1", checks=checks, estimate=est, seconds=0.4)


def fixture_leftovers() -> LeftoverList:
    return LeftoverList(
        leftovers=[
            Leftover(
                pid=3301,
                create_time=T0 - 7200,
                kind="orphan",
                run_id=FAILED,
                run_state="failed",
                run_ended=T0 - 5400,
                run_cause="exit code 1 (CUDA out of memory)",
                rank=2,
                user="ada",
                status="sleeping",
                cmdline=["python", "-m", "gpudeck.trainers.dflash"],
                gpu_bytes={1: 21 * GIB},
                note="its run ended 1h35m ago: reclaim it (fixture)",
            ),
            Leftover(
                pid=999,
                create_time=T0 - 86400 * 2,
                kind="foreign",
                user="bob",
                status="running",
                cmdline=["jupyter-kernel"],
                gpu_bytes={1: 3 * GIB},
                note="not a gpudeck run: ask bob first (fixture)",
            ),
            Leftover(
                pid=123456,
                kind="no_such_process",
                gpu_bytes={2: 5 * GIB},
                note="NVML reports it, the OS does not: a container's process, or a driver leak (fixture)",
            ),
        ],
        gpus=fixture_snapshot().gpus,
    )


def fixture_reclaim(pids: list[int]) -> StopResult:
    return StopResult(
        run_id=None,
        state="reclaimed",
        stopped=[
            StoppedProcess(pid=p, cmdline=["python", "-m", "gpudeck.trainers.dflash"] if p == 3301 else ["jupyter-kernel"], how="SIGTERM")
            for p in pids
        ],
        gpu_verified=True,
        gpu_note="NVML: none of the reclaimed pids holds GPU memory (fixture)",
        freed=[GpuFreed(gpu=1, before_bytes=24 * GIB, after_bytes=0, freed_bytes=24 * GIB)],
        freed_bytes=24 * GIB,
        seconds=1.23,
        message=f"{len(pids)} process(es) ended on SIGTERM",
    )


def fixture_verify(run_id: str) -> VerifyReply:
    return VerifyReply(
        run_id=run_id,
        rows=[
            ClaimRow(
                what="params",
                claimed=1_000_000_000,
                observed=771_000_000,
                ok=False,
                source="run name 'llama-1b'",
                detail="manifest params_total",
            ),
            ClaimRow(what="world size", claimed=4, observed=1, ok=False, source="claims", detail="rank 0 only"),
            ClaimRow(what="GPUs", claimed=4, observed=1, ok=False, source="claims", detail="GPU 0"),
            ClaimRow(what="dataset samples", claimed=None, observed=5, ok=None, source="", detail="manifest"),
            ClaimRow(what="tokens/s", claimed=60_000.0, observed=71_313.0, ok=True, source="claims", detail="median of recent steps"),
        ],
        alerts=[
            Alert(
                kind="claim_mismatch",
                message="claimed 1B parameters on 4 GPUs; observed 771M on 1 GPU (fixture)",
                ts=T0 - 3000,
                severity="critical",
            )
        ],
    )


# ----------------------------------------------------------------------------- history


def _spec_dict(spec: LaunchSpec) -> dict[str, Any]:
    return msgspec.to_builtins(spec)


def history_events(
    run: RunInfo, seq0: int, env: EnvFingerprint | None = None, extra: list[tuple[float, str, dict[str, Any]]] = ()
) -> list[Event]:  # type: ignore[assignment]
    """The journal events an agent would have sent for ``run``."""
    evs = [
        (run.created, "run_created", {"state": "starting", "spec": _spec_dict(run.spec), "name": run.name}),
        ((run.started or run.created) + 0.5, "run_state", {"state": "running", "started": run.started}),
    ]
    if env is not None:
        evs.append(((run.started or run.created) + 1, "env_fingerprint", {"env": msgspec.to_builtins(env)}))
    evs.extend(extra)
    if run.ended:
        evs.append((run.ended, "run_state", {"state": run.state, "cause": run.cause, "exit_code": run.exit_code, "ended": run.ended}))
    return [Event(seq=seq0 + i, ts=ts, kind=kind, run_id=run.id, data=data) for i, (ts, kind, data) in enumerate(evs)]


def fill_history(history: History) -> None:
    """The runs above (plus a known-good one), as the history would hold them after syncing gpu1."""
    live, failed, stopped = fixture_runs()
    good = RunInfo(
        id=GOOD,
        host="gpu1",
        state="succeeded",
        name="llama-1b",
        spec=LaunchSpec(
            argv=["/opt/venv/bin/python3", "-m", "gpudeck.trainers.fsdp_lm", "--model-config", "llama-1b", "--lr", "1e-4", "--fresh"],
            kind="fsdp",
            gpus=[0, 1],
            start="fresh",
            python="/opt/venv/bin/python3",
        ),
        created=T0 - 86400 * 3,
        started=T0 - 86400 * 3,
        ended=T0 - 86400 * 3 + 5400,
        cause="exit code 0",
        exit_code=0,
    )
    step = lambda run, s, loss, tps: (
        run.started + s,
        "telemetry",
        {
            "record": {
                "type": "step",
                "rank": 0,
                "step": s,
                "loss": loss,
                "tokens_per_s": tps,
                "mfu": 0.41,
                "mem_peak_gib": 61.2,
                "ts": run.started + s,
            }
        },
    )
    manifest = lambda run, n, ws: (
        run.started + 0.8,
        "telemetry",
        {"record": {"type": "manifest", "rank": 0, "params_total": n, "world_size": ws, "config_hash": "c0ffee"}},
    )
    events: list[Event] = []
    events += history_events(good, 1, env_fixture(), [manifest(good, 1_100_048_384, 2), step(good, 5000, 2.1, 70_100.0)])
    alerts = [(a.ts, "alert", {"alert": msgspec.to_builtins(a)}) for a in reversed(fixture_alerts())]
    events += history_events(live, 100, live.env, [manifest(live, 771_000_000, 1), step(live, 1200, 2.3456, 71_313.0), *alerts])
    events += history_events(failed, 200, None, [step(failed, 300, 4.2, 12_000.0)])
    events += history_events(stopped, 300)
    history.submit("gpu1", "e", events).result(30)


# ----------------------------------------------------------------------------- the fleet


class FixtureLink(HostLink):
    """A host link that never connects: its status is set from fixtures."""

    def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


def fixture_link(name: str, state: str, *, snapshot: Snapshot | None = None, error: str | None = None, since: float = T0) -> FixtureLink:
    link = FixtureLink(HostSettings(name=name))
    link.status.state = state  # type: ignore[assignment]
    link.status.snapshot = snapshot
    link.status.error = error
    link.status.since = since
    link.status.last_seen = T0 if snapshot is not None else None
    if state == "up":
        link.status.agent_version = "0.4.0"
    return link


class FixtureFleet(Fleet):
    """Fleet over fixture data: gpu1 up with four GPUs and trouble, sim1 up and SIMULATED, and one host in each bad link state."""

    def __init__(self, history_path: Path | None = None) -> None:
        self.history = None
        if history_path is not None:
            self.history = History(history_path)
            fill_history(self.history)
        self.links = {
            "gpu1": fixture_link("gpu1", "up", snapshot=fixture_snapshot()),
            "gpu2": fixture_link("gpu2", "unreachable", error="connect timed out after 10 s (fixture)", since=T0),
            "gpu3": fixture_link(
                "gpu3",
                "host_key",
                error="gpu3's host key is not in known_hosts: check its fingerprint, then `ssh gpu3` once to accept it (fixture)",
                since=T0 - 60,
            ),
            "gpu4": fixture_link(
                "gpu4",
                "version_mismatch",
                error="agent 0.3.1 speaks protocol 0; this console speaks 1: install the same gpudeck on gpu4 (fixture)",
                since=T0 - 120,
            ),
            "gpu5": fixture_link("gpu5", "connecting", since=T0 + 297),
            "sim1": fixture_link("sim1", "up", snapshot=sim_snapshot()),
        }
        self.launched: list[tuple[str, LaunchSpec]] = []
        self.reclaimed: list[tuple[str, list[int], bool]] = []
        self.preflighted: list[tuple[str, LaunchSpec]] = []
        self.started: list[RunInfo] = []

    def start(self) -> None:
        return None

    async def close(self) -> None:
        if self.history is not None:
            self.history.close()

    def _host(self, host: str) -> None:
        if host != "gpu1" and host != "sim1":
            raise AgentError(f"host {host} is {self.links[host].status.state} (fixture)")

    async def runs(self, host: str, limit: int = 1000) -> list[RunInfo]:
        self._host(host)
        return fixture_runs() if host == "gpu1" else []

    async def run(self, host: str, run_id: str) -> RunInfo:
        self._host(host)
        for r in [*fixture_runs(), *self.started]:
            if r.id == run_id:
                return r
        raise AgentError(f"no run {run_id!r} on {host} (fixture)")

    async def output(self, host, run_id, offset=0, follow=True):  # type: ignore[no-untyped-def]
        text = "".join(f"step {i:5d} loss {10 / (i + 1):.4f}\n" for i in range(40))
        yield OutputChunk(run_id=run_id, offset=0, next_offset=len(text), data=text, run_ended=True)

    async def metrics(self, host: str, run_id: str, max_points: int = 300) -> Metrics:
        steps = list(range(1, 121))
        return Metrics(
            run_id=run_id,
            steps=steps,
            loss=[10.0 / (s**0.5) for s in steps],
            tokens_per_s=[60_000.0 + (s % 7) * 900 for s in steps],
            mfu=[None] * len(steps),
            total_steps=len(steps),
        )

    async def stop(self, host: str, run_id: str, grace_s: float = 30.0) -> StopResult:
        return StopResult(
            run_id=run_id,
            state="stopped",
            stopped=[StoppedProcess(pid=4412, cmdline=["python", "-m", "gpudeck.trainers.fsdp_lm"], how="SIGTERM")],
            gpu_verified=True,
            gpu_note="NVML: GPU 0 no longer lists pid 4412 (fixture)",
            freed=[GpuFreed(gpu=0, before_bytes=79 * GIB, after_bytes=1 * GIB, freed_bytes=78 * GIB)],
            freed_bytes=78 * GIB,
            seconds=2.5,
        )

    async def preflight(self, host: str, spec: LaunchSpec) -> PreflightResult:
        self._host(host)
        self.preflighted.append((host, spec))
        return fixture_preflight(spec)

    async def launch(self, host: str, spec: LaunchSpec, request_id: str = "") -> LaunchReply:
        self._host(host)
        self.launched.append((host, spec))
        run = RunInfo(
            id=f"r-newrun{len(self.launched):02d}",
            host=host,
            state="starting",
            spec=spec,
            name=spec.name,
            created=T0 + 299,
            started=T0 + 299,
        )
        self.started.append(run)
        return LaunchReply(run=run)

    async def leftovers(self, host: str, include_live: bool = False) -> LeftoverList:
        self._host(host)
        return fixture_leftovers()

    async def reclaim(self, host: str, pids: list[int], grace_s: float = 10.0, include_live: bool = False) -> StopResult:
        self._host(host)
        self.reclaimed.append((host, pids, include_live))
        return fixture_reclaim(pids)

    async def verify(self, host: str, run_id: str) -> VerifyReply:
        self._host(host)
        return fixture_verify(run_id)

    async def fingerprint(self, host: str, python: str) -> EnvFingerprint:
        self._host(host)
        return env_fixture()  # the known-good environment, unchanged
