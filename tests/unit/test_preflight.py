"""agents/safety/preflight.py: every check over hand-built GPUs, runs, sockets and checkpoint folders."""

from __future__ import annotations

import socket
from pathlib import Path

from gpudeck.agents.safety.estimate import GIB, estimate
from gpudeck.agents.safety.preflight import CHECK_NAMES, free_bytes_at, port_is_free, run_preflight
from gpudeck.agents.wire.protocol import Gpu, GpuProcess, LaunchSpec, MemoryEstimate, PreflightCheck, PreflightResult, RunInfo
from gpudeck.console.present.formats import format_preflight
from gpudeck.trainers.checkpoint_trust import write_manifest

NOW = 1_800_000_000.0
HOST = "gpu1"


def gpu(index: int, used_gib: float = 0.0, total_gib: float = 80.0, procs: list[GpuProcess] | None = None) -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-{index:04d}",
        name="NVIDIA H200",
        memory_used=int(used_gib * GIB),
        memory_total=int(total_gib * GIB),
        processes=procs or [],
    )


def proc(
    pid: int,
    on: int,
    gib: float | None,
    attribution: str = "FOREIGN",
    run_id: str | None = None,
    user: str | None = "alice",
    cmdline: list[str] | None = None,
) -> GpuProcess:
    return GpuProcess(
        pid=pid,
        gpu=on,
        used_bytes=None if gib is None else int(gib * GIB),
        attribution=attribution,  # type: ignore[arg-type]
        run_id=run_id,
        user=user,
        cmdline=cmdline or ["python", "train.py", "--lr", "3e-4"],
    )


def ended_run(run_id: str, hours_ago: float, cause: str) -> RunInfo:
    return RunInfo(
        id=run_id,
        host=HOST,
        state="failed",
        spec=LaunchSpec(argv=["python", "-m", "gpudeck.trainers.fsdp_lm"]),
        cause=cause,
        started=NOW - hours_ago * 3600 - 600,
        ended=NOW - hours_ago * 3600,
    )


def preflight(
    spec: LaunchSpec,
    gpus: list[Gpu] | None = None,
    *,
    ended: dict[str, RunInfo] | None = None,
    est: MemoryEstimate | None = None,
    python_check=None,
    port_free=lambda port: True,
    disk_free=lambda path: 10**15,
    gpu_error: str | None = None,
    estimate_error: str | None = None,
) -> PreflightResult:
    return run_preflight(
        spec,
        host=HOST,
        gpus=[gpu(i) for i in range(4)] if gpus is None else gpus,
        gpu_error=gpu_error,
        ended=ended or {},
        estimate=est,
        python_check=python_check,
        port_free=port_free,
        disk_free=disk_free,
        estimate_error=estimate_error,
        now=NOW,
    )


def check(result: PreflightResult, name: str) -> PreflightCheck:
    return next(c for c in result.checks if c.name == name)


def need(gib: float) -> MemoryEstimate:
    return MemoryEstimate(per_gpu_bytes=int(gib * GIB), method="given with --need-gib")


STALE_HOST = [
    gpu(0),
    gpu(1),
    gpu(2),
    gpu(
        3,
        used_gib=78,
        procs=[
            proc(
                4412,
                3,
                78.0,
                "STALE",
                run_id="r-7f3a",
                user="alice",
                cmdline=["/venv/bin/python", "-m", "gpudeck.trainers.fsdp_lm", "--model-config", "llama-1b"],
            )
        ],
    ),
]
STALE_ENDED = {"r-7f3a": ended_run("r-7f3a", 2, "killed by SIGKILL")}


def test_every_check_is_reported_once_in_order() -> None:
    r = preflight(LaunchSpec(argv=["python", "x.py"], gpus=[0]))
    assert [c.name for c in r.checks] == list(CHECK_NAMES)
    assert r.ok and not r.forced and r.host == HOST


