"""Provides exact parameter counts, FLOPs per token under two conventions, peak detection and MFU.

FLOPs per token (PaLM's 6N + 12·L·H·d·S, torchtitan ``get_dense_model_nparams_and_flops``):

    torchtitan:  6 * (N - N_emb) + 6 * L * n_heads * (2 * head_dim) * S
    causal:      6 * (N - N_emb) + 6 * L * n_heads * (2 * head_dim) * S / 2
    (forward only: factor 2 instead of 6)

The two differ only in the attention term. torchtitan counts every query
against all S keys; under a causal mask a query sees on average S/2 of them and
flash attention skips the masked half, so the **causal** count — attention
FLOPs halved — is the work really required. It is gpudeck's headline: ``mfu``
in telemetry is causal, ``mfu_torchtitan`` stands beside it, the manifest's
``mfu_convention`` says so (``MFU_CONVENTION``). N counts every parameter once;
N_emb is the token-embedding table. With tied input/output embeddings the
shared matrix is counted once in N and would vanish from ``N - N_emb``; since
the lm_head matmul is still done, we add it back (``vocab * hidden``) —
documented in ``ModelFlops.note``. Activation recomputation is not counted
(it is not required work).

Public API (kept stable; dflash imports it):

    ``count_params(model) -> (total, trainable)``  unique parameters; works on
        meta-device models and on FSDP2 models (DTensor numel is global).
    ``embedding_params(model) -> int``  parameters of the input embedding.
    ``attention_dims(config) -> (n_layers, n_heads, head_dim)``
    ``flops_per_token(n_params, n_embedding, n_layers, n_heads, head_dim, seq_len,
        training=True, tied_lm_head_params=0, causal=False) -> float``
        torchtitan's count; ``causal=True`` halves the attention term.
    ``attention_flops(n_layers, n_heads, head_dim, visible_keys, training=True) -> float``
        the attention matmuls (QK^T and PV) for a total of ``visible_keys``
        (query, key) pairs summed over all queries — for masks that are
        neither full nor causal (sliding windows, DFlash blocks); pair counts
        for the common masks: ``causal_pairs(S)`` (S²/2, the convention),
        ``full_pairs(S)`` (S²), ``window_pairs(S, W)`` (exact, causal window W).
    ``dense_flops(n_matmul_params, tokens, training=True) -> float``
        6 (or 2) FLOPs per matmul parameter per token.
    ``model_flops(model, config, seq_len, training=True) -> ModelFlops``
        (total, trainable, embedding, flops_per_token (causal),
        flops_per_token_torchtitan, note).
    ``peak_flops(device, dtype="bf16") -> (peak_flops_per_s | None, reason | None)``
        dense bf16 tensor-core peaks: H100/H200 SXM 989e12, H100 PCIe 756e12,
        H100 NVL 835e12, A100 312e12, B200 2.25e15, ...; CPU and unknown GPUs
        give (None, reason).
    ``mfu(tokens_per_s_per_device, flops_per_token, peak) -> float | None``
        as a fraction (0.51 = 51%); None when the peak is unknown.
    ``MFU_CONVENTION``  the manifest's ``mfu_convention`` text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# dense (no sparsity) bf16 tensor-core peaks, FLOP/s, matched in order on the device name
_PEAKS: list[tuple[tuple[str, ...], float]] = [
    (("H200",), 989e12),
    (("H100", "NVL"), 835e12),
    (("H100", "PCIE"), 756e12),
    (("H100",), 989e12),
    (("H800",), 989e12),
    (("GH200",), 989e12),
    (("B200",), 2.25e15),
    (("B100",), 1.75e15),
    (("A100",), 312e12),
    (("A800",), 312e12),
    (("L40S",), 362e12),
    (("L40",), 181e12),
    (("A10G",), 70e12),
    (("L4",), 121e12),
]


def count_params(model: Any) -> tuple[int, int]:
    """(total, trainable) over unique parameters; tied weights count once."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = int(p.numel())
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable


