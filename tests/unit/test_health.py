"""Health rules and claims of live runs, replayed over fake time with synthetic observations."""

from __future__ import annotations

import pytest

from gpudeck.agents.health.rules import (
    GIB,
    GPU_IDLE_S,
    HEARTBEAT_LOST_S,
    RANK_CLEAN_EXIT_GRACE_S,
    THROUGHPUT_RECOVER_S,
    Baseline,
    Observation,
    RunHealth,
    claims_report,
    observe,
    parse_claims,
)
from gpudeck.agents.wire.protocol import (
    Claims,
    Gpu,
    GpuProcess,
    LaunchSpec,
    Member,
    MemoryEstimate,
    PreflightResult,
    RankTelemetry,
    RunInfo,
    RunTelemetry,
)

T0 = 1_700_000_000.0
TICK = 0.5


def make_run(
    *,
    state: str = "running",
    name: str | None = None,
    world_size: int | None = 2,
    ranks_seen: dict[int, float] | None = None,
    **spec: object,
) -> RunInfo:
    tel = RunTelemetry(
        world_size=world_size,
        ranks={str(r): RankTelemetry(rank=r, pid=4410 + r, last_seen=ts) for r, ts in (ranks_seen or {}).items()},
    )
    return RunInfo(
        id="r-9f8e7d6c",
        host="h",
        state=state,  # type: ignore[arg-type]
        name=name,
        started=T0,
        spec=LaunchSpec(argv=["torchrun", "train.py"], name=name, **spec),  # type: ignore[arg-type]
        telemetry=tel,
    )


def obs(run: RunInfo, now: float, ranks: dict[int, int] | None = None, **kw: object) -> Observation:
    return Observation(now=now, run=run, live_ranks=dict(ranks if ranks is not None else {0: 4410, 1: 4411}), **kw)  # type: ignore[arg-type]


def kinds(alerts: list) -> list[tuple[str, int | None, int | None]]:
    return [(a.kind, a.rank, a.gpu) for a in alerts]


# ----------------------------------------------------------------------------- rank exited


def test_killed_rank_alerts_on_the_first_tick_after_it_is_gone() -> None:
    run = make_run(ranks_seen={0: T0, 1: T0})
    run.telemetry.last_checkpoint = 200  # type: ignore[union-attr]
    h = RunHealth(run.id)
    for i in range(4):
        assert h.update(obs(run, T0 + i * TICK)) == []
    assert not h.rank_death
    got = h.update(obs(run, T0 + 4 * TICK, {0: 4410}, exited_ranks={1: (4411, -9)}))
    assert kinds(got) == [("rank_exited", 1, None)]
    a = got[0]
    assert a.severity == "critical" and a.pid == 4411
    assert a.message.startswith("rank 1 (pid 4411) exited with code -9 (SIGKILL) while the run goes on: 1 of 2 ranks left")
    assert "gpudeck stop r-9f8e7d6c" in a.message and "--resume 200" in a.message
    assert a.data["exit_code"] == -9 and a.data["live_ranks"] == [0]
    assert h.rank_death and not h.wants_stop
    # raised once: later ticks do not raise it again, it stays active
    assert h.update(obs(run, T0 + 5 * TICK, {0: 4410})) == []
    assert kinds(h.active) == [("rank_exited", 1, None)]


def test_rank_gone_without_exit_code_alerts_within_a_second() -> None:
    run = make_run()
    h = RunHealth(run.id)
    h.update(obs(run, T0))
    assert h.update(obs(run, T0 + TICK, {0: 4410})) == []  # one tick: the run may be ending normally
    got = h.update(obs(run, T0 + 3 * TICK, {0: 4410}))
    assert kinds(got) == [("rank_exited", 1, None)]
    assert "exited (exit code unknown)" in got[0].message
    assert "no checkpoint recorded yet" in got[0].message