def test_stale_holder_of_an_ended_run_blocks_and_is_named() -> None:
    r = preflight(LaunchSpec(argv=["python", "x.py"], gpus=[3], need_gib=60), STALE_HOST, ended=STALE_ENDED, est=need(60))
    assert not r.ok
    holders = check(r, "gpu_holders")
    assert not holders.ok and not holders.overridden
    for text in (
        "pid 4412",
        "alice",
        "78.0 GiB",
        "run r-7f3a",
        "ended 2 h ago",
        "killed by SIGKILL",
        "/venv/bin/python -m gpudeck.trainers.fsdp_lm --model-config llama-1b",
        "`gpudeck reclaim gpu1:4412`",
        "--force",
    ):
        assert text in holders.message, text
    assert holders.details["holders"][0]["run_ended"] == NOW - 7200
    memory = check(r, "gpu_memory")
    assert not memory.ok
    # STYLE.md's message: free, need, the holder and its run, the reclaim command, and other GPUs with room
    for text in (
        "GPU 3 has 2.0 GiB free, the run needs 60.0 GiB",
        "pid 4412",
        "r-7f3a",
        "ended 2 h ago",
        "holds 78.0 GiB",
        "`gpudeck reclaim gpu1:4412`",
        "--gpus 0,1,2",
    ):
        assert text in memory.message, text


def test_force_overrides_only_the_holder_check() -> None:
    spec = LaunchSpec(argv=["python", "x.py"], gpus=[3], need_gib=60, force=True)
    r = preflight(spec, STALE_HOST, ended=STALE_ENDED, est=need(60))
    holders = check(r, "gpu_holders")
    assert holders.overridden and not holders.ok and "overridden with --force" in holders.message
    assert r.forced
    assert not check(r, "gpu_memory").ok and not check(r, "gpu_memory").overridden
    assert not r.ok  # the memory shortage still fails
    # enough memory: force lets it through, and says so
    r = preflight(LaunchSpec(argv=["python", "x.py"], gpus=[3], need_gib=1, force=True), STALE_HOST, ended=STALE_ENDED, est=need(1))
    assert r.ok and r.forced
    assert "forced" in format_preflight(r)
    # force never overrides anything else: a missing GPU still fails
    r = preflight(LaunchSpec(argv=["python", "x.py"], gpus=[7], force=True))
    assert not r.ok and not check(r, "gpus_exist").overridden


def test_foreign_and_invisible_holders_and_live_runs() -> None:
    gpus = [
        gpu(
            0,
            used_gib=20,
            procs=[
                proc(991, 0, 3.2, "FOREIGN", user="bob"),
                proc(77, 0, None, "NO_SUCH_PROCESS", user=None),
                proc(500, 0, 16, "RUN", run_id="r-live"),
            ],
        )
    ]
    r = preflight(LaunchSpec(argv=["python", "x.py"]), gpus)
    holders = check(r, "gpu_holders")
    assert not holders.ok
    assert "pid 991 (bob, not a gpudeck run) holds 3.2 GiB" in holders.message and "ask bob" in holders.message
    assert (
        "pid 77" in holders.message and "another container or PID namespace" in holders.message and "an unknown amount" in holders.message
    )
    assert "500" not in holders.message  # a member of a live run is not a stray holder
    only_live = [gpu(0, used_gib=16, procs=[proc(500, 0, 16, "RUN", run_id="r-live")])]
    ok = check(preflight(LaunchSpec(argv=["python", "x.py"], gpus=[0]), only_live), "gpu_holders")
    assert ok.ok and "r-live" in ok.message


def test_holders_are_looked_for_on_every_gpu_without_gpus_and_only_on_the_given_ones_with() -> None:
    assert not check(preflight(LaunchSpec(argv=["python", "x.py"]), STALE_HOST, ended=STALE_ENDED), "gpu_holders").ok
    assert check(preflight(LaunchSpec(argv=["python", "x.py"], gpus=[0, 1]), STALE_HOST, ended=STALE_ENDED), "gpu_holders").ok
    env = LaunchSpec(argv=["python", "x.py"], env={"CUDA_VISIBLE_DEVICES": "GPU-0003"})
    assert not check(preflight(env, STALE_HOST, ended=STALE_ENDED), "gpu_holders").ok


