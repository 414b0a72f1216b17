"""GPU tests of ``python -m gpudeck.trainers.fsdp_lm`` (run on the accelerator; skipped without CUDA).

Run there with::

    python3 -m pytest --noconftest -p no:cacheprovider tests/gpu/test_fsdp_lm_gpu.py -v

The resume test is the one the issue asks for: train, checkpoint at step N,
``kill -9`` the process a few steps later, resume from step N, and check that
the resumed steps give the same losses as the killed run gave for those steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# GPUDECK_GPU_TEST_ON_CPU=1 runs the same flow on CPU (a dry run of the test's logic)
ON_CPU = os.environ.get("GPUDECK_GPU_TEST_ON_CPU") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs an NVIDIA GPU (torch.cuda)"),
]

ROOT = Path(__file__).resolve().parents[2]

# a ~40M-parameter Llama: big enough to exercise bf16 mixed precision and flash
# attention, small enough that a step takes tens of milliseconds
CONFIG = dict(
    model_type="llama",
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=320,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return out


def _losses(recs: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in recs if r["type"] == "step"}


def _start(args: list[str], tel: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, GPUDECK_TELEMETRY=str(tel), PYTHONUNBUFFERED="1")
    env.pop("GPUDECK_TEST_FAIL_AT_STEP", None)
    return subprocess.Popen(
        [sys.executable, "-m", "gpudeck.trainers.fsdp_lm", *args],
        cwd=ROOT,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _check_gpu_telemetry(tel: Path, manifest: dict) -> None:
    assert manifest["device"].startswith("cuda:") and manifest["dtype"] == "bfloat16"
    assert manifest["gpu_uuid"] and manifest["gpu_uuid"].startswith("GPU-")
    steps = [r for r in _records(tel) if r["type"] == "step"]
    assert all(r["mem_peak_gib"] > 0 for r in steps)
    if manifest["peak_flops"]:  # known GPU (H100/H200): MFU is reported
        assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in steps)
    _check_compute_split(manifest, steps)


def _check_compute_split(manifest: dict, steps: list[dict]) -> None:
    """compute_s/wait_s from CUDA events: step N's record carries step N-1's, and they fit in that step's time."""
    assert manifest["compute_timing"].startswith("CUDA events"), manifest["compute_timing"]
    by_step = {r["step"]: r for r in steps}
    timed = [r for r in steps if "compute_s" in r]
    assert timed and len(timed) >= (len(steps) - 1) // 4, steps  # one step in four is timed on CUDA
    for r in timed:
        assert r["timed_step"] == r["step"] - 1 and r["compute_s"] > 0 and r["wait_s"] >= 0 and r["stalls"] >= 2, r
        own = by_step.get(r["timed_step"])
        if own is not None:
            wall = own.get("step_time_s") or own.get("step_s")
            assert r["compute_s"] + r["wait_s"] <= wall * 1.05 + 0.002, (r, own)
    print(
        "compute_s/wait_s/step time:",
        [(r["compute_s"], r["wait_s"], by_step.get(r["timed_step"], {}).get("step_time_s")) for r in timed[:6]],
    )


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:  # stop by pid, never by name
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def test_gpu_kill9_then_resume_gives_identical_losses(tmp_path, procs) -> None:
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps(CONFIG))
    out = tmp_path / "run"
    common = [
        "--model-config",
        str(cfg),
        "--seq-len",
        "512",
        "--batch-size",
        "8",
        "--max-steps",
        "400",
        "--checkpoint-every",
        "5",
        "--keep",
        "1000",
        "--corpus-bytes",
        str(4 * 1024 * 1024),
        "--deterministic",
        "--no-export",
        # eager attention: PyTorch's flash-attention backward is not deterministic
        "--attn-implementation",
        "eager",
        "--out",
        str(out),
    ] + (["--device", "cpu"] if ON_CPU else [])
    tel1 = tmp_path / "first.jsonl"
    p = _start([*common, "--fresh"], tel1, tmp_path / "first.log")
    procs.append(p)
    deadline = time.monotonic() + 240
    killed_after = None
    while time.monotonic() < deadline and p.poll() is None:
        recs = _records(tel1)
        ckpt5 = any(r["type"] == "checkpoint" and r["step"] == 5 for r in recs)
        last = max(_losses(recs), default=0)
        if ckpt5 and last >= 9:
            os.kill(p.pid, signal.SIGKILL)  # kill -9, no chance to clean up
            p.wait(timeout=30)
            killed_after = last
            break
        time.sleep(0.02)
    assert killed_after is not None, (tmp_path / "first.log").read_text()[-3000:]
    assert p.returncode == -signal.SIGKILL
    first = _losses(_records(tel1))
    manifest = next(r for r in _records(tel1) if r["type"] == "manifest")
    if not ON_CPU:
        _check_gpu_telemetry(tel1, manifest)

    stop_at = max(first)
    tel2 = tmp_path / "resumed.jsonl"
    p2 = _start([*common, "--resume", "5", "--stop-at-step", str(stop_at)], tel2, tmp_path / "resumed.log")
    procs.append(p2)
    p2.wait(timeout=300)
    assert p2.returncode == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    resumed = _losses(_records(tel2))
    assert sorted(resumed) == list(range(6, stop_at + 1))
    diffs = {k: abs(resumed[k] - first[k]) for k in resumed}
    print(
        f"GPU resume check: killed after step {killed_after}; resumed steps 6..{stop_at}; "
        f"max |loss diff| = {max(diffs.values()):.3g}; " + ", ".join(f"{k}: {first[k]:.6f}/{resumed[k]:.6f}" for k in sorted(resumed))
    )
    assert max(diffs.values()) <= 1e-6, diffs
    assert {r["start"] for r in _records(tel2) if r["type"] == "manifest"} == {"resume 5"}