def test_no_rank_alert_while_stopping_or_after_done() -> None:
    run = make_run()
    h = RunHealth(run.id)
    h.update(obs(run, T0))
    for i in range(1, 10):
        assert h.update(obs(run, T0 + i, {}, stopping=True, exited_ranks={0: (4410, -15), 1: (4411, -15)})) == []
    assert not h.rank_death and h.active == []

    run = make_run()
    h = RunHealth(run.id)
    h.update(obs(run, T0))
    run.telemetry.done = True  # type: ignore[union-attr]
    assert h.update(obs(run, T0 + 5, {0: 4410}, exited_ranks={1: (4411, 0)})) == []


def test_clean_exit_of_one_rank_alerts_only_when_its_peers_go_on() -> None:
    run = make_run()
    h = RunHealth(run.id)
    h.update(obs(run, T0))
    assert h.update(obs(run, T0 + 1, {0: 4410}, exited_ranks={1: (4411, 0)})) == []
    assert h.update(obs(run, T0 + RANK_CLEAN_EXIT_GRACE_S - 1, {0: 4410})) == []
    got = h.update(obs(run, T0 + RANK_CLEAN_EXIT_GRACE_S + 2, {0: 4410}))
    assert kinds(got) == [("rank_exited", 1, None)] and "exited with code 0" in got[0].message


def test_rank_that_comes_back_clears_and_stop_policy_is_exposed() -> None:
    run = make_run(on_rank_death="stop")
    h = RunHealth(run.id)
    h.update(obs(run, T0))
    got = h.update(obs(run, T0 + TICK, {0: 4410}, exited_ranks={1: (4411, 1)}))
    assert "stopping the run (--on-rank-death stop)" in got[0].message
    assert h.wants_stop
    assert h.update(obs(run, T0 + 2 * TICK, {0: 4410, 1: 5000})) == []  # torchrun restarted rank 1
    assert not h.rank_death and h.active == []
    cleared = h.cleared_since_last()
    assert kinds(cleared) == [("rank_exited", 1, None)] and cleared[0].cleared == T0 + 2 * TICK
    assert h.cleared_since_last() == []


def test_expected_ranks_come_from_torchrun_arguments_first() -> None:
    run = make_run(world_size=None, expected_ranks=3)
    h = RunHealth(run.id)
    h.update(obs(run, T0, {0: 1, 1: 2, 2: 3}))
    got = h.update(obs(run, T0 + TICK, {0: 1}, exited_ranks={1: (2, -9), 2: (3, -9)}))
    assert [a.rank for a in got] == [1, 2]
    assert all("1 of 3 ranks left" in a.message for a in got)


# ----------------------------------------------------------------------------- heartbeats


def test_heartbeat_lost_after_20_s_not_at_15_s_and_cleared_by_the_next_beat() -> None:
    run = make_run(ranks_seen={0: T0, 1: T0})
    h = RunHealth(run.id)
    ranks = run.telemetry.ranks  # type: ignore[union-attr]
    t = T0
    while t < T0 + 15:
        ranks["0"].last_seen = t  # rank 0 keeps beating, rank 1 went quiet at T0
        assert h.update(obs(run, t)) == []
        t += TICK
    assert h.update(obs(run, T0 + 15)) == []
    assert h.update(obs(run, T0 + HEARTBEAT_LOST_S)) == []  # 20 s exactly is still within the bound
    got = h.update(obs(run, T0 + HEARTBEAT_LOST_S + TICK))
    assert kinds(got) == [("heartbeat_lost", 1, None)]
    a = got[0]
    assert a.severity == "critical" and a.pid == 4411 and "py-spy dump --pid 4411" in a.message
    assert "for 20 s" in a.message or "for 21 s" in a.message
    assert h.update(obs(run, T0 + 25)) == []
    ranks["1"].last_seen = T0 + 25.5
    assert h.update(obs(run, T0 + 26)) == []
    assert h.active == [] and kinds(h.cleared_since_last()) == [("heartbeat_lost", 1, None)]