def test_missing_gpu_index_and_no_gpus_at_all() -> None:
    r = preflight(LaunchSpec(argv=["python", "x.py"], gpus=[0, 5]))
    c = check(r, "gpus_exist")
    assert not r.ok and not c.ok
    assert "GPU 5 does not exist on gpu1" in c.message and "4 GPUs (0,1,2,3)" in c.message and "--gpus" in c.message
    r = preflight(LaunchSpec(argv=["python", "x.py"], gpus=[0]), [], gpu_error="NVML: driver not loaded")
    c = check(r, "gpus_exist")
    assert not c.ok and "NVML: driver not loaded" in c.message
    assert preflight(LaunchSpec(argv=["python", "x.py"]), [], gpu_error="no NVML").ok


def test_memory_check_passes_skips_and_uses_the_estimate() -> None:
    gpus = [gpu(0, used_gib=10), gpu(1, used_gib=70)]
    spec = LaunchSpec(argv=["python", "x.py"], gpus=[0])
    ok = check(preflight(spec, gpus, est=need(60)), "gpu_memory")
    assert ok.ok and "70.0 GiB" in ok.message
    short = check(preflight(LaunchSpec(argv=["python", "x.py"], gpus=[0, 1]), gpus, est=need(60)), "gpu_memory")
    assert not short.ok and "GPU 1 has 10.0 GiB free" in short.message and "GPU 0" not in short.message.split(".")[0]
    skipped = check(preflight(spec, gpus), "gpu_memory")
    assert skipped.ok and skipped.details["skipped"] and "--need-gib" in skipped.message
    why = check(preflight(spec, gpus, estimate_error="model_type 'gpt2' is not known; give --need-gib"), "gpu_memory")
    assert why.ok and "gpt2" in why.message
    # a trainer without --gpus: its one process uses cuda:0, so only GPU 0 needs the room
    trainer = LaunchSpec(kind="fsdp", argv=["python", "-m", "gpudeck.trainers.fsdp_lm", "--fresh", "--out", "o"])
    assert check(preflight(trainer, gpus, est=need(60)), "gpu_memory").ok
    torchrun2 = LaunchSpec(
        kind="fsdp", argv=["torchrun", "--nproc-per-node", "2", "-m", "gpudeck.trainers.fsdp_lm", "--fresh", "--out", "o"]
    )
    assert not check(preflight(torchrun2, gpus, est=need(60)), "gpu_memory").ok


def test_rdzv_port_held_by_a_real_socket_fails() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        assert not port_is_free(port)
        spec = LaunchSpec(
            kind="fsdp",
            argv=["torchrun", "--nproc-per-node", "2", f"--master-port={port}", "-m", "gpudeck.trainers.fsdp_lm", "--fresh", "--out", "o"],
        )
        r = run_preflight(spec, host=HOST, gpus=[], gpu_error=None, ended={}, estimate=None, python_check=None)
        c = check(r, "rdzv_port")
        assert not r.ok and not c.ok and f"port {port}" in c.message and "--master-port" in c.message
        r = run_preflight(
            LaunchSpec(argv=["python", "x.py"], rdzv_port=port),
            host=HOST,
            gpus=[],
            gpu_error=None,
            ended={},
            estimate=None,
            python_check=None,
        )
        assert not check(r, "rdzv_port").ok
    finally:
        s.close()
    assert port_is_free(port)


