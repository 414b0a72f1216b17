"""Provides what a split drafter rank needs of the target, and no more: its config, a meta-device skeleton, and the embedding and lm_head read by tensor name from safetensors.

A drafter rank of the split topology never runs the target: it embeds the block
tokens with the target's ``embed_tokens`` and scores its outputs with the target's
``lm_head``, both frozen. Loading the whole target for those two matrices costs
the whole target's host RAM on every drafter rank (a 27B target on 3 drafter
ranks: ~160 GB), so a drafter rank builds the target on the meta device (no
memory; it still gives the config, the parameter counts and the FLOPs) and reads
the two tensors from the checkpoint's safetensors files with ``safe_open``
(memory-mapped: only those tensors' pages are read), by the names the model's own
modules carry (``model.embed_tokens.weight``, ``lm_head.weight``; a tied
lm_head is the embedding). ``model.safetensors`` and sharded checkpoints
(``model.safetensors.index.json``) are both read.

``host_rss_mib()`` is the process's resident set (and its peak), for the manifest.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HeadLoadError(ValueError):
    """The target folder cannot give the embedding/lm_head by name (no safetensors, or a name missing)."""


def host_rss_mib() -> dict[str, float]:
    """{"rss_mib": resident set now, "rss_peak_mib": its high-water mark} of this process."""
    rss = 0.0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024.0
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    return {"rss_mib": round(rss, 1), "rss_peak_mib": round(peak, 1)}


def has_safetensors(folder: str | Path) -> bool:
    p = Path(folder)
    return (p / INDEX_FILE).is_file() or (p / SINGLE_FILE).is_file()


def target_skeleton(folder: str | Path, dtype: Any):
    """The target model on the meta device (config, parameter names and counts; no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    return model


def head_tensor_names(model) -> tuple[str, str | None]:
    """(embedding weight name, lm_head weight name or None when it is tied to the embedding)."""
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    emb_name = names[id(emb.weight)]
    if out is None or out.weight is emb.weight:
        return emb_name, None
    return emb_name, names[id(out.weight)]


def _files_for(folder: Path, names: list[str]) -> dict[str, Path]:
    """Which safetensors file holds each tensor name."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {n: folder / weight_map[n] for n in names if n in weight_map}
    single = folder / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            keys = set(f.keys())
        return {n: single for n in names if n in keys}
    raise HeadLoadError(
        f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; a drafter rank reads the target's "
        "embedding and lm_head from safetensors (save the target with save_pretrained)"
    )


def read_tensors(folder: str | Path, names: list[str]) -> dict[str, Any]:
    """The named tensors, each read from its memory-mapped safetensors file (copied out, file closed)."""
    from safetensors import safe_open

    folder = Path(folder)
    where = _files_for(folder, names)
    missing = [n for n in names if n not in where]
    if missing:
        raise HeadLoadError(
            f"{folder}: tensors {missing} are not in the checkpoint's safetensors; "
            "the drafter ranks read the target's embedding and lm_head by these names"
        )
    out: dict[str, Any] = {}
    for path in sorted(set(where.values())):
        with safe_open(str(path), framework="pt") as f:
            for n in names:
                if where[n] == path:
                    out[n] = f.get_tensor(n).clone()
    return out


def load_embedding_and_head(folder: str | Path, skeleton, device, dtype):
    """(embedding module, lm_head module): the target's, frozen, on ``device`` in ``dtype``; nothing else loaded.

    A tied lm_head (or one the checkpoint does not store, as save_pretrained does for tied
    weights) shares the embedding's matrix.
    """
    from torch import nn

    emb_name, head_name = head_tensor_names(skeleton)
    wanted = [emb_name] + ([head_name] if head_name else [])
    try:
        tensors = read_tensors(folder, wanted)
    except HeadLoadError:
        if head_name is None:
            raise
        tensors = read_tensors(folder, [emb_name])  # lm_head not stored: tied in the checkpoint
        head_name = None
    w_emb = tensors[emb_name].to(device=device, dtype=dtype)
    src = skeleton.get_input_embeddings()
    embed = nn.Embedding(w_emb.shape[0], w_emb.shape[1], padding_idx=getattr(src, "padding_idx", None), device="meta")
    embed.weight = nn.Parameter(w_emb, requires_grad=False)
    head = nn.Linear(w_emb.shape[1], w_emb.shape[0], bias=False, device="meta")
    w_head = tensors[head_name].to(device=device, dtype=dtype) if head_name else embed.weight
    head.weight = w_head if isinstance(w_head, nn.Parameter) else nn.Parameter(w_head, requires_grad=False)
    return embed.requires_grad_(False), head.requires_grad_(False)


__all__ = [
    "HeadLoadError",
    "host_rss_mib",
    "has_safetensors",
    "target_skeleton",
    "head_tensor_names",
    "read_tensors",
    "load_embedding_and_head",
]
