"""Benchmark: MFU of ``gpudeck.trainers.fsdp_lm`` on one GPU, cross-checked from wall time.

For each configuration it runs the real trainer (``python -m gpudeck.trainers.fsdp_lm``,
world size 1) for a few steps and prints one line::

    fsdp_mfu llama-1b B=8 T=2048 compile=1 sdpa=auto: 48.9% MFU causal (trainer) 48.7% (bench), 52.9% torchtitan (trainer) 52.7% (bench) 71,313 tok/s [...]

Two conventions (``gpudeck.trainers.common.flops``): **causal** — the headline, the
trainer's ``mfu`` — counts attention FLOPs halved for the causal mask,
6·(N − N_emb) + 6·L·H·d_head·S; **torchtitan** counts full attention,
6·(N − N_emb) + 12·L·H·d_head·S (the trainer's ``mfu_torchtitan``).

"trainer" is the mean of the MFU the trainer itself reported in its telemetry
over the measured steps. "bench" is computed here, independently: the FLOPs per
token are counted from a meta-device copy of the model (N, N_emb counted here),
the throughput is tokens of the measured steps over the wall time between the
telemetry timestamps of the last warm-up step and the last step, and the peak
is 989 TFLOP/s bf16 dense for H100/H200 SXM.

Usage::

    python3 bench/fsdp_mfu.py [--model llama-1b] [--seq-len 2048] [--steps 25]
        [--warmup 8] [--configs 8:1:auto,16:1:auto,8:0:auto] [--budget-s 420] [--out DIR]
        [--extra "TRAINER ARGS"]

Each config is ``BATCH:COMPILE:SDPA[:TRAINER ARGS]`` (SDPA: auto | cudnn |
flash | efficient); the optional fourth field is passed to the trainer as
more arguments, e.g. ``16:1:auto:--loss-impl chunked`` (``--extra`` goes to every
config). Configs that would not fit in the remaining ``--budget-s`` are skipped
(and said so). With ``--profile-steps N`` in a config's arguments the trainer
prints its top kernels; the bench copies those lines into its output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAKS = {"H100": 989e12, "H200": 989e12}


def bench_flops_per_token(model_spec: str, seq_len: int) -> tuple[float, float, int]:
    """(causal FLOPs/token, torchtitan FLOPs/token, params) counted here from a meta-device model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpudeck.trainers.fsdp_lm.trainer import PRESETS

    kw = dict(PRESETS[model_spec])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    n_emb = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dense = n - n_emb + (n_emb if tied else 0)
    attn_full = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq_len
    return float(6 * dense + attn_full / 2), float(6 * dense + attn_full), int(n)


def gpu_peak() -> tuple[float | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "no GPU"
    name = torch.cuda.get_device_name(0)
    for key, peak in PEAKS.items():
        if key in name.upper() and "PCIE" not in name.upper() and "NVL" not in name.upper():
            return peak, name
    return None, name


def run_one(args, batch: int, compile_: bool, sdpa: str, extra: list[str], workdir: Path, log_dir: Path | None, timeout: float) -> dict:
    tag = f"B{batch}_c{int(compile_)}_{sdpa}" + "".join("_" + a.lstrip("-").replace("/", "") for a in extra)[:80]
    out = workdir / tag
    tel = workdir / f"{tag}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "gpudeck.trainers.fsdp_lm",
        "--model-config",
        args.model,
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(batch),
        "--max-steps",
        str(args.steps),
        "--warmup-steps",
        "2",
        "--checkpoint-every",
        "0",
        "--no-final-checkpoint",
        "--no-export",
        "--corpus-bytes",
        str(args.corpus_bytes),
        "--sdpa-backend",
        sdpa,
        "--log-every",
        "5",
        "--fresh",
        "--out",
        str(out),
    ]
    if compile_:
        cmd.append("--compile")
    cmd += extra
    env = dict(os.environ, GPUDECK_TELEMETRY=str(tel), PYTHONUNBUFFERED="1")
    log_path = (log_dir or workdir) / f"trainer_{tag}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = "timeout"
    recs = [json.loads(line) for line in tel.read_text().splitlines()] if tel.exists() else []
    steps = [r for r in recs if r["type"] == "step"]
    manifest = next((r for r in recs if r["type"] == "manifest"), {})
    res = {
        "tag": tag,
        "batch": batch,
        "compile": compile_,
        "sdpa": sdpa,
        "extra": " ".join(extra),
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 1),
        "steps": len(steps),
        "log": str(log_path),
    }
    if rc != 0 or len(steps) <= args.warmup + 1:
        tail = log_path.read_text()[-2500:]
        res["error"] = tail
        return res
    measured = [s for s in steps if s["step"] > args.warmup]
    w = next(s for s in steps if s["step"] == args.warmup)
    last = steps[-1]
    tokens = (last["step"] - w["step"]) * manifest["tokens_per_step"]
    wall = last["ts"] - w["ts"]
    res.update(
        tokens_per_s_bench=tokens / wall,
        trainer_mfu=_mean_of(measured, "mfu"),
        trainer_mfu_torchtitan=_mean_of(measured, "mfu_torchtitan"),
        mfu_convention=manifest.get("mfu_convention"),
        profile=[line for line in log_path.read_text().splitlines() if line.startswith("profile")],
        trainer_tokens_per_s=sum(s["tokens_per_s"] for s in measured) / len(measured),
        trainer_flops_per_token=manifest.get("flops_per_token"),
        params_total=manifest.get("params_total"),
        mem_peak_gib=max(s["mem_peak_gib"] or 0 for s in steps),
        final_loss=last["loss"],
        first_loss=steps[0]["loss"],
    )
    return res