def test_rdzv_port_which_port_or_none() -> None:
    asked: list[int] = []

    def free(port: int) -> bool:
        asked.append(port)
        return True

    def run(argv: list[str], **kw) -> PreflightCheck:
        return check(
            preflight(
                LaunchSpec(kind="fsdp", argv=argv + ["-m", "gpudeck.trainers.fsdp_lm", "--fresh", "--out", "o"], **kw), port_free=free
            ),
            "rdzv_port",
        )

    assert run(["torchrun", "--nproc-per-node", "2"]).ok and asked[-1] == 29500  # torchrun's default --master-port
    assert run(["torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29611"]).ok and asked[-1] == 29611
    n = len(asked)
    standalone = run(["torchrun", "--standalone", "--nproc-per-node", "2"])
    assert standalone.details.get("skipped") and "--standalone" in standalone.message
    assert run(["torchrun", "--node-rank", "1", "--master-port", "29700"]).details.get("skipped")
    assert run(["python"]).details.get("skipped")
    assert len(asked) == n


def test_checkpoint_room(tmp_path: Path) -> None:
    spec = LaunchSpec(kind="fsdp", argv=["python", "-m", "gpudeck.trainers.fsdp_lm", "--fresh", "--out", str(tmp_path / "out")])
    est = MemoryEstimate(per_gpu_bytes=GIB, params=1_000_000_000)
    seen: list[Path] = []

    def small(path: Path) -> int:
        seen.append(path)
        return 5 * GIB

    c = check(preflight(spec, est=est, disk_free=small), "checkpoint_room")
    assert not c.ok and "5.0 GiB free" in c.message and "1,000,000,000 params" in c.message and "12 B/param" in c.message
    assert seen == [tmp_path / "out" / "checkpoints"]
    assert check(preflight(spec, est=est, disk_free=lambda p: 20 * GIB), "checkpoint_room").ok
    assert check(preflight(spec, est=need(10)), "checkpoint_room").details.get("skipped")  # no parameter count
    assert free_bytes_at(tmp_path / "not" / "yet" / "made") > 0  # measured at the nearest parent that exists


def make_checkpoint(out: Path, step: int, complete: bool = True) -> None:
    d = out / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    (d / "__0_0.distcp").write_bytes(b"x")
    if complete:
        write_manifest(d, {"step": step})


def trainer(out: Path, *start: str) -> LaunchSpec:
    return LaunchSpec(kind="fsdp", argv=["python", "-m", "gpudeck.trainers.fsdp_lm", "--model-config", "tiny", *start, "--out", str(out)])


def test_resume_n_needs_that_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = preflight(trainer(out, "--resume", "10"))
    c = check(r, "resume_checkpoint")
    assert not r.ok and not c.ok and "step_10 does not exist" in c.message and "none" in c.message and "fresh" in c.message
    make_checkpoint(out, 10)
    make_checkpoint(out, 20, complete=False)
    r = preflight(trainer(out, "--resume", "10"))
    assert r.ok and check(r, "resume_checkpoint").ok
    c = check(preflight(trainer(out, "--resume", "20")), "resume_checkpoint")
    assert not c.ok and "step_20 is incomplete" in c.message and "step_10" in c.message and "resume at step 10" in c.message
    c = check(preflight(trainer(out, "--resume", "30")), "resume_checkpoint")
    assert not c.ok and "step_30 does not exist" in c.message and "complete checkpoints there: step_10" in c.message
    latest = check(preflight(trainer(out, "--resume", "latest")), "resume_checkpoint")
    assert latest.ok and "step_10" in latest.message
    # the spec's start names the step; the folder can come from checkpoint_dir
    spec = LaunchSpec(argv=["python", "x.py"], start="resume 10", checkpoint_dir=str(out))
    assert check(preflight(spec), "resume_checkpoint").ok


