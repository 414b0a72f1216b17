"""Benchmarks DFlash drafter training on one GPU: the chunked lm_head + CE, and the whole training step.

Two parts, one result line per figure (``RESULT <name> <value> <unit> [details]``):

``loss``  lm_head + cross-entropy, forward + backward, at the scale production drafters use:
          ``--rows`` positions (default 1024 anchors x block 32 = 32,768), hidden 1024, vocab
          151,936, bf16, lm_head frozen (as in DFlash; ``--weight-grad`` also measures with a
          trainable lm_head). Compares the plain version (full logits, fp32 CE) with
          ``gpudeck.trainers.dflash.loss.chunked_linear_cross_entropy`` in ``fused`` mode (gradient
          computed in the forward pass, chunk by chunk) and ``recompute`` mode (checkpointed
          chunks). Extra memory = ``torch.cuda.max_memory_allocated`` after minus before (inputs
          and the weight are allocated before); time = median of ``--iters`` CUDA-event-timed runs.

``train`` ``python -m gpudeck.trainers.dflash`` itself, colocated, one GPU, a random-weight
          Qwen3-0.6B-shaped target (``--target-config qwen3-0.6b``), block 16, 512 anchors,
          seq 2048; tokens/s and MFU are read from the trainer's own telemetry (median over the
          steps after ``--skip`` warm-up steps) and cross-checked here from its per-step FLOP
          count and step time.

``seed``  the seed's drafter shape: SpecForge's Qwen3.6-27B drafter config
          (tests/reference/qwen3.6-27b-dflash.json: 4 sliding-window layers, window 2048,
          1 full layer, hidden 5120, intermediate 17408, 32 heads of 128, 8 kv heads) at
          1024 anchors x block 32 (``--gamma 7``), seq 4096, batch 1, flex attention,
          ``--compile``, colocated on one GPU with a random-weight dense Qwen3 target of the
          same width (``--seed-target qwen3-14b``, or ``qwen3-32b``: the largest of them that
          fits one H200). Reports tokens/s, ``mfu`` (causal) and ``mfu_torchtitan``, the peak
          memory and pre-flight's estimate for the same command line (ratio).

``specforge``  SpecForge's Domino/DFlash benchmark shape (docs/benchmarks/domino-disaggregated-performance.md):
          a random-weight Qwen3-8B-shaped target (36 layers, hidden 4096) and SpecForge's
          ``configs/qwen3-8b-dflash.json`` drafter (5 layers, hidden 4096, intermediate 12288;
          tests/reference/qwen3-8b-dflash.json) at the doc's MFU microbenchmark shape: 256 anchors x
          block 16, gamma 7, sequence 768, batch 2 per GPU; colocated on one GPU. Prints samples/s per GPU and MFU for the colocated step
          and for the drafter part alone (the step minus the target's forward, whose time the
          trainer measures; the drafter's own FLOPs from its ``drafter_flops`` record), beside
          SpecForge's per-trainer-GPU figures (50.1 samples/s on 7 trainer GPUs, 43.5% MFU).
          ``--tiny`` runs the same measurement at a tiny shape on CPU (a smoke test).

Run on the accelerator, e.g.::

    python bench/dflash_bench.py --part loss
    python bench/dflash_bench.py --part train --configs sdpa:5:4,flex:5:4 --steps 12
    python bench/dflash_bench.py --part seed --seed-target qwen3-14b --steps 12 --profile
    python bench/dflash_bench.py --part specforge --steps 12
    python bench/dflash_bench.py --part specforge --tiny      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def result(name: str, value, unit: str, **details) -> None:
    extra = " ".join(f"{k}={v}" for k, v in details.items())
    print(f"RESULT {name} {value} {unit} {extra}".rstrip(), flush=True)


# ------------------------------------------------------------------ loss


def bench_loss(args) -> None:
    import torch

    from gpudeck.trainers.dflash.loss import chunked_linear_cross_entropy, plain_linear_cross_entropy

    dev = torch.device("cuda")
    torch.manual_seed(0)
    m, h, v = args.rows, args.hidden, args.vocab
    weight = (torch.randn(v, h, device=dev) * 0.02).to(torch.bfloat16)
    base_hidden = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    labels = torch.randint(0, v, (m,), device=dev)
    w = torch.ones(m, device=dev)

    def run(kind: str, chunk: int, weight_grad: bool):
        weight.requires_grad_(weight_grad)
        weight.grad = None
        hid = base_hidden.clone().requires_grad_(True)
        dl.COMPILE_ON_CUDA = kind != "fused-eager"
        if kind == "plain":
            loss = plain_linear_cross_entropy(hid, weight, labels, w)
        else:
            mode = "fused" if kind.startswith("fused") else kind
            loss = chunked_linear_cross_entropy(hid, weight, labels, w, chunk_rows=chunk, mode=mode)
        loss.backward()
        return loss.detach(), hid.grad

    import gpudeck.trainers.dflash.loss as dl

    configs = [("plain", 0)]
    for c in args.chunks:
        configs.append(("fused", c))
    configs.append(("fused-eager", 2048))
    configs.append(("recompute", 4096))
    ref = {}
    for weight_grad in [False, True] if args.weight_grad else [False]:
        for kind, chunk in configs:
            label = f"{kind}" + (f"-c{chunk}" if chunk else "") + ("-wgrad" if weight_grad else "")
            try:
                run(kind, chunk, weight_grad)  # warm-up
                torch.cuda.synchronize()
                weight.grad = None
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                loss, grad = run(kind, chunk, weight_grad)
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - before) / 2**30
                del grad
                weight.grad = None
                times = []
                for _ in range(args.iters):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    run(kind, chunk, weight_grad)
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e))
                    weight.grad = None
                ms = statistics.median(times)
                if kind == "plain":
                    ref[weight_grad] = (ms, float(loss))
                pms, ploss = ref.get(weight_grad, (None, None))
                result(f"loss.{label}.extra_mem", f"{extra:.2f}", "GiB", rows=m, hidden=h, vocab=v)
                result(
                    f"loss.{label}.time",
                    f"{ms:.1f}",
                    "ms",
                    x_plain=(f"{ms / pms:.2f}" if pms else "n/a"),
                    loss_rel_diff=(f"{abs(float(loss) - ploss) / abs(ploss):.2e}" if ploss else "n/a"),
                )
            except torch.OutOfMemoryError as exc:
                result(f"loss.{label}", "OOM", "-", error=str(exc).split(".")[0])
                torch.cuda.empty_cache()


# ------------------------------------------------------------------ the seed's drafter shape

SEED_DRAFTER = ROOT / "tests" / "reference" / "qwen3.6-27b-dflash.json"
SPECFORGE_DRAFTER = ROOT / "tests" / "reference" / "qwen3-8b-dflash.json"
# SpecForge's Domino/DFlash run on 8xH200 (1 capture GPU + 7 trainer GPUs): per trainer GPU
SPECFORGE_SAMPLES_PER_S = 50.1
SPECFORGE_TRAINER_GPUS = 7
SPECFORGE_MFU = 0.435
SPECFORGE_TFLOP_PER_SAMPLE = 45.0  # forward + backward of the drafter, torch.utils.flop_counter (their convention)
# dense Qwen3 targets of the seed drafter's width (hidden 5120), from their published config.json
SEED_TARGETS = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64),
}


def write_seed_configs(folder: Path, target: str = "qwen3-14b", drafter: Path = SEED_DRAFTER) -> tuple[Path, Path]:
    """(target config.json, drafter config) for the seed's drafter shape on a dense Qwen3 ``target``.

    The drafter config is SpecForge's Qwen3.6-27B one without what belongs to that target
    (vocab_size, num_target_layers, dflash_config: its target layer ids and mask token), so the
    trainer spaces the layer ids over this target and picks its mask token.
    """
    folder.mkdir(parents=True, exist_ok=True)
    tcfg = dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    tcfg.update(SEED_TARGETS[target])
    tpath = folder / f"{target}.json"
    tpath.write_text(json.dumps(tcfg, indent=1))
    dcfg = json.loads(drafter.read_text())
    for key in ("vocab_size", "num_target_layers", "dflash_config", "eos_token_id", "pad_token_id", "bos_token_id"):
        dcfg.pop(key, None)
    dpath = folder / "seed-drafter.json"
    dpath.write_text(json.dumps(dcfg, indent=1))
    return tpath, dpath


def seed_train_argv(folder: Path, target: str, steps: int, out: Path, compile_: bool = True) -> list[str]:
    tpath, dpath = write_seed_configs(folder, target)
    argv = [
        "--target-config",
        str(tpath),
        "--drafter-config",
        str(dpath),
        "--block-size",
        "32",
        "--num-anchors",
        "1024",
        "--gamma",
        "7",
        "--seq-len",
        "4096",
        "--batch-size",
        "1",
        "--attn",
        "flex",
        "--no-eval",
        "--max-steps",
        str(steps),
        "--checkpoint-every",
        "0",
        "--warmup-steps",
        "2",
        "--corpus-bytes",
        str(8 * 1024 * 1024),
        "--loss-chunk-rows",
        "2048",
        "--fresh",
        "--out",
        str(out),
    ]
    return argv + (["--compile"] if compile_ else [])


def run_trainer(cmd: list[str], out: Path, label: str, args) -> tuple[object, list[dict], float]:
    """Run one ``gpudeck.trainers.dflash`` command line with its telemetry in ``out``; (exit code, records, wall s)."""
    tel = out / "telemetry.jsonl"
    env = dict(os.environ, GPUDECK_TELEMETRY=str(tel), PYTHONUNBUFFERED="1")
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    log = (Path(args.log_dir) if args.log_dir else out) / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
        try:
            rc: object = p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = f"timeout after {args.timeout}s"
    text = log.read_text()
    print("\n".join(line for line in text.splitlines() if "Warning" not in line)[-2500:], flush=True)
    recs = [json.loads(x) for x in tel.read_text().splitlines() if x.strip()] if tel.exists() else []
    return rc, recs, time.time() - t0


def bench_seed(args) -> None:
    from gpudeck.agents.safety.estimate import estimate
    from gpudeck.agents.wire.protocol import LaunchSpec

    out = Path(tempfile.mkdtemp(prefix="dflash_seed_"))
    argv = seed_train_argv(out / "configs", args.seed_target, args.steps, out / "run", not args.no_compile)
    if args.profile:
        argv += ["--profile-steps", f"{args.steps - 1}-{args.steps}"]
    label = f"seed.{args.seed_target}" + ("" if args.no_compile else ".compile")
    rc, recs, wall = run_trainer([sys.executable, "-m", "gpudeck.trainers.dflash", *argv], out, label, args)
    steps = [r for r in recs if r["type"] == "step" and r["step"] > args.skip]
    if rc != 0 or not steps:
        result(label, "FAILED", "-", rc=str(rc).replace(" ", "_"), wall_s=f"{wall:.0f}")
        return
    man = next(r for r in recs if r["type"] == "manifest")
    med = {k: statistics.median(r[k] for r in steps) for k in ("tokens_per_s", "mfu", "mfu_torchtitan", "step_s")}
    peak = max(r["mem_peak_gib"] for r in steps)
    est = estimate(LaunchSpec(kind="dflash", argv=["python", "-m", "gpudeck.trainers.dflash", *argv], cwd=str(ROOT)))
    result(
        f"{label}.tokens_per_s",
        f"{med['tokens_per_s']:.0f}",
        "tok/s",
        step_ms=f"{med['step_s'] * 1000:.1f}",
        target_fwd_ms=f"{statistics.median(r['target_forward_s'] for r in steps) * 1000:.1f}",
        steps=len(steps),
        gpu=man.get("gpu_name"),
        target_params=man["target_params_frozen"],
        drafter_params=man["drafter_params_trainable"],
        target_layers_run=man["target_layers_run"],
    )
    result(f"{label}.mfu", f"{med['mfu'] * 100:.1f}", "%", convention="causal", mfu_torchtitan=f"{med['mfu_torchtitan'] * 100:.1f}%")
    prof = out / "run" / "profile" / "rank0.txt"
    if prof.is_file():
        print(prof.read_text()[:6000], flush=True)
    result(
        f"{label}.mem_peak",
        f"{peak:.1f}",
        "GiB",
        estimate=f"{est.per_gpu_bytes / 2**30:.1f}GiB",
        ratio=f"{est.per_gpu_bytes / 2**30 / peak:.2f}",
        parts=",".join(f"{k}:{v / 2**30:.1f}" for k, v in est.parts.items()),
    )


# ------------------------------------------------------------------ specforge


TINY_TARGET = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320
)


def specforge_argv(folder: Path, steps: int, out: Path, tiny: bool) -> list[str]:
    """The trainer's command line at SpecForge's Domino/DFlash shape (or, ``tiny``, a CPU-sized one of the same form)."""
    if tiny:
        SEED_TARGETS.setdefault("tiny-qwen3", TINY_TARGET)
        tpath, _ = write_seed_configs(folder, "tiny-qwen3", SPECFORGE_DRAFTER)
        shape = ["--drafter-layers", "2", "--block-size", "4", "--num-anchors", "8", "--gamma", "2", "--seq-len", "64"]
        shape += ["--batch-size", "2", "--corpus-bytes", "300000", "--attn", "sdpa", "--device", "cpu"]
    else:
        tpath, dpath = write_seed_configs(folder, "qwen3-8b", SPECFORGE_DRAFTER)
        # the doc's MFU microbenchmark (bench_domino_mfu.py): 256 anchors x block 16, sequence 768, batch 2
        shape = ["--drafter-config", str(dpath), "--block-size", "16", "--num-anchors", "256", "--gamma", "7"]
        shape += ["--seq-len", "768", "--batch-size", "2", "--corpus-bytes", str(16 * 1024 * 1024), "--attn", "flex", "--compile"]
    return ["--target-config", str(tpath), *shape, "--no-eval", "--max-steps", str(steps), "--checkpoint-every", "0"] + [
        "--warmup-steps",
        "2",
        "--fresh",
        "--out",
        str(out),
    ]


def bench_specforge(args) -> None:
    """Samples/s per GPU and MFU, colocated step and drafter part alone, beside SpecForge's per-trainer-GPU figures."""
    out = Path(tempfile.mkdtemp(prefix="dflash_specforge_"))
    steps = 4 if args.tiny else args.steps
    skip = 1 if args.tiny else args.skip
    argv = specforge_argv(out / "configs", steps, out / "run", args.tiny)
    if args.profile:
        argv += ["--profile-steps", f"{steps - 1}-{steps}"]
    label = "specforge" + (".tiny" if args.tiny else "")
    rc, recs, wall = run_trainer([sys.executable, "-m", "gpudeck.trainers.dflash", *argv], out, label, args)
    recs_steps = [r for r in recs if r["type"] == "step" and r["step"] > skip and r.get("loss") is not None]
    if rc != 0 or not recs_steps:
        result(label, "FAILED", "-", rc=str(rc).replace(" ", "_"), wall_s=f"{wall:.0f}")
        return
    man = next(r for r in recs if r["type"] == "manifest")
    batch = int(argv[argv.index("--batch-size") + 1])
    step_s = statistics.median(r["step_s"] for r in recs_steps)
    target_s = statistics.median(r["target_forward_s"] or 0.0 for r in recs_steps)
    drafter_s = max(step_s - target_s, 1e-9)
    peak = recs_steps[-1].get("peak_flops")
    d_flops = statistics.median(r.get("drafter_flops") or 0.0 for r in recs_steps)
    mfu_step = statistics.median(r["mfu"] for r in recs_steps) if recs_steps[-1].get("mfu") is not None else None
    mfu_drafter = d_flops / drafter_s / peak if peak else None
    ref_sps = SPECFORGE_SAMPLES_PER_S / SPECFORGE_TRAINER_GPUS

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}"

    common = dict(steps=len(recs_steps), gpu=man.get("gpu_name") or man.get("device"), drafter_params=man.get("drafter_params_trainable"))
    result(
        f"{label}.colocated.samples_per_s_gpu",
        f"{batch / step_s:.2f}",
        "samples/s",
        specforge_per_trainer_gpu=f"{ref_sps:.2f}",
        ratio=f"{batch / step_s / ref_sps:.2f}",
        step_ms=f"{step_s * 1000:.1f}",
        target_fwd_ms=f"{target_s * 1000:.1f}",
        **common,
    )
    result(
        f"{label}.colocated.mfu", pct(mfu_step), "%", convention="causal, target forward + drafter", specforge=f"{100 * SPECFORGE_MFU:.1f}%"
    )
    result(
        f"{label}.drafter.samples_per_s_gpu",
        f"{batch / drafter_s:.2f}",
        "samples/s",
        specforge_per_trainer_gpu=f"{ref_sps:.2f}",
        ratio=f"{batch / drafter_s / ref_sps:.2f}",
        drafter_ms=f"{drafter_s * 1000:.1f}",
        note="step minus the target's forward",
    )
    result(
        f"{label}.drafter.mfu",
        pct(mfu_drafter),
        "%",
        convention="causal (gpudeck's count)",
        drafter_tflop_per_sample=f"{d_flops / batch / 1e12:.4g}",
        specforge_tflop_per_sample=f"{SPECFORGE_TFLOP_PER_SAMPLE:g}",
    )
    # the same step in SpecForge's convention (their FLOPs per sample, counted by torch.utils.flop_counter), so the
    # two MFU figures compare like with like; and SpecForge's drafter samples/s implied by its own MFU and count
    sf_mfu = batch / drafter_s * SPECFORGE_TFLOP_PER_SAMPLE * 1e12 / peak if peak else None
    result(
        f"{label}.drafter.mfu_specforge_convention",
        pct(sf_mfu),
        "%",
        specforge=f"{100 * SPECFORGE_MFU:.1f}%",
        ratio="n/a" if sf_mfu is None else f"{sf_mfu / SPECFORGE_MFU:.2f}",
        specforge_drafter_samples_per_s="n/a" if not peak else f"{SPECFORGE_MFU * peak / (SPECFORGE_TFLOP_PER_SAMPLE * 1e12):.2f}",
    )
    prof = out / "run" / "profile" / "rank0.txt"
    if prof.is_file():
        print(prof.read_text()[:8000], flush=True)


