"""Provides the bounds on model and drafter configs, checked on the raw JSON before transformers or torch allocate anything.

Stdlib only. Every config a trainer builds passes :func:`check_config` first: a preset, a
``config.json`` (``--model-config``, ``--target-config``, ``--drafter-config``), the folder of
``--init-from`` / ``--target``; a field out of bounds raises
:class:`~gpudeck.trainers.errors.ConfigLimitError` naming the field and the limit (exit 2).
A config asking for 1e9 layers otherwise ends in a bare ``MemoryError`` while transformers
builds its per-layer lists; a 1e6-wide vocabulary tries a many-GB allocation in torch.

The limits are far above every published dense model (Llama-3.1-405B: 126 layers, hidden
16,384, intermediate 53,248, 128 heads; Qwen3.5: vocab 248,320; Gemma-3: vocab 262,208) and
below what makes the process fall over before saying why. :func:`estimated_params` with
:data:`MAX_PARAMS` bounds the product the per-field limits still allow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpudeck.trainers.errors import ConfigLimitError, InputError

__all__ = ["LIMITS", "MAX_CONFIG_BYTES", "MAX_PARAMS", "check_config", "estimated_params", "read_config_json"]

# field -> inclusive upper bound (every field is a positive integer when present)
LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 65_536,
    "intermediate_size": 262_144,
    "vocab_size": 1_048_576,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "max_position_embeddings": 16_777_216,
    "sliding_window": 16_777_216,
    "block_size": 1024,
    "num_experts": 4096,
    "num_local_experts": 4096,
}
MAX_PARAMS = 2_000_000_000_000  # 2e12: 8 TB of fp32 weights, beyond any fleet this trains on
MAX_CONFIG_BYTES = 16 << 20
_NESTED = ("text_config",)  # multimodal configs keep the language model's shape here


def _check_field(source: str, field: str, value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigLimitError(source, field, value, f"a positive integer <= {limit:,}")
    if not 1 <= value <= limit:
        raise ConfigLimitError(source, field, value, f"1 to {limit:,}")
    return value


def estimated_params(cfg: dict[str, Any]) -> int:
    """A dense decoder's parameter count from its config fields (embeddings and head counted twice: an upper bound)."""
    hidden = int(cfg.get("hidden_size") or 0)
    layers = int(cfg.get("num_hidden_layers") or 0)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else hidden))
    kv = int(cfg.get("num_key_value_heads") or heads)
    experts = max(int(cfg.get("num_experts") or 0), int(cfg.get("num_local_experts") or 0), 1)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * inter * experts
    return layers * (attention + mlp) + 2 * int(cfg.get("vocab_size") or 0) * hidden


def check_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Refuse (ConfigLimitError) a config dict with a shape field out of bounds, or too many parameters in all; returns it."""
    if not isinstance(cfg, dict):
        raise ConfigLimitError(source, "config", type(cfg).__name__, "a JSON object")
    for field, limit in LIMITS.items():
        if cfg.get(field) is not None:
            _check_field(source, field, cfg[field], limit)
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) > LIMITS["num_hidden_layers"]):
        raise ConfigLimitError(
            source,
            "layer_types",
            f"{type(types).__name__} of {len(types) if isinstance(types, list) else '?'}",
            f"a list of at most {LIMITS['num_hidden_layers']} entries",
        )
    for key in _NESTED:
        if isinstance(cfg.get(key), dict):
            check_config(cfg[key], f"{source} [{key}]")
    params = estimated_params(cfg)
    if params > MAX_PARAMS:
        raise ConfigLimitError(
            source,
            "estimated parameters",
            params,
            f"at most {MAX_PARAMS:,}, from hidden_size, num_hidden_layers, intermediate_size, vocab_size",
            "make the model smaller",
        )
    return cfg


def read_config_json(path: str | Path, source: str) -> dict[str, Any]:
    """A config.json (a file, or a folder holding one) read as JSON and checked; ConfigLimitError names what is wrong."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise InputError(f"{source}: {p} holds {size:,} bytes, more than a config ({MAX_CONFIG_BYTES:,} at most)")
        cfg = json.loads(p.read_text())
    except OSError as exc:
        raise InputError(f"{source}: cannot read {p} ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise InputError(f"{source}: {p} is not valid JSON ({exc})") from None
    return check_config(cfg, source)
