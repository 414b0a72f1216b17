"""Provides the DFlash drafter: Qwen3-style decoder layers that take a frozen target's hidden states as extra keys/values.

A re-implementation of z-lab's ``DFlashDraftModel`` interface (see
shared/research/trainers.md, section A). Self-contained (torch + transformers
only), so ``save_drafter`` copies this file next to the weights as ``dflash.py``
and the folder loads with ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.

* ``build_target_layer_ids(L, n)``: n target layers evenly spaced from 1 to
  L-3 (one layer: L//2), read as ``hidden_states[id + 1]``.
* The drafter has no embedding and no lm_head: the caller embeds the block
  tokens with the target's (frozen) ``embed_tokens`` and scores the output with
  the target's (frozen) ``lm_head`` — shared, never copied.
* Context: the selected target layers, concatenated ``[b, S, n*H]`` ->
  ``fc`` (Linear n*H -> H, no bias) -> ``hidden_norm`` (RMSNorm).
* Every layer: Q from the block tokens only; K and V are
  ``concat(proj(context), proj(block))`` (k_norm on both, RoPE with positions
  ``[0..S-1]`` for the context and ``anchor + k`` for the block). The attention
  mask decides who sees what (non-causal inside a block; see dflash_loss).
* ``attention_mask`` is a dense bool ``[b, 1, Q, S+Q]`` (True = attend; SDPA) or a
  flex-attention ``BlockMask`` (GPU, used with ``torch.compile``'d flex_attention), or a dict
  of them keyed by layer type (``{"full_attention": m, "sliding_attention": m_w}``), as
  SpecForge's ``DFlashDraftModel`` takes it.
* Layers are ``full_attention`` or ``sliding_attention`` per ``config.layer_types`` (SpecForge's
  DFlash configs; its Qwen3.6-27B drafter: four sliding layers with ``sliding_window`` 2048, then
  one full layer). A sliding layer attends through the window mask (``dflash_loss.
  build_attention_mask(..., sliding_window=W)``); the layer itself only records its window.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced target layer ids from 1 to L-3 (z-lab/SpecForge rule); a single layer takes L//2.

    Targets with fewer than n+3 layers (tiny test models) spread over 0..L-1 instead of repeating ids.
    """
    if num_draft_layers < 1:
        raise ValueError("num_draft_layers must be >= 1")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    if end - start + 1 < num_draft_layers:
        # a target too shallow for the 1..L-3 rule (tiny test models): spread over all layers
        start, end = 0, num_target_layers - 1
    span = end - start
    ids = [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return [min(max(0, i), num_target_layers - 1) for i in ids]


FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def attention_layout(config: Any) -> tuple[list[str], int | None]:
    """``(layer_types, sliding_window)`` of a drafter config; ValueError naming the field when inconsistent.

    The rule of SpecForge's ``resolve_dflash_attention_layout``: one entry per layer, each
    ``full_attention`` or ``sliding_attention``; a sliding layer needs a positive ``sliding_window``
    (and, in a Qwen3Config, ``use_sliding_window: true``, without which transformers drops the window).
    The window is None when no layer slides.
    """
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or [FULL_ATTENTION] * n)
    if len(types) != n:
        raise ValueError(f"drafter config: layer_types has {len(types)} entries but num_hidden_layers is {n}; give one entry per layer")
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"drafter config: layer_types {bad} unknown; each must be one of {list(LAYER_TYPES)}")
    if SLIDING_ATTENTION not in types:
        return types, None
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        raise ValueError(
            "drafter config: sliding_attention layers need a positive sliding_window and "
            f"use_sliding_window: true (got sliding_window={window!r})"
        )
    return types, int(window)