def test_rank_that_never_reported_is_not_heartbeat_lost() -> None:
    run = make_run(ranks_seen={0: T0 + 100})  # rank 1 has no telemetry at all
    h = RunHealth(run.id)
    assert h.update(obs(run, T0 + 100)) == []
    run.telemetry.ranks["1"] = RankTelemetry(rank=1)  # a record without ts  # type: ignore[union-attr]
    assert h.update(obs(run, T0 + 100.5)) == []


def test_no_heartbeat_alert_while_stopping() -> None:
    run = make_run(ranks_seen={0: T0, 1: T0})
    h = RunHealth(run.id)
    assert h.update(obs(run, T0 + 60, stopping=True)) == []


# ----------------------------------------------------------------------------- GPU idle


def test_gpu_idle_59_s_no_alert_61_s_alert_cleared_when_busy() -> None:
    run = make_run(gpus=[2, 3])
    h = RunHealth(run.id)
    held = {2: int(37.2 * GIB), 3: int(37.2 * GIB)}
    util = {0: 95, 1: 95, 2: 0, 3: 88}
    t = T0
    while t <= T0 + GPU_IDLE_S - 1:
        assert h.update(obs(run, t, gpu_util=util, run_gpu_memory=held)) == [], t - T0
        t += TICK
    got = h.update(obs(run, T0 + 61, gpu_util=util, run_gpu_memory=held))
    assert kinds(got) == [("gpu_idle", None, 2)]
    assert got[0].message.startswith("GPU 2 idle for 61 s with 37.2 GiB still held by the run")
    assert got[0].data["held_bytes"] == held[2]
    assert h.update(obs(run, T0 + 62, gpu_util=util, run_gpu_memory=held)) == []
    assert h.update(obs(run, T0 + 63, gpu_util={**util, 2: 40}, run_gpu_memory=held)) == []
    assert h.active == [] and kinds(h.cleared_since_last()) == [("gpu_idle", None, 2)]


def test_a_busy_or_unknown_sample_breaks_the_idle_stretch() -> None:
    run = make_run()  # no --gpus: the run's GPUs are where it holds memory
    h = RunHealth(run.id)
    held = {0: GIB}
    for i in range(0, 50):
        h.update(obs(run, T0 + i, gpu_util={0: 0, 1: 0}, run_gpu_memory=held))
    h.update(obs(run, T0 + 50, gpu_util={0: None, 1: 0}, run_gpu_memory=held))
    for i in range(51, 100):
        assert h.update(obs(run, T0 + i, gpu_util={0: 0, 1: 0}, run_gpu_memory=held)) == []
    got = h.update(obs(run, T0 + 112, gpu_util={0: 0, 1: 0}, run_gpu_memory=held))
    assert kinds(got) == [("gpu_idle", None, 0)]  # GPU 1 is not the run's


def test_assigned_gpu_without_the_runs_memory_says_so_and_idle_only_counts_while_running() -> None:
    run = make_run(state="starting", gpus=[1])
    h = RunHealth(run.id)
    for i in range(0, 100):
        assert h.update(obs(run, T0 + i, gpu_util={1: 0})) == []
    run.state = "running"
    # --gpus 1, but the run holds nothing there: not a claim it is wrong about (a CPU-only program), an idle GPU
    assert h.update(obs(run, T0 + 100, gpu_util={1: 0})) == []
    got = h.update(obs(run, T0 + 161, gpu_util={1: 0}))
    assert kinds(got) == [("gpu_idle", None, 1)]
    assert "GPU 1 idle for 61 s and the run holds no memory there" in got[0].message


# ----------------------------------------------------------------------------- throughput


def feed_steps(
    h: RunHealth, run: RunInfo, start: float, values: list[float], every: float = 2.0, step0: int = 1, baseline: Baseline | None = None
) -> list:
    tel = run.telemetry
    assert tel is not None
    raised = []
    for i, v in enumerate(values):
        tel.step, tel.tokens_per_s = step0 + i, v
        raised += h.update(obs(run, start + i * every), baseline)
    return raised