def _run(args: list[str], tmp_path: Path, name: str, procs) -> tuple[list[dict], str]:
    tel, log = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.log"
    p = _start(args, tel, log)
    procs.append(p)
    p.wait(timeout=400)
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    return _records(tel), text


def test_gpu_prepared_corpus_validation_chunked_loss_mfu_and_profile(tmp_path, procs) -> None:
    """prepare -> train on the GPU from the token file with val_loss; --loss-impl chunked gives the
    plain losses (bf16: close, not equal); mfu (causal) / mfu_torchtitan is the FLOP ratio; the
    profile names the kernels."""
    from gpudeck.trainers.common.prepare import main as prepare_main

    prep = tmp_path / "prep"
    assert prepare_main(["--corpus-bytes", str(4 * 1024 * 1024), "--out", str(prep), "--val-fraction", "0.02", "--num-proc", "4"]) == 0
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps(CONFIG))
    shape = ["--seq-len", "64", "--batch-size", "2"] if ON_CPU else ["--seq-len", "512", "--batch-size", "8"]
    common = [
        "--model-config",
        "tiny" if ON_CPU else str(cfg),
        "--data",
        str(prep),
        *shape,
        "--max-steps",
        "12",
        "--val-every",
        "4",
        "--no-export",
        "--no-final-checkpoint",
        "--fresh",
    ] + (["--device", "cpu"] if ON_CPU else ["--compile"])
    plain, _ = _run([*common, "--out", str(tmp_path / "plain"), "--profile-steps", "2", "--profile-start", "8"], tmp_path, "plain", procs)
    log = (tmp_path / "plain.log").read_text()
    profile = [ln for ln in log.splitlines() if ln.startswith("profile")]
    print("\n".join(profile))
    assert profile and profile[0].startswith("profile: steps 8..9")
    chunked, _ = _run([*common, "--out", str(tmp_path / "chunked"), "--loss-impl", "chunked"], tmp_path, "chunked", procs)
    lp, lc = _losses(plain), _losses(chunked)
    print("plain vs chunked:", {k: (round(lp[k], 4), round(lc[k], 4)) for k in lp})
    assert sorted(lc) == list(range(1, 13))
    assert all(abs(lp[k] - lc[k]) < 0.05 for k in lp), (lp, lc)
    vals = [r for r in plain if r["type"] == "val_loss"]
    assert sorted(r["step"] for r in vals) == [4, 8, 12] and all(r["val_loss"] > 0 for r in vals)
    manifest = next(r for r in plain if r["type"] == "manifest")
    assert manifest["dataset_prepared"] and manifest["mfu_convention"].startswith("causal")
    if manifest["peak_flops"] and not ON_CPU:
        ratio = manifest["flops_per_token"] / manifest["flops_per_token_torchtitan"]
        for r in (r for r in plain if r["type"] == "step"):
            # both are rounded in the record (a tiny model's mfu is ~5e-05: 5 decimals are all it keeps)
            assert r["mfu"] == pytest.approx(r["mfu_torchtitan"] * ratio, rel=1e-3, abs=1e-5)