def embedding_params(model: Any) -> int:
    """Parameters of the input token embedding (``get_input_embeddings``)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.weight.numel()) if emb is not None else 0


def _tied(model: Any) -> bool:
    try:
        out = model.get_output_embeddings()
        inp = model.get_input_embeddings()
        return out is not None and inp is not None and out.weight is inp.weight
    except Exception:
        return False


def attention_dims(config: Any) -> tuple[int, int, int]:
    """(n_layers, n_heads, head_dim) of a transformers decoder config."""
    cfg = getattr(config, "text_config", None) or config
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return layers, heads, int(head_dim)


MFU_CONVENTION = (
    "causal: 6(N-N_emb) + 6*L*H*d_head*S (attention FLOPs halved for the causal "
    "mask); mfu_torchtitan counts full attention, 12*L*H*d_head*S"
)


def dense_flops(n_matmul_params: int, tokens: float = 1.0, training: bool = True) -> float:
    """Matmul FLOPs of the weights: 6 (training: forward + backward) or 2 per parameter per token."""
    return float((6 if training else 2) * n_matmul_params * tokens)


def attention_flops(n_layers: int, n_heads: int, head_dim: int, visible_keys: float, training: bool = True) -> float:
    """QK^T and PV FLOPs for ``visible_keys`` (query, key) pairs in all (factor 6 or 2 · 2·d_head per pair)."""
    return float((6 if training else 2) * n_layers * n_heads * 2 * head_dim * visible_keys)


def causal_pairs(seq_len: int) -> float:
    """(query, key) pairs of a causal mask under the convention: S²/2."""
    return seq_len * seq_len / 2.0


def full_pairs(seq_len: int) -> float:
    """(query, key) pairs without a mask: S² (torchtitan's count)."""
    return float(seq_len * seq_len)


def window_pairs(seq_len: int, window: int) -> float:
    """Exact (query, key) pairs of a causal sliding window: query i sees min(i + 1, window) keys."""
    w = min(window, seq_len)
    return float(w * (w + 1) // 2 + (seq_len - w) * w)


def flops_per_token(
    n_params: int,
    n_embedding: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    training: bool = True,
    tied_lm_head_params: int = 0,
    causal: bool = False,
) -> float:
    """torchtitan's count 6·(N−N_emb) + 6·L·H·(2·d_head)·S; ``causal`` halves the attention term."""
    dense = dense_flops(n_params - n_embedding + tied_lm_head_params, 1.0, training)
    pairs = causal_pairs(seq_len) if causal else full_pairs(seq_len)
    return dense + attention_flops(n_layers, n_heads, head_dim, pairs, training) / seq_len


@dataclass
class ModelFlops:
    """What ``model_flops`` counts; ``flops_per_token`` is the causal (headline) figure."""

    params_total: int
    params_trainable: int
    params_embedding: int
    flops_per_token: float
    seq_len: int
    note: str
    flops_per_token_torchtitan: float = 0.0


def model_flops(model: Any, config: Any, seq_len: int, training: bool = True) -> ModelFlops:
    """Counts for an (unsharded, e.g. meta-device) model and its config, under both conventions."""
    total, trainable = count_params(model)
    emb = embedding_params(model)
    tied = _tied(model)
    layers, heads, head_dim = attention_dims(config)
    tied_params = emb if tied else 0
    causal = flops_per_token(total, emb, layers, heads, head_dim, seq_len, training=training, tied_lm_head_params=tied_params, causal=True)
    titan = flops_per_token(total, emb, layers, heads, head_dim, seq_len, training=training, tied_lm_head_params=tied_params, causal=False)
    note = "causal 6(N-N_emb)+6*L*H*d_head*S (torchtitan's 12*L*H*d_head*S beside it)" + ("; tied lm_head added back" if tied else "")
    return ModelFlops(total, trainable, emb, causal, seq_len, note, titan)


def peak_flops(device: Any, dtype: str = "bf16") -> tuple[float | None, str | None]:
    """Dense bf16 peak of ``device``; (None, reason) where it is not known."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None, f"no peak FLOP/s for device type {dev.type!r} (MFU is for GPUs)"
    if dtype not in ("bf16", "fp16"):
        return None, f"peak known for bf16/fp16 only, training runs in {dtype}"
    name = torch.cuda.get_device_name(dev.index if dev.index is not None else 0)
    upper = name.upper()
    for keys, peak in _PEAKS:
        if all(k in upper for k in keys):
            return peak, None
    return None, f"unknown GPU {name!r}: no peak FLOP/s in the table"


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction; None without a peak."""
    if not peak or tokens_per_s_per_device is None:
        return None
    return tokens_per_s_per_device * flops_per_token / peak