def _mean_of(steps: list[dict], key: str) -> float | None:
    values = [s.get(key) for s in steps]
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=8, help="steps not measured (compile, warm-up)")
    ap.add_argument("--configs", default="8:1:auto,16:1:auto,8:0:auto")
    ap.add_argument("--corpus-bytes", type=int, default=8 * 1024 * 1024)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--out", default=None, help="folder for logs and results.jsonl")
    ap.add_argument("--extra", default="", help="more trainer arguments for every config")
    args = ap.parse_args()

    t_start = time.monotonic()
    fpt, fpt_tt, n_params = bench_flops_per_token(args.model, args.seq_len)
    peak, gpu = gpu_peak()
    print(
        f"fsdp_mfu: {args.model} {n_params:,} params, {fpt / 1e9:.3f} GFLOP/token causal, "
        f"{fpt_tt / 1e9:.3f} torchtitan (bench count), "
        f"GPU {gpu}, peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s",
        flush=True,
    )
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="fsdp_mfu_") as tmp:
        for spec in args.configs.split(","):
            b, c, sdpa, *more = spec.split(":", 3)
            extra = (more[0].split() if more else []) + args.extra.split()
            label = f" [{' '.join(extra)}]" if extra else ""
            left = args.budget_s - (time.monotonic() - t_start)
            if left < 60:
                print(
                    f"fsdp_mfu {args.model} B={b} T={args.seq_len} compile={c} sdpa={sdpa}{label}: "
                    f"skipped, {left:.0f} s of the budget left",
                    flush=True,
                )
                continue
            r = run_one(args, int(b), c == "1", sdpa, extra, Path(tmp), out_dir, timeout=left)
            results.append(r)
            if out_dir:
                with open(out_dir / "fsdp_mfu_results.jsonl", "a") as fh:
                    fh.write(json.dumps({k: v for k, v in r.items() if k != "error"}) + "\n")
            head = f"fsdp_mfu {args.model} B={b} T={args.seq_len} compile={c} sdpa={sdpa}{label}"
            if "error" in r:
                print(f"{head}: FAILED rc={r['rc']} after {r['seconds']} s, {r['steps']} steps\n{r['error']}", flush=True)
                continue
            bench_mfu = r["tokens_per_s_bench"] * fpt / peak if peak else None
            bench_mfu_tt = r["tokens_per_s_bench"] * fpt_tt / peak if peak else None
            if out_dir:
                with open(out_dir / "fsdp_mfu_results.jsonl", "a") as fh:
                    fh.write(
                        json.dumps(
                            {
                                "tag": r["tag"],
                                "bench_mfu": bench_mfu,
                                "bench_mfu_torchtitan": bench_mfu_tt,
                                "bench_flops_per_token": fpt,
                                "bench_flops_per_token_torchtitan": fpt_tt,
                            }
                        )
                        + "\n"
                    )
            r["bench_mfu"] = bench_mfu
            r["bench_flops_per_token"] = fpt
            for line in r["profile"]:
                print(f"  {line}", flush=True)
            print(
                f"{head}: {_pct(r['trainer_mfu'])} MFU causal (trainer) {_pct(bench_mfu)} (bench), "
                f"{_pct(r['trainer_mfu_torchtitan'])} torchtitan (trainer) {_pct(bench_mfu_tt)} (bench) "
                f"{r['tokens_per_s_bench']:,.0f} tok/s "
                f"[trainer {r['trainer_tokens_per_s']:,.0f} tok/s, peak mem "
                f"{r['mem_peak_gib']:.1f} GiB, loss {r['first_loss']:.3f}->{r['final_loss']:.3f}, "
                f"steps {args.warmup + 1}..{r['steps']} measured, {r['seconds']} s total]",
                flush=True,
            )
    return 0 if results and all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