# One rank of NCCL (the accelerator has one GPU) with the trainers' own Flight Recorder set-up and dump thread: fsdp_lm
# itself issues no NCCL collective at world size 1 (FSDP2 skips the all-gather, the trainer its loss all-reduce), so the
# dump of a one-GPU fsdp_lm run is empty; this process runs real all_reduces and then waits as a rank stuck would.
NCCL_RANK = """
import os, sys, time
import torch, torch.distributed as dist
from gpudeck.trainers.common.diagnostics import enable_flight_recorder, install_flight_recorder_dump
enable_flight_recorder()
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
man = install_flight_recorder_dump(0)
x = torch.ones(1 << 20, device="cuda")
for _ in range(7):
    dist.all_reduce(x)
torch.cuda.synchronize()
print("ready", man, flush=True)
time.sleep(600)
"""


def test_gpu_flight_recorder_dump_on_request_is_summarised(tmp_path, procs) -> None:
    """NCCL: the rank's thread answers the agent's request file with JSON that the agent's summary reads."""
    from gpudeck.agents.health import flight_recorder as fr

    tel, log = tmp_path / "fr.jsonl", tmp_path / "fr.log"
    env = dict(os.environ, GPUDECK_TELEMETRY=str(tel), PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        [sys.executable, "-c", NCCL_RANK], cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    procs.append(p)
    deadline = time.time() + 180
    while time.time() < deadline and "ready" not in log.read_text():
        assert p.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    assert "'flight_recorder': 'request_file'" in log.read_text(), log.read_text()[-2000:]
    nonce = fr.request(str(tmp_path))
    assert nonce is not None
    dumps = fr.collect(str(tmp_path), [(0, p.pid)], nonce, wait_s=10.0)
    assert isinstance(dumps.get(0), fr.FrDump), (dumps, log.read_text()[-2000:])
    d = dumps[0]
    print(
        "flight recorder: version",
        d.version,
        len(d.entries),
        "entries; last",
        [(e.collective_seq_id, e.profiling_name, e.state, e.retired) for e in d.entries[-3:]],
    )
    line = fr.summarise(dumps, [0])
    print(line)
    nccl = [e for e in d.entries if e.profiling_name.startswith("nccl:all_reduce")]
    assert not d.error and len(nccl) == 7 and all(e.state == "completed" for e in nccl), d
    assert line.startswith("Flight Recorder (") and "rank 0 " in line and "7" in line, line
    assert p.poll() is None  # the dump left the rank running


def test_gpu_compute_split_is_reported_on_cuda(tmp_path, procs) -> None:
    """fsdp_lm on the GPU reports compute_s/wait_s from CUDA events (a step late, with the method in the manifest)."""
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps(CONFIG))
    tel, log = tmp_path / "cs.jsonl", tmp_path / "cs.log"
    args = ["--model-config", str(cfg), "--seq-len", "256", "--batch-size", "4", "--max-steps", "8", "--fresh"]
    args += ["--out", str(tmp_path / "out"), "--no-export", "--no-final-checkpoint", "--checkpoint-every", "100000"]
    args += ["--corpus-bytes", "400000"]
    p = _start(args, tel, log)
    procs.append(p)
    assert p.wait(timeout=300) == 0, log.read_text()[-3000:]
    manifest = next(r for r in _records(tel) if r["type"] == "manifest")
    _check_compute_split(manifest, [r for r in _records(tel) if r["type"] == "step"])
