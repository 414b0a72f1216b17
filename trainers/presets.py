"""Provides what the trainers and the agent share, stdlib only: the named model configs (presets) and the index-list syntax.

Stdlib only: the agent reads this table too (pre-flight memory estimates,
``agents/safety/estimate.py``), and the agent imports neither torch nor transformers.
Each preset is the keyword arguments of ``AutoConfig.for_model(model_type, ...)``.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # a 3.07M-parameter Llama for CPU tests; vocab fits the byte tokenizer (260)
    "tiny": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # the TinyLlama-1.1B shape
    "llama-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # the Llama-3.2-3B shape (tied embeddings, head_dim 128): the largest Llama shape whose full
    # FSDP state (fp32 master weights, gradients, AdamW moments) fits one 141 GB GPU with activations
    "llama-3b": dict(
        model_type="llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # the Qwen3-0.6B shape
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
}


def parse_index_list(text: str) -> list[int]:
    """'0,1' / '0-3' / '2' -> sorted unique indices (ranks, GPUs); ValueError on anything else."""
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        a, dash, b = part.partition("-")
        lo, hi = (int(a), int(b)) if dash else (int(part), int(part))
        if lo < 0 or hi < lo:
            raise ValueError(f"{part!r} is not an index or a rising range")
        out.update(range(lo, hi + 1))
    return sorted(out)