def test_throughput_drop_vs_own_10_min_median() -> None:
    run = make_run()
    h = RunHealth(run.id)
    assert feed_steps(h, run, T0, [1248.0] * 60) == []  # 2 minutes of steady steps
    # one slow step (a recompile, the step after a checkpoint) is not a drop
    assert feed_steps(h, run, T0 + 120, [312.0], step0=61) == []
    assert feed_steps(h, run, T0 + 122, [1248.0, 1248.0], step0=62) == []
    got = feed_steps(h, run, T0 + 126, [312.0, 312.0], step0=64)
    assert kinds(got) == [("throughput_drop", None, None)]
    assert got[0].message.startswith("312 tok/s is 25% of this run's 10-min median 1,248 tok/s")
    assert got[0].data["median_tokens_per_s"] == 1248.0 and got[0].data["compared_with"] == "own"
    # a long drop does not become the new normal: still active after 10 minutes, not raised again
    assert feed_steps(h, run, T0 + 130, [312.0] * 400, step0=66) == []
    assert len(h.active) == 1
    # recovery clears only once it has held THROUGHPUT_RECOVER_S (30 s), every step above the line
    assert feed_steps(h, run, T0 + 930, [1200.0] * 10, step0=466) == []  # 18 s back up
    assert len(h.active) == 1 and h.cleared_since_last() == []
    assert feed_steps(h, run, T0 + 950, [312.0, 312.0], step0=476) == []  # down again: the recovery starts over
    assert feed_steps(h, run, T0 + 954, [1200.0] * 16, step0=478) == []  # 30 s back up from T0 + 954
    assert len(h.active) == 1
    assert feed_steps(h, run, T0 + 986, [1200.0], step0=494) == []  # 32 s: cleared
    cleared = h.cleared_since_last()
    assert h.active == [] and kinds(cleared) == [("throughput_drop", None, None)]
    assert cleared[0].cleared is not None and cleared[0].cleared - (T0 + 956) >= THROUGHPUT_RECOVER_S
    assert "it clears after 30 s back above 60%" in cleared[0].message


def test_throughput_needs_five_samples_over_a_minute() -> None:
    run = make_run()
    h = RunHealth(run.id)
    # 30 steps in 15 s: plenty of samples, too short a span
    assert feed_steps(h, run, T0, [1000.0] * 30 + [100.0, 100.0], every=0.5) == []
    assert h.own_median(T0 + 16) is None


def test_throughput_drop_vs_baseline_names_the_run() -> None:
    run = make_run()
    h = RunHealth(run.id)
    base = Baseline(run_id="r-1a2b3c4d", median_tokens_per_s=2000.0, config_hash="abc")
    # steady at its own pace, but that pace is 40% of the earlier run with the same config
    got = feed_steps(h, run, T0, [800.0] * 40, baseline=base)
    assert kinds(got) == [("throughput_drop", None, None)]
    a = got[0]
    assert a.message.startswith("800 tok/s is 40% of run r-1a2b3c4d's median 2,000 tok/s (same config)")
    assert a.data["baseline_run"] == "r-1a2b3c4d" and a.data["compared_with"] == "baseline"
    assert feed_steps(h, run, T0 + 80, [800.0] * 10, step0=41, baseline=base) == []


# ----------------------------------------------------------------------------- claims


def gpus_with(holders: dict[int, int], run_id: str) -> list[Gpu]:
    return [
        Gpu(
            index=i,
            uuid=f"GPU-{i}",
            name="H200",
            memory_used=0,
            memory_total=141 * GIB,
            util_gpu=90,
            processes=[GpuProcess(pid=holders[i], gpu=i, used_bytes=30 * GIB, attribution="RUN", run_id=run_id)] if i in holders else [],
        )
        for i in range(4)
    ]


