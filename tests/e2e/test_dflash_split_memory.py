"""A split drafter rank holds the target's embedding and lm_head, not the target: host RSS measured.

The target is a random Llama saved with save_pretrained (safetensors), large enough on CPU for its
transformer weights (~400 MB in float32) to stand out of the drafter rank's own footprint. In a
split run (target rank 0, drafter rank 1) the manifest of each rank gives its resident set before
the models and its high-water mark after the target part: the target rank grows by about the transformer's size, the
drafter rank by far less (it reads two [vocab, hidden] tensors by name from the memory-mapped
safetensors), and it says how it loaded them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

pytestmark = pytest.mark.slow

from tests.trainer_harness import Runs

HIDDEN, LAYERS, INTER, VOCAB = 1024, 8, 2816, 320


@pytest.fixture(scope="module")
def runs():
    r = Runs()
    yield r
    r.teardown()


def _save_target(folder: Path) -> int:
    """Save a random ~100M-parameter Llama (bf16 on disk); return its transformer-layer parameter count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(folder))
    n_layers = sum(p.numel() for p in model.model.layers.parameters())
    del model
    return n_layers


def test_split_drafter_rank_reads_only_embedding_and_lm_head(tmp_path, runs):
    target = tmp_path / "target"
    n_layer_params = _save_target(target)
    layer_mib = n_layer_params * 4 / 2**20  # float32 on CPU
    assert (target / "model.safetensors").is_file()
    out = tmp_path / "out"
    rc, output, tel, _ = runs.run(
        "gpudeck.trainers.dflash",
        [
            "--target",
            str(target),
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--num-anchors",
            "8",
            "--block-size",
            "8",
            "--drafter-layers",
            "1",
            "--corpus-bytes",
            "200000",
            "--no-eval",
            "--topology",
            "split",
            "--target-ranks",
            "0",
            "--drafter-ranks",
            "1",
            "--max-steps",
            "2",
            "--fresh",
        ],
        out,
        nproc=2,
    )
    assert rc == 0, output[-4000:]
    man = {r["rank"]: r for r in tel if r["type"] == "manifest"}
    # the high-water mark: a rank that loaded the target and let it go still shows it there
    t_grow = man[0]["host_rss_peak_after_target_mib"] - man[0]["host_rss_before_models_mib"]
    d_grow = man[1]["host_rss_peak_after_target_mib"] - man[1]["host_rss_before_models_mib"]
    print(
        f"transformer layers {layer_mib:.0f} MiB fp32; peak RSS growth over the model setup: target rank "
        f"{t_grow:.0f} MiB, drafter rank {d_grow:.0f} MiB"
    )
    assert "embedding and lm_head only" in man[1]["target_load"]
    assert man[0]["target_load"].startswith("whole target")
    assert t_grow > 0.8 * layer_mib
    assert d_grow < 0.15 * layer_mib
    # the drafter rank still knows the target's size (meta skeleton) and trains
    assert man[1]["target_params_frozen"] == man[0]["target_params_frozen"]
    steps = [r for r in tel if r["type"] == "step" and r["rank"] == 1]
    assert len(steps) == 2 and all(r["loss"] > 0 for r in steps)