# ------------------------------------------------------------------ train


def bench_train(args) -> None:
    for spec in args.configs:
        attn, layers, batch = spec.split(":")[:3]
        compile_ = spec.endswith(":compile")
        out = Path(tempfile.mkdtemp(prefix="dflash_bench_"))
        cmd = [
            sys.executable,
            "-m",
            "gpudeck.trainers.dflash",
            "--target-config",
            args.target_config,
            "--fresh",
            "--out",
            str(out / "run"),
            "--no-eval",
            "--max-steps",
            str(args.steps),
            "--seq-len",
            str(args.seq_len),
            "--batch-size",
            batch,
            "--block-size",
            str(args.block_size),
            "--num-anchors",
            str(args.num_anchors),
            "--drafter-layers",
            layers,
            "--attn",
            attn,
            "--corpus-bytes",
            str(args.corpus_bytes),
            "--checkpoint-every",
            "0",
            "--warmup-steps",
            "2",
            "--loss-chunk-rows",
            str(args.chunk_rows),
        ]
        if compile_:
            cmd.append("--compile")
        if args.gamma is not None:
            cmd += ["--gamma", str(args.gamma)]
        label = f"train.{attn}.L{layers}.B{batch}" + (".compile" if compile_ else "")
        rc, recs, wall = run_trainer(cmd, out, label, args)
        steps = [r for r in recs if r["type"] == "step" and r["step"] > args.skip]
        if rc != 0 or not steps:
            result(
                label,
                "FAILED",
                "-",
                rc=str(rc).replace(" ", "_"),
                wall_s=f"{wall:.0f}",
                steps_done=len([r for r in recs if r["type"] == "step"]),
            )
            continue
        man = next(r for r in recs if r["type"] == "manifest")
        tps = statistics.median(r["tokens_per_s"] for r in steps)
        mfu = statistics.median(r["mfu"] for r in steps)
        mfu_tt = statistics.median(r["mfu_torchtitan"] for r in steps)
        st = statistics.median(r["step_s"] for r in steps)
        # cross-check from the per-step FLOP count and the step time
        check = statistics.median(r["step_flops"] / r["step_s"] / r["peak_flops"] for r in steps)
        fwd = statistics.median(r["target_forward_s"] for r in steps)
        result(
            f"{label}.tokens_per_s",
            f"{tps:.0f}",
            "tok/s",
            step_ms=f"{st * 1000:.1f}",
            target_fwd_ms=f"{fwd * 1000:.1f}",
            steps=len(steps),
            device=man["device"],
            gpu=man.get("gpu_name"),
        )
        result(
            f"{label}.mfu",
            f"{mfu * 100:.1f}",
            "%",
            convention="causal",
            mfu_torchtitan=f"{mfu_tt * 100:.1f}%",
            crosscheck=f"{check * 100:.1f}%",
            flops_per_token=f"{steps[-1]['flops_per_token']:.3e}",
            peak=f"{steps[-1]['peak_flops']:.3e}",
            mem_peak_gib=steps[-1]["mem_peak_gib"],
            drafter_params=man["drafter_params_trainable"],
            target_params=man["target_params_frozen"],
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="all", choices=["all", "loss", "train", "seed", "specforge"])
    ap.add_argument("--tiny", action="store_true", help="specforge: a tiny shape on CPU (smoke test; no CUDA needed)")
    ap.add_argument("--seed-target", default="qwen3-14b", choices=sorted(SEED_TARGETS))
    ap.add_argument("--no-compile", action="store_true", help="seed: eager drafter and target")
    ap.add_argument(
        "--profile", action="store_true", help="seed, specforge: torch.profiler over the last two steps; prints where the step time goes"
    )
    ap.add_argument("--rows", type=int, default=1024 * 32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--weight-grad", action="store_true")
    ap.add_argument(
        "--configs",
        type=lambda s: s.split(","),
        default=["sdpa:5:4", "flex:5:4", "flex:5:4:compile"],
        help="attn:drafter_layers:batch[:compile], comma separated",
    )
    ap.add_argument("--target-config", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the medians")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=None, help="train: loss decay gamma (needed off B=8/10/16)")
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--chunk-rows", type=int, default=2048)
    ap.add_argument("--corpus-bytes", type=int, default=6 * 1024 * 1024)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--log-dir", default=None, help="where each training run's output goes")
    args = ap.parse_args()
    import torch

    if args.part == "specforge" and args.tiny:
        bench_specforge(args)
        return 0
    if not torch.cuda.is_available():
        print("dflash_bench: needs CUDA", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__} cuda {torch.version.cuda} gpu {torch.cuda.get_device_name(0)}", flush=True)
    if args.part in ("all", "loss"):
        bench_loss(args)
    if args.part in ("all", "train"):
        bench_train(args)
    if args.part in ("all", "seed"):
        bench_seed(args)
    if args.part in ("all", "specforge"):
        bench_specforge(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