def test_claimed_4_gpus_observed_1() -> None:
    run = make_run(name="1b-4gpu", world_size=1, ranks_seen={0: T0})
    run.telemetry.params_total = 771_000_000  # type: ignore[union-attr]
    run.telemetry.step = 1  # type: ignore[union-attr]
    h = RunHealth(run.id)
    o = obs(run, T0 + 1, {0: 4410}, gpu_util={i: 90 for i in range(4)}, run_gpu_memory={0: 30 * GIB})
    got = h.update(o)
    by_what = {a.data["what"]: a for a in got}
    assert set(by_what) == {"GPUs", "params"}
    assert by_what["GPUs"].message.startswith("claimed 4 GPUs, observed 1: GPU 0 (run name '1b-4gpu')")
    assert by_what["params"].message.startswith("claimed 1.00B params, observed 771M")
    assert h.update(o) == []  # not raised again
    rows = {r.what: r for r in h.claims_report(o)}
    assert rows["GPUs"].claimed == 4 and rows["GPUs"].observed == 1 and rows["GPUs"].ok is False
    assert rows["world size"].claimed == 1 and rows["world size"].source == "manifest" and rows["world size"].ok is True


def test_a_cpu_only_program_launched_with_gpus_0_is_no_gpu_claim_mismatch() -> None:
    # `--gpus 0` makes GPU 0 visible; a program that never touches it claimed no GPU count: no verdict, no alert
    run = make_run(world_size=1, gpus=[0], ranks_seen={0: T0})
    run.telemetry.step = 1  # type: ignore[union-attr]
    o = obs(run, T0 + 120, {0: 4410}, gpu_util={0: 0, 1: 0})
    row = {r.what: r for r in claims_report(o)}["GPUs"]
    assert (row.claimed, row.observed, row.ok, row.source) == (1, 0, None, "--gpus 0")
    assert row.detail.startswith("holds no GPU memory")
    h = RunHealth(run.id)
    assert not [a for a in h.update(o) if a.kind == "claim_mismatch"]
    # an explicit claim of a GPU is still checked against what it holds
    run.spec.claims = Claims(gpus=1)
    assert {r.what: r for r in claims_report(o)}["GPUs"].ok is False


def test_gpus_claim_from_launch_gpus_and_no_gpu_row_verdict_without_gpus() -> None:
    run = make_run(world_size=1, gpus=[0, 1, 2, 3], ranks_seen={0: T0})
    run.telemetry.step = 1  # type: ignore[union-attr]
    o = obs(run, T0 + 1, {0: 4410}, gpu_util={i: 90 for i in range(4)}, run_gpu_memory={0: GIB})
    rows = {r.what: r for r in claims_report(o)}
    assert rows["GPUs"].source == "--gpus 0,1,2,3" and rows["GPUs"].ok is False
    o = obs(run, T0 + 1, {0: 4410})  # a host without GPUs: nothing observed, no verdict
    rows = {r.what: r for r in claims_report(o)}
    assert rows["GPUs"].observed is None and rows["GPUs"].ok is None


def test_claims_wait_for_the_run_to_settle_and_clear_when_they_match() -> None:
    run = make_run(world_size=None, claims=Claims(world_size=4))
    h = RunHealth(run.id)
    assert h.update(obs(run, T0 + 10, {0: 1, 1: 2})) == []  # ranks still starting
    got = h.update(obs(run, T0 + 61, {0: 1, 1: 2}))
    assert [a.data["what"] for a in got] == ["world size"]
    assert got[0].message.startswith("claimed world size 4, observed 2 rank processes: rank 0, rank 1 (claims)")
    assert h.update(obs(run, T0 + 62, {0: 1, 1: 2, 2: 3, 3: 4})) == []
    assert h.active == [] and [a.data["what"] for a in h.cleared_since_last()] == ["world size"]