def test_resume_refuses_a_checkpoint_the_trainer_would_refuse(tmp_path: Path) -> None:
    """The trainers' trust check runs before the launch: a replaced .metadata, a folder others can write, no digests."""
    out = tmp_path / "out"
    make_checkpoint(out, 10)
    meta = out / "checkpoints" / "step_10" / ".metadata"
    meta.write_bytes(b"a pickle put here by someone else")
    r = preflight(trainer(out, "--resume", "latest"))
    c = check(r, "resume_checkpoint")
    assert not r.ok and not c.ok and f"{meta} is not the file this checkpoint saved" in c.message
    assert c.details["refused"] == str(meta)
    meta.write_bytes(b"x")
    assert "digests verified" in check(preflight(trainer(out, "--resume", "10")), "resume_checkpoint").message
    (out / "checkpoints").chmod(0o777)
    c = check(preflight(trainer(out, "--resume", "10")), "resume_checkpoint")
    assert not c.ok and "writable by group" in c.message and "--trust-checkpoint" in c.message
    c = check(preflight(trainer(out, "--resume", "10", "--trust-checkpoint")), "resume_checkpoint")
    assert c.ok and "foreign, loaded by --trust-checkpoint" in c.message and c.details["checkpoint_trusted_by_flag"]


def test_resume_latest_needs_at_least_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    make_checkpoint(out, 5, complete=False)
    c = check(preflight(trainer(out, "--resume", "latest")), "resume_checkpoint")
    assert not c.ok and "no complete checkpoint" in c.message and "step_5" in c.message


def test_a_trainer_run_needs_an_explicit_start(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = preflight(trainer(out))
    c = check(r, "start_explicit")
    assert not r.ok and not c.ok and "no default" in c.message and "fresh" in c.message and "resume at step N" in c.message
    assert check(preflight(trainer(out, "--fresh")), "start_explicit").ok
    spec = LaunchSpec(kind="fsdp", argv=trainer(out).argv, start="fresh")
    assert check(preflight(spec), "start_explicit").ok
    clash = LaunchSpec(kind="fsdp", argv=trainer(out, "--resume", "4").argv, start="fresh")
    c = check(preflight(clash), "start_explicit")
    assert not c.ok and "'fresh'" in c.message and "'resume 4'" in c.message
    # fresh into a folder that holds checkpoints would be refused by the trainer: say it first
    make_checkpoint(out, 40)
    c = check(preflight(trainer(out, "--fresh")), "start_explicit")
    assert not c.ok and "step_40" in c.message and "--new-run-dir" in c.message and "resume at step 40" in c.message
    assert check(preflight(trainer(out, "--fresh", "--new-run-dir")), "start_explicit").ok
    # a plain command needs none
    assert check(preflight(LaunchSpec(argv=["python", "x.py"])), "start_explicit").details.get("skipped")


def test_python_check_is_called_with_the_run_python(tmp_path: Path) -> None:
    calls: list[str] = []

    def no_torch(python: str) -> tuple[bool, str]:
        calls.append(python)
        return False, "import torch failed: No module named 'torch'; install torch into that environment"

    spec = LaunchSpec(kind="fsdp", argv=["/envs/a/bin/python", "-m", "gpudeck.trainers.fsdp_lm", "--fresh", "--out", "o"])
    r = preflight(spec, python_check=no_torch)
    c = check(r, "python_env")
    assert not r.ok and not c.ok and calls == ["/envs/a/bin/python"] and "No module named 'torch'" in c.message
    ok = check(
        preflight(
            LaunchSpec(kind="fsdp", argv=spec.argv, python="/envs/b/bin/python"),
            python_check=lambda py: (True, f"torch 2.13 imports ({py})"),
        ),
        "python_env",
    )
    assert ok.ok and "/envs/b/bin/python" in ok.message
    # torchrun: the interpreter of its shebang
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "torchrun").write_text(f"#!{bin_dir / 'python3'}\nimport sys\n")
    calls.clear()
    spec = LaunchSpec(
        kind="dflash", argv=[str(bin_dir / "torchrun"), "--nproc-per-node", "2", "-m", "gpudeck.trainers.dflash", "--fresh", "--out", "o"]
    )
    preflight(spec, python_check=no_torch)
    assert calls == [str(bin_dir / "python3")]
    # a plain command is not python-checked unless it names its python
    calls.clear()
    assert check(preflight(LaunchSpec(argv=["bash", "run.sh"]), python_check=no_torch), "python_env").details.get("skipped")
    assert calls == []
    unknown = check(preflight(LaunchSpec(kind="fsdp", argv=["bash", "run.sh"]), python_check=no_torch), "python_env")
    assert not unknown.ok and "--python" in unknown.message