def drafter_config_from_target(
    target_config: PreTrainedConfig,
    num_draft_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
) -> Qwen3Config:
    """A Qwen3Config for the drafter with the target's width, heads and rope, plus DFlash fields.

    ``layer_types`` (default: all full attention) and ``sliding_window`` give the per-layer
    attention of a published drafter shape; ``intermediate_size`` defaults to the target's.
    """
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden = tc.hidden_size
    heads = tc.num_attention_heads
    kv = getattr(tc, "num_key_value_heads", None) or heads
    head_dim = getattr(tc, "head_dim", None) or hidden // heads
    rope = getattr(tc, "rope_parameters", None)
    theta = None
    if isinstance(rope, dict):
        theta = rope.get("rope_theta")
    theta = theta or getattr(tc, "rope_theta", None) or 10000.0
    n_target = tc.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(n_target, num_draft_layers)
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=hidden,
        intermediate_size=int(intermediate_size or getattr(tc, "intermediate_size", 4 * hidden)),
        num_hidden_layers=num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=getattr(tc, "hidden_act", "silu"),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=list(layer_types or [FULL_ATTENTION] * num_draft_layers),
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        max_window_layers=num_draft_layers,
    )
    attention_layout(cfg)  # refuse an inconsistent layout here, not at the first forward
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = int(block_size)
    cfg.num_target_layers = int(n_target)
    cfg.dflash_config = {"mask_token_id": int(mask_token_id), "target_layer_ids": list(map(int, target_layer_ids))}
    cfg.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
    return cfg


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE; x [b, h, L, d], cos/sin [b, L, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


_compiled_flex = None


def _flex(q, k, v, block_mask, scale):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


class DFlashAttention(nn.Module):
    """Q from the block; K/V from concat(context, block); non-causal, masked by the caller's mask."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        if config.num_key_value_heads is None:
            raise ValueError(
                "the drafter's config has num_key_value_heads None: Qwen3Config fills it from num_attention_heads, so give a config built by Qwen3Config"
            )
        self.num_kv = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        types, window = attention_layout(config)
        self.layer_type = types[layer_idx]
        # the window is applied by the mask the caller passes for this layer type
        self.sliding_window = window if self.layer_type == SLIDING_ATTENTION else None

    def forward(self, hidden_states, context, position_embeddings, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        ctx_len = context.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([context, hidden_states], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, ctx_len + q_len, self.num_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(bsz, ctx_len + q_len, self.num_kv, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q = _rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rope(k, cos, sin)
        if isinstance(attention_mask, torch.Tensor) or attention_mask is None:
            rep = self.num_heads // self.num_kv
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling)
        else:  # flex BlockMask
            out = _flex(q, k, v, attention_mask, self.scaling)
        out = out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 block whose attention also reads the (already normed) target context."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, position_embeddings, attention_mask):
        residual = hidden_states
        h = self.self_attn(self.input_layernorm(hidden_states), context, position_embeddings, attention_mask)
        hidden_states = residual + h
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The DFlash drafter (z-lab interface): forward(noise_embedding, target_hidden, position_ids, attention_mask)."""

    config_class: type[Qwen3Config] = Qwen3Config  # what transformers sets from Qwen3PreTrainedModel's config, typed
    _no_split_modules = ["DFlashDecoderLayer"]
    _can_record_outputs: dict[str, Any] = {}

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.config = config
        n_ctx = len(config.dflash_config["target_layer_ids"])
        self.layer_types, self.sliding_window = attention_layout(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.fc = nn.Linear(n_ctx * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_size = config.block_size
        self.mask_token_id = config.dflash_config["mask_token_id"]
        self.target_layer_ids = list(config.dflash_config["target_layer_ids"])
        self.gradient_checkpointing = False
        self.post_init()

    def should_save_on_this_rank(self, is_main_process: bool) -> bool:
        """Save where the caller says: the drafter's writer is not global rank 0 in the split topology."""
        return is_main_process

    def reset_rotary(self) -> None:
        """Recompute the non-persistent rotary buffers (needed after meta init / to_empty)."""
        inv, scale = self.rotary_emb.compute_default_rope_parameters(self.config)
        dev = self.fc.weight.device
        self.rotary_emb.inv_freq = inv.to(dev)  # type: ignore[assignment]  # transformers declares it an nn.Buffer; torch keeps a Tensor set on a buffer's name as that buffer
        self.rotary_emb.original_inv_freq = inv.clone().to(dev)  # type: ignore[assignment]  # as above
        self.rotary_emb.attention_scaling = scale

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Any = None,
    ) -> torch.Tensor:
        """noise_embedding [b, Q, H], target_hidden [b, S, n*H], position_ids [b, S+Q] -> [b, Q, H] (normed).

        ``attention_mask``: one mask for every layer, or a dict keyed by layer type.
        """
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        hidden = noise_embedding.to(self.fc.weight.dtype)
        pos_emb = self.rotary_emb(hidden, position_ids)
        for layer_type, layer in zip(self.layer_types, self.layers):
            mask = attention_mask[layer_type] if isinstance(attention_mask, dict) else attention_mask
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden, context, pos_emb, mask, use_reentrant=False)
            else:
                hidden = layer(hidden, context, pos_emb, mask)
        return self.norm(hidden)


def extract_context(hidden_states: tuple[torch.Tensor, ...], target_layer_ids: list[int]) -> torch.Tensor:
    """Concatenate ``hidden_states[id + 1]`` for the chosen target layers: [b, S, n*H]."""
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "attention_layout",
    "build_target_layer_ids",
    "drafter_config_from_target",
    "DFlashDraftModel",
    "DFlashAttention",
    "DFlashDecoderLayer",
    "extract_context",
]