def test_a_rank_still_starting_while_rank_0_steps_is_no_world_size_claim() -> None:
    # ranks.py under load: rank 0 steps while rank 2 still imports; CI once saw "claimed 3, observed 2" here
    run = make_run(world_size=3, claims=Claims(world_size=3))
    run.telemetry.step = 1  # type: ignore[union-attr]
    h = RunHealth(run.id)
    assert h.update(obs(run, T0 + 5, {0: 1, 1: 2})) == []
    assert h.update(obs(run, T0 + 6, {0: 1, 1: 2, 2: 3})) == []  # all there: settled, and the claim holds
    got = h.update(obs(run, T0 + 8, {0: 1, 2: 3}, exited_ranks={1: (2, -9)}))
    assert kinds(got) == [("rank_exited", 1, None)]
    # a rank that never comes is still told, once the settle time has passed
    late = make_run(world_size=3, claims=Claims(world_size=3))
    late.telemetry.step = 1  # type: ignore[union-attr]
    h = RunHealth(late.id)
    assert h.update(obs(late, T0 + 5, {0: 1, 1: 2})) == []
    assert [a.data["what"] for a in h.update(obs(late, T0 + 61, {0: 1, 1: 2}))] == ["world size"]
    # a manifest's world size is the run's own word: a huge one only delays the claims to the settle time
    huge = make_run(world_size=10**9, claims=Claims(world_size=3))
    huge.telemetry.step = 1  # type: ignore[union-attr]
    h = RunHealth(huge.id)
    assert h.update(obs(huge, T0 + 5, {0: 1, 1: 2})) == []
    assert "world size" in [a.data["what"] for a in h.update(obs(huge, T0 + 61, {0: 1, 1: 2}))]


def test_a_dead_rank_is_rank_exited_not_a_world_size_claim() -> None:
    run = make_run(world_size=2)
    run.telemetry.step = 1  # type: ignore[union-attr]
    h = RunHealth(run.id)
    h.update(obs(run, T0))
    got = h.update(obs(run, T0 + 100, {0: 4410}, exited_ranks={1: (4411, -9)}))
    assert kinds(got) == [("rank_exited", 1, None)]


def test_multi_node_share_is_not_a_mismatch() -> None:
    run = make_run(world_size=8, nnodes=2, claims=Claims(gpus=8))
    run.telemetry.step = 1  # type: ignore[union-attr]
    four = {i: 4410 + i for i in range(4)}
    o = obs(run, T0 + 1, four, gpu_util={i: 90 for i in range(4)}, run_gpu_memory={i: GIB for i in range(4)})
    assert RunHealth(run.id).update(o) == []
    rows = {r.what: r for r in claims_report(o)}
    assert rows["world size"].ok is None and rows["GPUs"].ok is None


def test_claims_report_rows_without_claims() -> None:
    run = make_run(world_size=2)
    tel = run.telemetry
    assert tel is not None
    tel.params_total, tel.tps_history = 1_100_048_384, [1000.0, 1010.0, 990.0, 1005.0, 995.0]
    run.preflight = PreflightResult(ok=True, estimate=MemoryEstimate(per_gpu_bytes=1, params=1_100_000_000))
    o = obs(
        run,
        T0,
        gpu_util={0: 80, 1: 80},
        run_gpu_memory={0: GIB, 1: GIB},
        dataset_samples=5,
        dataset_tokens=10_240,
        config_params=1_100_000_000,
    )
    rows = {r.what: r for r in claims_report(o)}
    assert list(rows) == ["params", "params (model config)", "world size", "GPUs", "dataset samples", "dataset tokens", "tokens/s"]
    assert rows["params"].claimed is None and rows["params"].observed == 1_100_048_384 and rows["params"].ok is None
    assert rows["params (model config)"].ok is True
    assert rows["world size"].observed == 2 and rows["world size"].ok is True
    assert rows["GPUs"].claimed is None and rows["GPUs"].observed == 2 and rows["GPUs"].detail == "GPU 0, GPU 1"
    assert rows["dataset samples"].observed == 5 and rows["dataset tokens"].observed == 10_240
    assert rows["tokens/s"].observed == 1000.0 and rows["tokens/s"].ok is None