def test_a_real_fsdp_estimate_flows_through(tmp_path: Path) -> None:
    spec = LaunchSpec(
        kind="fsdp",
        gpus=[0, 1],
        argv=[
            "torchrun",
            "--nproc-per-node",
            "2",
            "-m",
            "gpudeck.trainers.fsdp_lm",
            "--model-config",
            "llama-1b",
            "--batch-size",
            "8",
            "--seq-len",
            "2048",
            "--fresh",
            "--out",
            str(tmp_path),
        ],
    )
    est = estimate(spec)
    assert est is not None
    r = preflight(spec, [gpu(0, used_gib=0, total_gib=140), gpu(1, used_gib=120, total_gib=140)], est=est)
    c = check(r, "gpu_memory")
    assert not c.ok and "GPU 1 has 20.0 GiB free" in c.message and "estimated" in c.message and "--batch-size" in c.message
    text = format_preflight(r)
    assert text.splitlines()[0].startswith("pre-flight on gpu1: FAILED")
    assert "✗" in text and "✓" in text and "llama-1b preset" in text
    assert check(r, "checkpoint_room").ok and "1,100,048,384 params" in check(r, "checkpoint_room").message


def test_every_failure_says_what_to_do(tmp_path: Path) -> None:
    """Each failing check's message carries a fix (a command, a flag or an action), not only the problem."""
    out = tmp_path / "o"
    spec = LaunchSpec(
        kind="fsdp", gpus=[3, 9], rdzv_port=1, argv=["bash", "-m", "gpudeck.trainers.fsdp_lm", "--resume", "3", "--out", str(out)]
    )
    r = preflight(
        spec,
        STALE_HOST,
        ended=STALE_ENDED,
        est=MemoryEstimate(per_gpu_bytes=100 * GIB, params=10**10, method="x"),
        port_free=lambda p: False,
        disk_free=lambda p: 0,
        python_check=lambda p: (False, "no"),
    )
    failed = [c for c in r.checks if not c.ok]
    assert {c.name for c in failed} == {
        "gpus_exist",
        "gpu_memory",
        "gpu_holders",
        "rdzv_port",
        "checkpoint_room",
        "python_env",
        "resume_checkpoint",
    }
    for c in failed:
        assert any(w in c.message for w in ("--", "`", "pick", "free space", "give", "start")), (c.name, c.message)


def test_the_checkpoint_layout_matches_trainers_checkpoint(tmp_path: Path) -> None:
    """agents may not import gpudeck.trainers.common.checkpoint, so pre-flight restates its layout; this keeps them equal."""
    from gpudeck.agents.safety import preflight as pf
    from gpudeck.trainers.common import checkpoint as ckpt

    assert (pf.CHECKPOINTS_DIRNAME, pf.CHECKPOINT_MARKER) == (ckpt.CHECKPOINTS_DIRNAME, ckpt.MARKER_FILE)
    out = tmp_path / "out"
    for step, complete in ((3, True), (7, False), (12, True)):
        make_checkpoint(out, step, complete)
    (out / "checkpoints" / "step_x").mkdir()
    (out / "checkpoints" / "step_20").mkdir()  # neither file
    complete, incomplete = pf._scan_checkpoints(out / "checkpoints")
    assert complete == ckpt.list_checkpoints(out) == [3, 12]
    assert incomplete == [7, 20]
