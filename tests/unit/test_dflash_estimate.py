"""Pre-flight's memory estimate for the seed's DFlash run: SpecForge's Qwen3.6-27B drafter config, 1024 anchors x block 32.

The estimate is split into weights, optimizer, activations and the lm_head chunk (plus the CUDA
context) and names the largest; the drafter it counts is the one gpudeck.trainers.dflash builds from the
same --drafter-config (parameter count equal to the meta-device model's). Its accuracy against a
measured peak is tests/gpu/test_dflash_gpu.py's (on an H200).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpudeck.agents.safety.estimate import GIB, drafter_params, estimate, model_shape
from gpudeck.agents.wire.protocol import LaunchSpec

SEED_CONFIG = Path(__file__).resolve().parents[1] / "reference" / "qwen3.6-27b-dflash.json"
# a dense Qwen3 of Qwen3.6-27B's widths (its config.json's text part: 64 layers, hidden 5120, 24 heads of 256,
# 4 kv heads, intermediate 17408, vocab 248320); the estimate's target stand-in
TARGET_27B = dict(
    model_type="qwen3",
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    vocab_size=248320,
    tie_word_embeddings=False,
)
PARTS = {"weights", "optimizer", "activations", "lm_head_chunk", "cuda_context"}


def _seed_argv(tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "target" / "config.json").write_text(json.dumps(TARGET_27B))
    return [
        "torchrun",
        "--nproc-per-node",
        "8",
        "-m",
        "gpudeck.trainers.dflash",
        "--target",
        str(tmp_path / "target"),
        "--drafter-config",
        str(SEED_CONFIG),
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
        "--topology",
        "split",
        "--target-ranks",
        "0-4",
        "--drafter-ranks",
        "5-7",
        "--fresh",
        "--out",
        "o",
        *extra,
    ]


def test_the_seed_drafter_rank_estimate_is_split_by_part_and_names_the_largest(tmp_path):
    e = estimate(LaunchSpec(kind="dflash", argv=_seed_argv(tmp_path)))
    assert e is not None and set(e.parts) == PARTS and e.per_gpu_bytes == sum(e.parts.values())
    largest = max(e.parts, key=e.parts.get)
    assert f"largest part: {largest.replace('_', ' ')}" in e.method
    assert "drafter side is the need" in e.method and "4 sliding, window 2048" in e.method
    # the drafter rank holds the embedding and lm_head (2 x 248320 x 5120 bf16), never the target
    head = 2 * 248320 * 5120 * 2
    assert e.parts["weights"] == head + 2 * e.params
    assert e.parts["optimizer"] == 16 * e.params // 3
    print(
        "\nseed drafter rank: "
        + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in e.parts.items())
        + f"; total {e.per_gpu_bytes / GIB:.1f} GiB of a 96 GB GPU ({96e9 / GIB:.1f} GiB)"
    )
    assert e.per_gpu_bytes < 96e9  # the seed's drafter ranks fit a 96 GB GPU
    compiled = estimate(LaunchSpec(kind="dflash", argv=_seed_argv(tmp_path, "--compile")))
    assert compiled is not None and compiled.parts["activations"] < e.parts["activations"]
    # a token budget of two full-length records: twice the block positions and features
    budget = estimate(LaunchSpec(kind="dflash", argv=_seed_argv(tmp_path, "--token-budget", "8192")))
    assert budget is not None and 1.9 < budget.parts["activations"] / e.parts["activations"] < 2.1
    assert budget.parts["weights"] == e.parts["weights"] and budget.parts["optimizer"] == e.parts["optimizer"]


def test_the_estimated_drafter_is_the_one_the_trainer_builds_from_the_config():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import Qwen3Config

    from gpudeck.trainers.dflash.config import drafter_config_from_file, read_drafter_config
    from gpudeck.trainers.dflash.model import DFlashDraftModel

    cfg = read_drafter_config(str(SEED_CONFIG))
    target = Qwen3Config(**{k: v for k, v in TARGET_27B.items() if k != "model_type"})
    dcfg = drafter_config_from_file(cfg, target, 32, 248070)
    with torch.device("meta"):
        d = DFlashDraftModel(dcfg)
    assert sum(p.numel() for p in d.parameters()) == drafter_params(model_shape(TARGET_27B), 5, cfg, 5)


@pytest.mark.parametrize("target", ["qwen3-14b", "qwen3-32b"])
def test_the_bench_seed_command_is_one_the_trainer_takes_and_its_estimate_counts_its_models(tmp_path, target):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from bench.dflash_bench import seed_train_argv
    from gpudeck.trainers.dflash import config as dflash
    from gpudeck.trainers.dflash.model import DFlashDraftModel, attention_layout
    from gpudeck.trainers.fsdp_lm.trainer import build_config

    argv = seed_train_argv(tmp_path / "cfg", target, 4, tmp_path / "out")
    parser = dflash.build_parser()
    args = parser.parse_args(argv)
    dflash.check_args(parser, args)
    assert (args.block_size, args.num_anchors, args.drafter_layers, args.gamma) == (32, 1024, 5, 7.0)
    tcfg = build_config(args.target_config, None)
    with torch.device("meta"):
        t = AutoModelForCausalLM.from_config(tcfg)
    dcfg = dflash.drafter_config_from_file(args.drafter_cfg, tcfg, args.block_size, 151669)
    assert attention_layout(dcfg) == (["sliding_attention"] * 4 + ["full_attention"], 2048)
    with torch.device("meta"):
        d = DFlashDraftModel(dcfg)
    e = estimate(LaunchSpec(kind="dflash", argv=["python", "-m", "gpudeck.trainers.dflash", *argv]))
    n_t = sum(p.numel() for p in t.parameters())
    n_d = sum(p.numel() for p in d.parameters())
    assert e is not None and e.params == n_d
    assert e.parts["weights"] == 2 * n_t + 2 * n_d and e.parts["optimizer"] == 16 * n_d
    print(
        f"\n{target}: target {n_t / 1e9:.2f}B, drafter {n_d / 1e9:.2f}B params; estimate "
        + ", ".join(f"{k} {v / GIB:.1f}" for k, v in e.parts.items())
        + f" = {e.per_gpu_bytes / GIB:.1f} GiB"
    )