def test_dataset_and_throughput_claims() -> None:
    run = make_run(claims=Claims(dataset_samples=1_000_000, note="expect 12k tok/s"))
    run.telemetry.tps_history = [3000.0] * 10  # type: ignore[union-attr]
    rows = {r.what: r for r in claims_report(obs(run, T0, dataset_samples=5))}
    assert rows["dataset samples"].ok is False and rows["dataset samples"].source == "claims"
    assert rows["tokens/s"].claimed == 12_000.0 and rows["tokens/s"].source == "note" and rows["tokens/s"].ok is False


@pytest.mark.parametrize(
    ("text", "gpus", "params", "tps"),
    [
        ("1b-4gpu", 4, 1_000_000_000, None),
        ("llama 1B params on 4 GPUs", 4, 1_000_000_000, None),
        ("qwen2.5-0.5b 8xH100", 8, 500_000_000, None),
        ("gpt2-124m", None, 124_000_000, None),
        ("smoke-30m", None, None, None),  # thirty minutes, as likely as 30M params
        ("llama-1b-10b-tokens", None, 1_000_000_000, None),
        ("h100-80gb", None, None, None),
        ("r-1a2b3c4d", None, None, None),
        ("qwen-7b-distill-1.5b", None, None, None),  # two sizes: no claim
        ("run_4gpus 12k tok/s", 4, None, 12_000.0),
        ("1,248 tokens/s", None, None, 1248.0),
        (None, None, None, None),
    ],
)
def test_parse_claims_is_conservative(text: str | None, gpus: int | None, params: int | None, tps: float | None) -> None:
    c = parse_claims(text)
    assert (c.gpus, c.params, c.tokens_per_s) == (gpus, params, tps)


# ----------------------------------------------------------------------------- observe() and bookkeeping


def test_observe_maps_ranks_gpus_and_the_model_config() -> None:
    run = make_run(world_size=2)
    run.telemetry.ranks = {  # type: ignore[union-attr]
        "0": RankTelemetry(rank=0, pid=100, last_seen=T0),  # started without torchrun: the leader is rank 0
        "1": RankTelemetry(rank=1, pid=201, last_seen=T0),
    }
    run.members = [
        Member(pid=99, create_time=1.0, role="shim"),
        Member(pid=100, create_time=2.0, role="leader"),
        Member(pid=200, create_time=3.0, rank=1),
        Member(pid=201, create_time=4.0, rank=1),  # the manifest names this one; 200 is older
        Member(pid=300, create_time=5.0, rank=2),  # dead
        Member(pid=301, create_time=6.0, rank=3),  # DataLoader worker of rank 3 ...
        Member(pid=302, create_time=5.5, rank=3),  # ... and rank 3 itself (older)
    ]
    run.preflight = PreflightResult(ok=True, estimate=MemoryEstimate(per_gpu_bytes=1, params=42))
    gpus = gpus_with({0: 100, 2: 201}, "other")  # attributed by pid even without run_id
    gpus[1].processes = [GpuProcess(pid=999, gpu=1, used_bytes=5, attribution="RUN", run_id=run.id)]
    o = observe(run, T0, gpus, lambda m: m.pid != 300, stopping=True)
    assert o.live_ranks == {0: 100, 1: 201, 3: 302}
    assert o.run_gpu_memory == {0: 30 * GIB, 1: 5, 2: 30 * GIB}
    assert o.gpu_util == {0: 90, 1: 90, 2: 90, 3: 90} and o.gpu_uuids[3] == "GPU-3"
    assert o.stopping and o.config_params == 42


def test_close_clears_everything_and_wrong_run_is_refused() -> None:
    run = make_run()
    h = RunHealth(run.id)
    h.update(obs(run, T0))
    h.update(obs(run, T0 + 5, {0: 4410}, exited_ranks={1: (4411, -9)}))
    closed = h.close(T0 + 6)
    assert kinds(closed) == [("rank_exited", 1, None)] and closed[0].cleared == T0 + 6
    assert h.active == [] and h.cleared_since_last() == [] and len(h.history) == 1
    with pytest.raises(ValueError, match="one RunHealth per run"):
        h.update(obs(make_run().__class__(id="r-other", host="h", state="running", spec=run.spec), T0))
