"""Trains a DFlash block-diffusion drafter on a frozen target's hidden states: ``python -m gpudeck.trainers.dflash``.

Run under ``torchrun`` (or as one plain process). :class:`DFlashTrainer` runs on the loop the
trainers share (``trainers/common/loop.py``): it overrides the set-up, ``micro_batches`` (the
target's hidden states, computed on the rank or received from a target rank), the train step
(the drafter's, or a split target rank's production), the eval, the checkpoint, the export and
the finish. The recipe is SpecForge's
``OnlineDFlashModel`` (shared/research/trainers.md, section A); the drafter lives
in ``trainers/dflash/model.py`` and the objective in ``trainers/dflash/loss.py``.

Target
    ``--target PATH`` loads ``AutoModelForCausalLM.from_pretrained(PATH)`` (for
    instance ``OUT/final`` of ``gpudeck.trainers.fsdp_lm``); ``--target-config
    qwen3-0.6b|tiny|config.json`` (alias ``--model-config``) builds a
    random-weight target from a config instead (speed benchmarks). The target is
    frozen, in eval mode, and runs its base model only (no lm_head) under
    ``torch.no_grad`` with ``output_hidden_states=True`` (no_grad rather than
    inference_mode in the colocated topology because the features feed the
    drafter's trainable ``fc``; the split topology's target ranks and the
    evaluation's generation use inference_mode).

Drafter
    ``--drafter-config FILE`` gives a published drafter shape (SpecForge's
    ``configs/*-dflash.json``: ``layer_types`` of ``sliding_attention`` /
    ``full_attention`` with a ``sliding_window``, heads, ``intermediate_size``,
    ``block_size``, ``dflash_config.target_layer_ids`` and ``mask_token_id``); the
    width and vocabulary are the target's (a file that names others is refused).
    A sliding layer's block slot k sees the context ``a+k-W+1 .. a-1`` and its own
    block's slots ``0..k`` (SpecForge's mask); full layers see ``0..a-1`` and the
    whole block.
    ``--drafter-layers`` (1-5) Qwen3-style layers of the target's width,
    conditioned on ``build_target_layer_ids(L, n)`` target layers, sharing the
    target's embedding and lm_head (frozen, shared not copied). ``--init-from``
    starts the drafter from a saved drafter folder (``OUT/drafter``) and keeps its
    block size: without ``--block-size`` the saved one is used (said on stderr); a
    different ``--block-size`` is refused with exit 2 (``resolve_saved_shape``; the same for ``--drafter-layers``).

Step
    ``--num-anchors`` anchors per sequence (redrawn every step from the CPU RNG,
    which the checkpoint restores), blocks of ``--block-size``, decay gamma
    from ``decay_gamma`` (the published 7/5/4 for B=16/10/8; any other block
    size needs ``--gamma``), loss = sum(w*CE)/sum(w) through the chunked fused
    lm_head + CE (``--loss-chunk-rows``, ``--loss-mode``), normalised by the
    weight of every supervised position of the step over all drafter ranks and
    micro-batches (``dflash_loss.finish_global_mean``, SpecForge's rule).
    All blocks go through the drafter in one pass with one dense bool mask
    (SDPA) or a flex-attention block mask (``--attn flex``, CUDA only; the
    default ``auto`` picks flex on CUDA: it skips the masked-out key blocks,
    which the dense mask computes and throws away — on one H200 it took the
    step from 341 ms to 210 ms, bench/RESULTS-dflash.md).
    ``loss_mask`` is all ones for plain text (no prompt/response split, so every
    position is supervised). A ``--data`` JSONL file whose records are
    ``{"prompt": ..., "response": ...}`` is read as the references read theirs
    (``trainers/dflash/data.py``): one sample per record, truncated to
    ``--seq-len`` and padded, mask 0 on the prompt (``--loss-on-prompt``: 1) and
    on padding, 1 on the response + EOS; no record is split or packed with
    another. Batches are ``--batch-size`` records padded to ``--seq-len``, or with
    ``--token-budget N`` as many whole records as fit ``count x padded length <=
    N`` (deterministic per seed and epoch, resumed exactly). Anchors are drawn
    only where ``mask[t]`` and ``mask[t+1]`` are set. The mask token follows
    SpecForge's order (``resolve_mask_token``; the manifest's ``mask_token_source``).

Topologies
    ``colocated``: every rank runs the target and the drafter; the drafter is
    FSDP2-sharded over all ranks; data is sharded over all ranks. A plain
    process (no torchrun) gets a one-rank group, so the same FSDP2 path (with
    its bf16 mixed precision on GPU) applies. ``--compile`` compiles each
    drafter layer and each target decoder layer.
    ``split``: a drafter rank does not load the target: with ``--target PATH`` it reads
    only the embedding and lm_head by tensor name from the target's safetensors
    (memory-mapped; ``trainers/dflash/weights.py``), so its host RAM holds no
    transformer weights (the manifest's ``target_load`` and ``host_rss_*_mib`` say so).
    ``--target-ranks`` (e.g. ``0,1`` or ``0-1``) only run the target
    and ``--drafter-ranks`` only the drafter (FSDP2 over a ``dist.new_group`` of
    them). Global batch ``g = (step*grad_accum + micro)*n_drafter + j`` goes to
    drafter ``j`` and is produced by target ``g % n_target``. Target ranks send
    ``input_ids|loss_mask`` and the concatenated features with ``dist.isend``;
    at most ``--queue-depth`` sends are outstanding per target rank (the bounded
    queue: the oldest is waited for before a new one is posted), and each
    drafter rank keeps up to ``--queue-depth`` ``irecv``s posted ahead. The
    ``queue_depth`` telemetry field is, on a drafter rank, how many received
    batches were ready when a step began, and on a target rank how many of its
    sends were still in flight. No p2p is in flight across a checkpoint (both
    sides stop at the checkpoint boundary), so checkpoints are plain collectives
    over all ranks. On resume, each target rank fast-forwards its data stream to
    the batches it already produced (the position is a function of the step).

Stopping (SIGTERM/SIGINT; ``runtime.install_stop_flag``, as in ``gpudeck.trainers.fsdp_lm``)
    gpudeck's agent sends SIGTERM to every process (torchrun forwards its own too),
    then SIGKILLs after a grace period. The signal only sets a flag; all ranks agree
    on one step to stop after, save a checkpoint there, skip the final eval and the
    drafter export (``result.json`` says ``stopped: true``), emit ``done`` with
    ``reason`` ``"stopped"`` and exit 0; ``--resume latest`` continues from it.
    Colocated: the flag rides on the per-step loss all-reduce
    (``dflash_loss.finish_global_mean``), so the job stops after the current step.
    Split: asynchronous votes on their own gloo group, decided ``--queue-depth``
    steps later (``_SplitStopVotes``), so the target ranks still run ahead and no
    receive is ever posted past the stop step.

Evaluation (``eval`` records, every ``--eval-every`` steps, at start and end)
    Held-out prompts (the tail of the token stream, never trained on) of
    ``--eval-prompt-len`` tokens are continued greedily by the target for
    ``--eval-gen-len`` tokens, once (the target is frozen). Because the
    continuation is the target's own greedy output, the target's greedy token
    after any prefix of it is the next token of the sequence, so block
    verification reduces to comparing the drafter's argmax with the sequence.
    The decoding walk starts at the last prompt token as anchor, accepts the
    longest matching prefix of the B-1 drafted tokens plus one bonus token, and
    moves the anchor to the bonus token; ``tau`` = generated tokens per target
    verification (mean accepted + 1), as in DFlash. ``tau_all_anchors`` is the
    same quantity averaged over every anchor position.

Output
    ``OUT/checkpoints/step_N`` (gpudeck.trainers.common.checkpoint; drafter + optimizer +
    scheduler + data position + RNG + step), ``OUT/drafter/`` (save_pretrained,
    config with block_size, target_layer_ids, mask token id; plus ``dflash.py``
    so it loads with trust_remote_code), ``OUT/result.json`` (final_step, stopped,
    drafter_dir, eval_first, eval_last, topology, world_size).

``--profile-steps A-B`` runs torch.profiler over those steps and writes
``OUT/profile/rank<r>.txt``: the step's phases (``dflash.target_forward``,
``dflash.drafter_forward``, ``dflash.lm_head_loss``, ``dflash.drafter_backward``,
``dflash.anchors_and_masks``) and the top ops by device time, which is where an MFU
short of its goal is looked for.

MFU counts, per step and device, the work required (``mfu_convention`` in the manifest):
the target's forward over only the layers the features need (``hidden_states[id + 1]``
up to the largest target layer id; the layers after it are dropped once the eval set is
built, ``truncate_target``), ``2*N_layers_run`` per context token plus attention
``2*L_run*heads*2*head_dim*S`` per token under torchtitan's convention
(``mfu_torchtitan``) and half of it under the causal one (``mfu``, the headline); the
lm_head is not run. Drafter (the same under both): ``6*N_layers`` per block position,
``6*(fc + context k/v projections)`` per context token, attention
``12*heads*head_dim*(visible keys)`` per block position and layer (a full layer sees
anchor + B keys, a sliding one at most its window; ``dflash_loss.visible_keys``, not the
dense mask's S + N*B), and ``4*V*H`` per supervised lm_head row (the lm_head is frozen:
forward plus input gradient, no weight gradient).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudeck.trainers.checkpoint_trust import CheckpointTrustError
from gpudeck.trainers.common import runtime
from gpudeck.trainers.common.diagnostics import install_flight_recorder_dump, install_stack_dump, step_clock
from gpudeck.trainers.common.limits import read_config_json
from gpudeck.trainers.common.loop import Trainer
from gpudeck.trainers.dflash.config import DFlashConfig, drafter_config_from_file, parse_args, parse_rank_list

ROLE_COLOCATED, ROLE_TARGET, ROLE_DRAFTER = "colocated", "target", "drafter"


# ------------------------------------------------------------------ target


def _preset_config(spec: str):
    """A transformers config from a preset name (tiny, qwen3-0.6b, ...) or a config.json / folder.

    Uses fsdp_lm's preset table and config loader (one source of truth for presets).
    """
    from gpudeck.trainers.fsdp_lm.trainer import build_config

    return build_config(spec, None)


def load_target(args, device, dtype):
    """The frozen target (eval, no grad) on ``device``; from_pretrained or a random config."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.target:
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
        model.to(device)
    else:
        cfg = _preset_config(args.target_config)
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval().requires_grad_(False)
    return model


def compile_target(model) -> None:
    """Per-block compile of the frozen target (its forward is a large share of the step).

    Done after the eval set and ``truncate_target``, so that the compiled blocks first see
    the training shapes.
    """
    for layer in getattr(model.base_model, "layers", []):
        layer.compile()


def target_features(target, input_ids, layer_ids):
    """Concatenated hidden_states[id + 1] of the base model: [b, S, n*H] (no lm_head)."""
    from gpudeck.trainers.dflash.model import extract_context

    out = target.base_model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    return extract_context(out.hidden_states, layer_ids)


def resolve_mask_token(explicit: int | None, drafter_cfg: dict[str, Any] | None, tokenizer, vocab: int) -> tuple[int, str]:
    """(mask token id, where it came from): SpecForge's ``resolve_mask_token_id`` order.

    The explicit ``--mask-token-id``, the drafter config's ``dflash_config.mask_token_id``, the
    tokenizer's mask token, the first embedding slot the tokenizer does not use
    (``len(tokenizer)``, when the embedding is larger), then the tokenizer's pad and eos tokens;
    the first candidate inside the embedding (``0 <= id < vocab``) wins. An explicit id outside
    it is an error, not skipped.
    """
    if explicit is not None:
        if not 0 <= int(explicit) < vocab:
            raise ValueError(f"--mask-token-id {explicit} is outside the target's embedding (0..{vocab - 1})")
        return int(explicit), "--mask-token-id"
    size = getattr(tokenizer, "vocab_size", None)
    candidates = [
        ("drafter config dflash_config.mask_token_id", ((drafter_cfg or {}).get("dflash_config") or {}).get("mask_token_id")),
        ("tokenizer mask token", getattr(tokenizer, "mask_id", None)),
        ("first unused embedding slot len(tokenizer)", size if size is not None and size < vocab else None),
        ("tokenizer pad token", getattr(tokenizer, "pad_id", None)),
        ("tokenizer eos token", getattr(tokenizer, "eos_id", None)),
    ]
    for source, cand in candidates:
        if cand is not None and 0 <= int(cand) < vocab:
            return int(cand), source
    raise ValueError(f"no mask token inside the target's embedding (0..{vocab - 1}); give --mask-token-id")


# ------------------------------------------------------------------ flops


MFU_CONVENTION = (
    "mfu: causal convention (the target's attention FLOPs halved: a causal token attends to the ones "
    "before it; the drafter's attention counts the keys its masks let through); mfu_torchtitan: the "
    "target's attention over the whole sequence (torchtitan's 12*L*H*d_head*S, forward third), the "
    "drafter's the same; both count only the target layers the features need"
)


class TargetFlops:
    """Forward FLOPs of the target layers the drafter's features need (the lm_head is never run)."""

    def __init__(self, target, layer_ids: list[int]) -> None:
        from gpudeck.trainers.common.flops import attention_dims

        layers = list(getattr(target.base_model, "layers", []))
        _, heads, hd = attention_dims(target.config)
        self.layers_needed = needed_target_layers(layer_ids)
        self.dense = 2.0 * sum(p.numel() for layer in layers[: self.layers_needed] for p in layer.parameters())
        self.attn_coeff = 2.0 * self.layers_needed * heads * 2 * hd  # x S per token: torchtitan's, full

    def batch(self, b: int, length: int) -> tuple[float, float]:
        """(causal, torchtitan) FLOPs of a [b, length] batch."""
        tokens = float(b * length)
        return (tokens * (self.dense + self.attn_coeff * length / 2.0), tokens * (self.dense + self.attn_coeff * length))


def needed_target_layers(layer_ids: list[int]) -> int:
    """Target layers the features need: ``hidden_states[id + 1]`` is layer ``id``'s output."""
    return max(layer_ids) + 1


def truncate_target(target, layer_ids: list[int], device) -> int:
    """Drop the target layers after the last one the features need; returns the layers kept.

    The base model's last hidden state is the final norm's output, so with the tail cut off the
    norm is replaced by the identity (the kept layers' outputs are then the raw hidden states, as
    before). Checked on a short probe against the full model; anything else (another model
    layout) keeps the whole target.
    """
    import torch

    base = target.base_model
    layers = getattr(base, "layers", None)
    need = needed_target_layers(layer_ids)
    if layers is None or not hasattr(base, "norm") or need >= len(layers):
        return len(layers) if layers is not None else int(target.config.num_hidden_layers)
    probe = torch.arange(8, device=device).remainder(int(target.config.vocab_size)).unsqueeze(0)
    with torch.no_grad():
        want = target_features(target, probe, layer_ids)
        full_layers, norm = base.layers, base.norm
        base.layers, base.norm = full_layers[:need], torch.nn.Identity()
        got = target_features(target, probe, layer_ids)
    if got.shape != want.shape or not torch.equal(got, want):
        base.layers, base.norm = full_layers, norm
        return len(full_layers)
    return need


def drafter_step_flops(dcfg, n_layer_params: int, n_fc: int, seq_len: int, anchors, n_rows: int, vocab: int) -> float:
    """Required drafter FLOPs of one micro-batch (see module docstring).

    Attention counts the keys each block query sees: a full layer ``anchor + B``, a sliding
    layer at most its window (``dflash_loss.visible_keys``).
    """
    from gpudeck.trainers.dflash.loss import visible_keys
    from gpudeck.trainers.dflash.model import SLIDING_ATTENTION, attention_layout

    bsz, n = anchors.shape
    bs = dcfg.block_size
    hd = dcfg.head_dim
    h = dcfg.hidden_size
    kv = dcfg.num_key_value_heads
    positions = bsz * n * bs
    dense = 6.0 * n_layer_params * positions
    ctx = 6.0 * (n_fc + dcfg.num_hidden_layers * 2 * h * kv * hd) * bsz * seq_len
    types, window = attention_layout(dcfg)
    seen = {t: visible_keys(anchors, bs, window if t == SLIDING_ATTENTION else None) for t in set(types)}
    attn = 12.0 * dcfg.num_attention_heads * hd * sum(seen[t] for t in types)
    head = 4.0 * vocab * h * n_rows
    return dense + ctx + attn + head


# ------------------------------------------------------------------ evaluation


def build_eval_set(target, val_tokens, args: DFlashConfig, layer_ids: list[int], device):
    """Prompts from held-out tokens + the target's greedy continuation: (ids [E, P+G], feats)."""
    import torch

    from gpudeck.trainers.common.data import PackedDataset

    p_len, g_len = args.eval_prompt_len, args.eval_gen_len
    ds = PackedDataset(val_tokens, p_len)
    if len(ds) < 1:
        raise ValueError(f"held-out data too small for one eval prompt of {p_len} tokens")
    e = min(args.eval_samples, len(ds))
    step = max(1, len(ds) // e)
    prompts = torch.stack([torch.from_numpy(ds[i * step][:p_len]) for i in range(e)]).to(device)
    with torch.inference_mode():
        gen = target.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=g_len,
            min_new_tokens=g_len,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        gen = gen[:, : p_len + g_len]
        feats = target_features(target, gen, layer_ids)
    return gen.clone(), feats.clone()


def evaluate_tau(
    drafter, embed, lm_head_w, ids, feats, prompt_len: int, block_size: int, mask_token_id: int, attn: str = "sdpa"
) -> dict[str, float]:
    """Greedy block verification against the target's greedy sequence (see module docstring)."""
    import torch

    from gpudeck.trainers.dflash.loss import block_inputs

    e, t = ids.shape
    first, last = prompt_len - 1, t - block_size
    if last < first:
        raise ValueError("eval sequence shorter than one block after the prompt")
    anchors = torch.arange(first, last + 1, device=ids.device).unsqueeze(0).expand(e, -1).contiguous()
    was_training = drafter.training
    drafter.eval()
    with torch.no_grad():
        bids, bpos = block_inputs(ids, anchors, block_size, mask_token_id)
        pos = torch.cat([torch.arange(t, device=ids.device).unsqueeze(0).expand(e, -1), bpos], 1)
        mask = make_masks(anchors, t, block_size, attn, ids.device, drafter.layer_types, drafter.sliding_window)
        hid = drafter(embed(bids), feats, pos, mask)
        n = anchors.shape[1]
        pred = (hid.reshape(e, n, block_size, -1)[:, :, 1:] @ lm_head_w.t()).argmax(-1)
        lab_pos = anchors.unsqueeze(-1) + torch.arange(1, block_size, device=ids.device)
        labels = torch.gather(ids, 1, lab_pos.reshape(e, -1)).reshape(e, n, block_size - 1)
        acc = (pred == labels).long().cumprod(-1).sum(-1).cpu()  # accepted drafted tokens per anchor
    drafter.train(was_training)
    walk = []
    for i in range(e):
        a = first
        while a <= last:
            t_i = int(acc[i, a - first]) + 1
            walk.append(t_i)
            a += t_i
    return {
        "tau": float(sum(walk) / max(1, len(walk))),
        "tau_all_anchors": float((acc.float() + 1).mean()),
        "eval_blocks": len(walk),
        "eval_sequences": e,
    }


def _make_mask(anchors, seq_len, block_size, attn, device, sliding_window=None):
    """One layer type's mask: dense bool (SDPA) or a flex BlockMask; a window makes it the sliding one."""
    from gpudeck.trainers.dflash.loss import build_attention_mask

    if attn != "flex":
        return build_attention_mask(anchors, seq_len, block_size, sliding_window)
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, n = anchors.shape
    q_len = n * block_size
    w = None if sliding_window is None else int(sliding_window)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        anchor = anchors[b, blk]
        ctx_ok = (kv_idx < seq_len) & (kv_idx < anchor)
        own = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == blk)
        if w is not None:
            off = q_idx % block_size
            ctx_ok = ctx_ok & (kv_idx >= anchor + off - (w - 1))
            own = own & ((kv_idx - seq_len) % block_size <= off)
        return ctx_ok | own

    # eager construction: the anchors change every step, and a compiled mask builder would
    # recompile for every new closure
    return create_block_mask(mask_mod, bsz, None, q_len, seq_len + q_len, device=device)


def make_masks(anchors, seq_len, block_size, attn, device, layer_types, sliding_window):
    """The drafter's attention mask: one mask when every layer is full, else one per layer type."""
    from gpudeck.trainers.dflash.model import FULL_ATTENTION, SLIDING_ATTENTION

    full = _make_mask(anchors, seq_len, block_size, attn, device)
    if SLIDING_ATTENTION not in layer_types:
        return full
    return {FULL_ATTENTION: full, SLIDING_ATTENTION: _make_mask(anchors, seq_len, block_size, attn, device, sliding_window)}


# ------------------------------------------------------------------ stopping (split topology)


class _SplitStopVotes:
    """Split topology: every rank agrees on the step to stop at, without a barrier per step.

    Colocated ranks fold the stop vote into the per-step loss all-reduce
    (``dflash_loss.finish_global_mean``). Split target ranks run ahead of the drafter
    ranks (the queue), so a blocking vote per step would serialise them. Instead, at
    the end of step s every rank posts an asynchronous all-reduce (SUM, on its own
    gloo group) of its stop flag, and step s is the last one when the vote of step
    ``s - lag`` says that some rank was asked to stop. With ``lag = queue depth`` a
    drafter rank knows whether step s is the last before it posts any receive for
    step s+1 (it never looks further ahead than that), so no point-to-point message
    is left unmatched; a target rank can run at most ``lag`` steps ahead of the
    drafters. A signal thus stops the job ``lag``+1 steps later at most (or the run
    ends first at --max-steps, normally).
    """

    def __init__(self, group, lag: int, flag: runtime.StopFlag) -> None:
        self.group, self.lag, self.flag = group, max(1, int(lag)), flag
        self.posted: dict[int, tuple[Any, Any]] = {}  # step -> (tensor, async work)
        self.start = 0  # the run's first step is start + 1 (set by begin)
        self.decided: dict[int, bool] = {}

    def begin(self, start: int) -> None:
        self.start = start

    def post(self, step: int) -> None:
        """This rank's vote of ``step`` (call once per step, in order, on every rank)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0 if self.flag.requested else 0.0])
        self.posted[step] = (t, dist.all_reduce(t, group=self.group, async_op=True))

    def is_last(self, step: int) -> bool:
        """Whether the ranks stop after ``step``; waits for the vote of ``step - lag`` if needed."""
        if step not in self.decided:
            vote = step - self.lag
            if vote in self.posted:
                t, work = self.posted.pop(vote)
                work.wait()
                self.decided[step] = float(t.item()) > 0
            else:
                # only votes from before this run's start are missing (a later one would mean
                # this rank asks about a step more than lag steps ahead of its own progress)
                assert vote <= self.start, (step, vote, self.start)
                self.decided[step] = False
        return self.decided[step]

    def finish(self) -> None:
        """Wait for the votes still in flight (every rank posted the same ones)."""
        for _, work in self.posted.values():
            work.wait()
        self.posted.clear()


class _NoVotes:
    """Colocated topology: the stop vote rides on the loss all-reduce; nothing to do here."""

    def begin(self, start: int) -> None:
        pass

    def post(self, step: int) -> None:
        pass

    def is_last(self, step: int) -> bool:
        return False

    def finish(self) -> None:
        pass


# ------------------------------------------------------------------ the trainer


@dataclass(frozen=True, slots=True)
class FeatureBatch:
    """One drafter micro-batch: the tokens, their loss mask and the target's features for them.

    ``target_flops`` (causal, torchtitan) and ``target_s`` are what the target's forward cost on
    this rank (colocated; zero when the features came from a target rank); ``ready`` is, on a split
    drafter rank, how many received batches were complete when this one was taken.
    """

    ids: Any
    loss_mask: Any
    feats: Any
    target_flops: tuple[float, float] = (0.0, 0.0)
    target_s: float = 0.0
    ready: int | None = None


class DFlashTrainer(Trainer):
    """DFlash on the shared loop (``trainers/common/loop.py``): the steps it overrides read the target's hidden states.

    Set-up builds the roles, data, target, drafter and optimizer and resumes; :meth:`micro_batches` are
    the drafter's micro-batches (the target's features, computed here or received from a target
    rank); :meth:`train_step` is the drafter's step, or on a split target rank the production of its
    batches; :meth:`validate` is the tau evaluation; :meth:`save` the checkpoint; :meth:`export`
    the final evaluation and the drafter; :meth:`finish` ``result.json`` and ``done``.
    """

    cfg: DFlashConfig

    def __init__(self, cfg: DFlashConfig, argv: list[str]) -> None:
        super().__init__(cfg)  # typed and frozen: what this trainer derives lives on the trainer (batch_size, attn, layer_ids)
        self.argv = argv
        self.batch_size = cfg.batch_size  # a plain-text corpus with --token-budget packs budget // seq_len windows
        self.start_step = 0  # the step this run started from (a resume's)
        self.first_eval: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None
        self.inbox: deque = deque()  # split drafter rank: the receives posted, oldest first
        self.receive_plan: Iterator[tuple[int, int, int]] | None = None  # split drafter rank: what to receive up to the next boundary
        self.sends: deque = deque()  # split target rank: the sends in flight, oldest first
        self.profiler: Any = None  # --profile-steps A-B: torch.profiler from step A to step B

    # ---- setup -------------------------------------------------------
    def setup(self) -> None:
        """Processes and roles, the start plan, data, target and drafter, optimizer, a resume's checkpoint, the manifest, the first eval."""
        # SIGTERM/SIGINT from here on only ask for a stop (checkpoint, done "stopped", exit 0)
        self.stop = runtime.install_stop_flag()
        self._start()
        self._setup_data()
        self._setup_models()
        self._setup_optim()
        if not self.plan.fresh:
            if self.plan.step is None:
                raise RuntimeError("the start plan resumes but names no checkpoint step")
            self.step = self.start_step = self.last_saved = self.load(self.plan.step)
        self.manifest()
        self.peak, self.peak_reason = self._peak()
        self.t0 = time.perf_counter()
        self.votes.begin(self.step)
        if self.is_drafter and not self.cfg.no_eval:
            self.eval(self.step)

    def _start(self) -> None:
        """Process group, telemetry, triage hooks, dtype and attention, the ranks' roles, the start plan, the seeds."""
        import torch

        from gpudeck.trainers.common import checkpoint as ckpt
        from gpudeck.trainers.common.telemetry import Telemetry

        cfg = self.cfg
        self.ctx = ctx = runtime.init_distributed(cfg.device, single_process_group=True)
        self.tel = Telemetry(rank=ctx.rank)
        runtime.register(ctx=ctx, telemetry=self.tel)
        self.tel.start_heartbeat()
        self.device = ctx.device
        # gpudeck's triage: every thread's stack on SIGUSR2, the Flight Recorder as JSON on the agent's request
        self.diag_fields = install_stack_dump(ctx.rank)
        self.diag_fields.update(install_flight_recorder_dump(ctx.rank))
        self.clock = step_clock(self.device.type == "cuda")  # a step's compute vs collective-wait seconds
        if cfg.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        self.attn = cfg.attn if cfg.attn != "auto" else ("flex" if self.device.type == "cuda" else "sdpa")
        if self.attn == "flex" and self.device.type != "cuda":
            raise runtime.ExitWith(2, "--attn flex needs CUDA; use --attn sdpa on CPU")
        self._assign_roles()
        # start plan (read-only; every rank agrees)
        try:
            self.plan = ckpt.resolve_start(cfg.out, cfg.fresh, cfg.resume, cfg.new_run_dir, trust=cfg.trust_checkpoint)
        except (ckpt.StartError, CheckpointTrustError) as exc:
            raise runtime.ExitWith(2, str(exc)) from None
        if self.plan.archive_existing and ctx.rank == 0:
            ckpt.archive_checkpoints(cfg.out)
        runtime.barrier(ctx)
        runtime.seed_all(cfg.seed)

    def _assign_roles(self) -> None:
        """Which ranks run the target and which the drafter (colocated: all both), the drafter's group, the stop votes."""
        import torch.distributed as dist

        cfg, ctx = self.cfg, self.ctx
        world = ctx.world_size
        if cfg.topology == "colocated":
            self.target_ranks = list(range(world))
            self.drafter_ranks = list(range(world))
            self.role = ROLE_COLOCATED
        else:
            self.target_ranks = parse_rank_list(cfg.target_ranks or "")  # check_args: split names both
            self.drafter_ranks = parse_rank_list(cfg.drafter_ranks or "")
            if set(self.target_ranks) & set(self.drafter_ranks) or sorted(self.target_ranks + self.drafter_ranks) != list(range(world)):
                raise runtime.ExitWith(
                    2,
                    f"split: --target-ranks {self.target_ranks} and --drafter-ranks "
                    f"{self.drafter_ranks} must be disjoint and cover ranks 0..{world - 1}",
                )
            if world < 2:
                raise runtime.ExitWith(2, "--topology split needs torchrun with at least 2 processes")
            self.role = ROLE_TARGET if ctx.rank in self.target_ranks else ROLE_DRAFTER
        self.is_target = self.role in (ROLE_COLOCATED, ROLE_TARGET)
        self.is_drafter = self.role in (ROLE_COLOCATED, ROLE_DRAFTER)
        self.drafter_group = None
        if ctx.distributed:
            if cfg.topology == "split":
                self.drafter_group = dist.new_group(ranks=self.drafter_ranks)
            else:
                self.drafter_group = dist.group.WORLD
        # split: the stop votes travel on their own gloo group, a few steps behind (_SplitStopVotes)
        self.votes = _SplitStopVotes(dist.new_group(backend="gloo"), cfg.queue_depth, self.stop) if cfg.topology == "split" else _NoVotes()
        self.d_index = self.drafter_ranks.index(ctx.rank) if self.is_drafter else None
        self.t_index = self.target_ranks.index(ctx.rank) if self.is_target else None
        self.lead_drafter = self.drafter_ranks[0]

    def _target_index(self) -> int:
        """This target rank's index among the data consumers; only target ranks read batches."""
        if self.t_index is None:
            raise RuntimeError(f"rank {self.ctx.rank} is not a target rank: it has no data consumer index")
        return self.t_index

    def _setup_data(self) -> None:
        from gpudeck.trainers.common.data import PackedDataset, ShardedBatches, load_tokens, split_tokens
        from gpudeck.trainers.common.tokenizer import has_tokenizer, load_tokenizer
        from gpudeck.trainers.dflash.data import RecordBatches, load_records, max_batch_tokens

        cfg = self.cfg
        tok_spec = cfg.tokenizer
        if tok_spec is None and cfg.target and has_tokenizer(cfg.target):
            tok_spec = cfg.target
        self.tokenizer = load_tokenizer(tok_spec)
        self.records = None
        try:
            records = load_records(cfg.data, self.tokenizer, cfg.seq_len, cfg.loss_on_prompt) if cfg.data else None
        except ValueError as exc:
            raise runtime.ExitWith(2, str(exc)) from None
        n_consumers = len(self.target_ranks)
        if records is not None:
            # one sample per record (the references' treatment): no packing, no context across records
            train, held = records.split(cfg.val_fraction)
            self.records = train
            self.val_tokens = held.concatenated()
            self.loss_mask_desc = (
                "per record: "
                + ("1 on prompt and response" if cfg.loss_on_prompt else "0 on prompt tokens, 1 on response tokens + EOS")
                + ", 0 on padding"
            )
            self.data_desc = (
                f"{records.source}: {len(records)} prompt/response records kept ({records.truncated} "
                f"truncated to {cfg.seq_len} tokens, {records.dropped} dropped without two "
                f"consecutive supervised tokens), {records.num_tokens} tokens, "
                f"{records.supervised_tokens} supervised"
            )
            self.batching_desc = (
                f"token budget {cfg.token_budget}: whole records, count x padded length <= budget"
                if cfg.token_budget
                else f"{cfg.batch_size} records per batch, padded to {cfg.seq_len}"
            )
            self.dataset_samples, self.dataset_tokens = len(train), train.num_tokens
            self.loader: RecordBatches | ShardedBatches | None = None
            if self.is_target:
                try:
                    self.loader = RecordBatches(
                        train, cfg.batch_size, self._target_index(), n_consumers, seed=cfg.seed, token_budget=cfg.token_budget
                    )
                except ValueError as exc:
                    raise runtime.ExitWith(2, str(exc)) from None
            self.capacity = max_batch_tokens(cfg.batch_size, cfg.seq_len, cfg.token_budget)
            return
        src = load_tokens(cfg.data, self.tokenizer, dtype=cfg.data_dtype, max_bytes=cfg.corpus_bytes)
        train_tokens, val = split_tokens(src.tokens, cfg.val_fraction)
        self.loss_mask_desc = "all ones (plain text)"
        self.data_desc = src.description
        self.train_ds = PackedDataset(train_tokens, cfg.seq_len)
        self.dataset_samples, self.dataset_tokens = len(self.train_ds), self.train_ds.num_tokens
        if cfg.token_budget:
            self.batch_size = max(1, cfg.token_budget // cfg.seq_len)
        self.batching_desc = f"{self.batch_size} packed windows of {cfg.seq_len} tokens per batch"
        self.val_tokens = val
        self.loader = None
        if self.is_target:
            self.loader = ShardedBatches(self.train_ds, self.batch_size, self._target_index(), n_consumers, seed=cfg.seed)
        self.capacity = self.batch_size * cfg.seq_len

    def _setup_models(self) -> None:
        import torch

        from gpudeck.trainers.common.flops import count_params
        from gpudeck.trainers.dflash.model import attention_layout

        cfg = self.cfg
        from gpudeck.trainers.dflash.weights import has_safetensors, host_rss_mib, load_embedding_and_head, target_skeleton

        # target ranks load the whole target and run it; a split drafter rank needs only its
        # embedding and lm_head: read by name from the safetensors (a meta-device skeleton gives
        # the config and counts), never the whole target (trainers/dflash/weights.py)
        self.rss_before_models = host_rss_mib()
        self.embed = self.lm_head = None
        if not self.is_target and cfg.target and has_safetensors(cfg.target):
            target = target_skeleton(cfg.target, self.dtype)
            self.embed, self.lm_head = load_embedding_and_head(cfg.target, target, self.device, self.dtype)
            self.head_load = "embedding and lm_head only, by tensor name from the target's safetensors (mmap)"
        else:
            where = self.device if self.is_target else torch.device("cpu")
            target = load_target(cfg, where, self.dtype)
            self.head_load = (
                "whole target (a random-weight target is built whole to match the target ranks)"
                if not self.is_target
                else "whole target (this rank runs it)"
            )
        self.target_config = target.config
        self.target_params_total = count_params(target)[0]
        self.dcfg = self._drafter_config(target)
        self.block_size = int(self.dcfg.block_size)
        from gpudeck.trainers.dflash.gamma import decay_gamma

        self.gamma = decay_gamma(self.block_size, cfg.gamma)
        self.layer_types, self.sliding_window = attention_layout(self.dcfg)
        self.layer_ids = list(self.dcfg.dflash_config["target_layer_ids"])
        self.mask_token_id = int(self.dcfg.dflash_config["mask_token_id"])
        self.n_ctx = len(self.layer_ids)
        self.hidden = int(self.dcfg.hidden_size)
        self.vocab = int(target.config.vocab_size)
        self.target_flops = TargetFlops(target, self.layer_ids)

        # eval set: computed once by a target rank (colocated: every rank; split: the first
        # target rank, sent to the drafters) — the target is frozen, so it never changes
        self.eval_ids = self.eval_feats = None
        if not cfg.no_eval:
            self._setup_eval(target)

        if self.is_drafter and self.embed is None:
            self.embed = target.get_input_embeddings().to(self.device)
            self.lm_head = target.get_output_embeddings().to(self.device)
        self.target_layers_run = None
        if self.is_target:
            # after the eval set (its greedy continuation needs the whole target and its lm_head)
            self.target_layers_run = truncate_target(target, self.layer_ids, self.device)
            if cfg.compile:
                compile_target(target)
        self.target = target if self.is_target else None
        if not self.is_target:
            del target
        self.rss_after_target = host_rss_mib()

        self.drafter = self._build_drafter() if self.is_drafter else None
        # the anchor RNG (global CPU RNG) differs per rank; restored exactly by checkpoints
        torch.manual_seed(cfg.seed * 1000003 + self.ctx.rank + 1)

    def _drafter_config(self, target: Any) -> Any:
        """The drafter's config: the saved drafter's (--init-from), the --drafter-config file's, or spaced over the target."""
        from gpudeck.trainers.dflash.model import DFlashDraftModel, drafter_config_from_target

        cfg = self.cfg
        saved_cfg = cfg.drafter_cfg
        if cfg.init_from:
            saved_cfg = read_config_json(Path(cfg.init_from) / "config.json", f"--init-from {cfg.init_from}")
        tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        try:
            mask_id, self.mask_token_source = resolve_mask_token(cfg.mask_token_id, saved_cfg, self.tokenizer, int(tc.vocab_size))
        except ValueError as exc:
            raise runtime.ExitWith(2, str(exc)) from None
        if (
            saved_cfg is not None
            and cfg.init_from
            and cfg.mask_token_id is not None
            and mask_id != int(saved_cfg["dflash_config"]["mask_token_id"])
        ):
            raise runtime.ExitWith(
                2,
                f"--mask-token-id {mask_id} differs from the mask token "
                f"{saved_cfg['dflash_config']['mask_token_id']} the drafter in --init-from "
                "was trained with; leave it out",
            )
        self.mask_token_id = int(mask_id)
        if cfg.init_from:
            dcfg = DFlashDraftModel.config_class.from_pretrained(cfg.init_from)
        elif cfg.drafter_cfg is not None:
            try:
                dcfg = drafter_config_from_file(cfg.drafter_cfg, target.config, cfg.block_size, self.mask_token_id)
            except ValueError as exc:
                raise runtime.ExitWith(2, str(exc)) from None
        else:
            dcfg = drafter_config_from_target(target.config, cfg.drafter_layers, cfg.block_size, self.mask_token_id)
        return dcfg

    def _build_drafter(self) -> Any:
        """The drafter on this rank's device: new or --init-from's, checkpointed, compiled and sharded as asked."""
        import torch

        from gpudeck.trainers.common.flops import count_params
        from gpudeck.trainers.dflash.model import DFlashDraftModel

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        if cfg.init_from:
            drafter = DFlashDraftModel.from_pretrained(cfg.init_from, dtype=torch.float32)
        else:
            drafter = DFlashDraftModel(self.dcfg)
        drafter.to(self.device)
        drafter.train()
        self.n_layer_params = sum(p.numel() for p in drafter.layers.parameters())
        self.n_fc = drafter.fc.weight.numel()
        self.drafter_params = count_params(drafter)[1]
        if cfg.activation_checkpointing:
            drafter.gradient_checkpointing = True
        if cfg.compile:
            for layer in drafter.layers:
                layer.compile()
        if self.ctx.distributed:
            self._shard(drafter)
        return drafter

    def _shard(self, drafter) -> None:
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.drafter_group is None:
            raise RuntimeError("sharding the drafter needs its process group: run distributed (torchrun)")
        mesh = DeviceMesh.from_group(self.drafter_group, self.device.type)
        # the drafter is small next to the target: keep gathered params from forward to backward
        kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": False}
        if self.dtype == torch.bfloat16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in drafter.layers:
            fully_shard(layer, **kw)
        fully_shard(drafter, **kw)

    def _setup_eval(self, target) -> None:
        import torch
        import torch.distributed as dist

        cfg = self.cfg
        e_len = cfg.eval_prompt_len + cfg.eval_gen_len
        if self.is_target and (self.role == ROLE_COLOCATED or self.ctx.rank == self.target_ranks[0]):
            ids, feats = build_eval_set(target, self.val_tokens, cfg, self.layer_ids, self.device)
        else:
            ids = feats = None
        if self.role != ROLE_COLOCATED:
            src = self.target_ranks[0]
            if self.ctx.rank == src:
                shape = torch.tensor(list(feats.shape), dtype=torch.long)
                for d in self.drafter_ranks:
                    dist.send(shape.to(self._comm_device()), d)
                    dist.send(ids.to(self._comm_device()).contiguous(), d)
                    dist.send(feats.to(self._comm_device()).contiguous(), d)
            elif self.is_drafter:
                shape = torch.zeros(3, dtype=torch.long, device=self._comm_device())
                dist.recv(shape, src)
                e, t, c = (int(x) for x in shape.tolist())
                assert t == e_len, (t, e_len)
                ids = torch.empty((e, t), dtype=torch.long, device=self._comm_device())
                feats = torch.empty((e, t, c), dtype=self.dtype, device=self._comm_device())
                dist.recv(ids, src)
                dist.recv(feats, src)
        if self.is_drafter:
            self.eval_ids, self.eval_feats = ids.to(self.device), feats.to(self.device)

    def _comm_device(self):
        import torch

        return self.device if self.ctx.backend == "nccl" else torch.device("cpu")

    def _setup_optim(self) -> None:
        import torch

        cfg = self.cfg
        self.optimizer = self.scheduler = None
        if not self.is_drafter:
            return
        if self.drafter is None:
            raise RuntimeError("a drafter rank has no drafter: _setup_models must run before _setup_optim")
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        kw: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": (0.9, 0.95)}
        if self.device.type == "cuda":
            kw["fused"] = True
        self.optimizer = torch.optim.AdamW(params, **kw)
        warm = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, int(0.04 * cfg.max_steps))
        total, floor = cfg.max_steps, cfg.min_lr_ratio

        def lr_lambda(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            frac = min(1.0, (step - warm) / max(1, total - warm))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    # ---- manifest ----------------------------------------------------
    def manifest(self) -> None:
        from gpudeck.trainers.common.runtime import config_hash, device_info

        cfg = self.cfg
        info = device_info(self.device)
        if self.role == ROLE_TARGET:
            total, trainable = self.target_params_total, 0
        else:
            total, trainable = self.target_params_total + self.drafter_params, self.drafter_params
        self.tel.manifest(
            kind="dflash",
            role=self.role,
            topology=cfg.topology,
            params_total=total,
            params_trainable=trainable,
            drafter_params_trainable=(self.drafter_params if self.is_drafter else None),
            target_params_frozen=self.target_params_total,
            target=cfg.target or f"random weights from {cfg.target_config}",
            config_hash=config_hash(self.dcfg.to_dict()),
            world_size=self.ctx.world_size,
            target_ranks=self.target_ranks,
            drafter_ranks=self.drafter_ranks,
            device=info["device"] if info["device"] != "cpu" else "cpu",
            gpu_uuid=info["gpu_uuid"],
            gpu_name=info["gpu_name"],
            dataset_samples=self.dataset_samples,
            dataset_tokens=self.dataset_tokens,
            dataset=self.data_desc,
            loss_mask=self.loss_mask_desc,
            batching=self.batching_desc,
            token_budget=cfg.token_budget,
            loss_normalisation="sum(w*CE) / sum(w) over every drafter rank and micro-batch of the step",
            gamma=self.gamma,
            mfu_convention=MFU_CONVENTION,
            target_layers_needed=self.target_flops.layers_needed,
            target_layers_run=self.target_layers_run,
            block_size=self.block_size,
            drafter_layer_types=self.layer_types,
            drafter_sliding_window=self.sliding_window,
            drafter_config=cfg.drafter_config,
            target_load=self.head_load,
            host_rss_before_models_mib=self.rss_before_models["rss_mib"],
            host_rss_after_target_mib=self.rss_after_target["rss_mib"],
            host_rss_peak_after_target_mib=self.rss_after_target["rss_peak_mib"],
            num_anchors=cfg.num_anchors,
            target_layer_ids=self.layer_ids,
            mask_token_id=self.mask_token_id,
            mask_token_source=self.mask_token_source,
            batch_size=self.batch_size,
            seq_len=cfg.seq_len,
            argv=self.argv,
            start=self.plan.describe(),
            **(self.plan.trust.record() if self.plan.trust is not None else {}),
            pid=os.getpid(),
            compute_timing=self.clock.method,
            **self.diag_fields,
        )

    # ---- data flow ---------------------------------------------------
    def _batch_owner(self, g: int) -> tuple[int, int]:
        """(target index producing global batch g, drafter index consuming it)."""
        return g % len(self.target_ranks), g % len(self.drafter_ranks)

    def _global_batches(self, step: int) -> range:
        """Global batch indices of optimizer step ``step`` (1-based)."""
        per = self.cfg.grad_accum * len(self.drafter_ranks)
        return range((step - 1) * per, step * per)

    def _next_local_batch(self):
        import torch

        if self.records is not None:
            ids, lm = self.loader.next_batch()
            return torch.from_numpy(ids).to(self.device), torch.from_numpy(lm).to(self.device)
        idx = self.loader.next_indices()
        ids = torch.from_numpy(self.train_ds.gather(idx))[:, : self.cfg.seq_len].to(self.device)
        return ids, torch.ones_like(ids)

    def _pack(self, ids, lm, feats, cdev):
        """Split: one batch as the fixed-size message every batch uses (shapes vary with --token-budget).

        ``meta`` [2C+2] long: b, L, then ids and the loss mask flattened (C = ``self.capacity``
        tokens each); ``feats`` [C, n*H]. Fixed sizes keep NCCL's in-order p2p matching simple.
        """
        import torch

        b, length = ids.shape
        n, c = b * length, self.capacity
        meta = torch.zeros((2 * c + 2,), dtype=torch.long, device=cdev)
        meta[0], meta[1] = b, length
        meta[2 : 2 + n] = ids.reshape(-1).to(cdev)
        meta[2 + c : 2 + c + n] = lm.reshape(-1).to(cdev)
        buf = torch.zeros((c, feats.shape[-1]), dtype=self.dtype, device=cdev)
        buf[:n] = feats.reshape(n, -1).to(device=cdev, dtype=self.dtype)
        return meta, buf

    def _unpack(self, meta, feats):
        b, length = int(meta[0]), int(meta[1])
        n, c = b * length, self.capacity
        ids = meta[2 : 2 + n].view(b, length).to(self.device)
        lm = meta[2 + c : 2 + c + n].view(b, length).to(self.device)
        return ids, lm, feats[:n].view(b, length, -1).to(self.device)

    def _skip_local_batch(self) -> None:
        from gpudeck.trainers.dflash.data import RecordBatches

        if self.loader is None:
            raise RuntimeError(f"rank {self.ctx.rank} has no batch loader: only target ranks read batches")
        if self.records is not None:
            if not isinstance(self.loader, RecordBatches):
                raise RuntimeError("records were loaded but the loader is not a RecordBatches")
            self.loader.next_batch_plan()
        else:
            if isinstance(self.loader, RecordBatches):
                raise RuntimeError("plain tokens were loaded but the loader is a RecordBatches")
            self.loader.next_indices()

    def _fast_forward(self, start_step: int) -> None:
        """Split: advance this target rank's stream past the batches it produced before start_step."""
        per = self.cfg.grad_accum * len(self.drafter_ranks)
        n_t = len(self.target_ranks)
        produced = sum(1 for g in range(start_step * per) if g % n_t == self.t_index)
        for _ in range(produced):
            self._skip_local_batch()

    # ---- checkpoints -------------------------------------------------
    def _extra(self, step: int) -> dict[str, Any]:
        import torch.distributed as dist

        sched = self.scheduler.state_dict() if self.scheduler is not None else None
        data = self.loader.state_dict() if self.loader is not None else None
        extra: dict[str, Any] = {
            "step": step,
            "topology": self.cfg.topology,
            "target_layer_ids": self.layer_ids,
            "block_size": self.block_size,
        }
        if self.cfg.topology == "split":
            objs = [sched]
            dist.broadcast_object_list(objs, src=self.lead_drafter)
            sched = objs[0]
            gathered: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(gathered, data)
            extra["data_positions"] = {str(r): gathered[r] for r in self.target_ranks}
        else:
            extra["data"] = data
        extra["scheduler"] = sched
        return extra

    def save(self, step: int) -> None:
        from gpudeck.trainers.common import checkpoint as ckpt

        extra = self._extra(step)
        model = self.drafter if self.drafter is not None else _placeholder()
        done = ckpt.save_checkpoint(
            self.cfg.out,
            step,
            model,
            self.optimizer,
            extra,
            keep=self.cfg.keep,
            rank=self.ctx.rank,
            barrier=lambda: runtime.barrier(self.ctx),
        )
        self.tel.emit("checkpoint", step=step, **done.record())
        self.last_saved = step

    def load(self, step: int) -> int:
        from gpudeck.trainers.common import checkpoint as ckpt

        model = self.drafter if self.drafter is not None else _placeholder()
        extra = ckpt.load_checkpoint(self.cfg.out, step, model, self.optimizer, rank=self.ctx.rank, trust=self.cfg.trust_checkpoint)
        if int(extra["step"]) != step:
            raise RuntimeError(f"checkpoint step_{step} says step {extra['step']}")
        if extra.get("target_layer_ids") not in (None, self.layer_ids):
            raise RuntimeError(f"checkpoint was made with other target layers {extra['target_layer_ids']} (now {self.layer_ids})")
        if self.scheduler is not None and extra.get("scheduler"):
            self.scheduler.load_state_dict(extra["scheduler"])
        if self.loader is not None:
            if self.cfg.topology == "split":
                self._fast_forward(step)
            elif extra.get("data"):
                self.loader.load_state_dict(extra["data"])
        return step

    # ---- one drafter micro-step -------------------------------------
    def drafter_forward_backward(self, ids, lm, feats, scale: float):
        import torch

        from gpudeck.trainers.dflash.loss import block_inputs, dflash_loss, labels_and_weights, sample_anchors

        cfg = self.cfg
        if self.drafter is None or self.embed is None or self.lm_head is None:
            raise RuntimeError(f"rank {self.ctx.rank} has no drafter, embedding or lm_head: only drafter ranks train")
        bsz, seq = ids.shape
        rf = torch.profiler.record_function
        with rf("dflash.anchors_and_masks"):
            anchors, keep = sample_anchors(lm, cfg.num_anchors)
            anchors, keep = anchors.to(self.device), keep.to(self.device)
            bids, bpos = block_inputs(ids, anchors, self.block_size, self.mask_token_id)
            with torch.no_grad():
                noise = self.embed(bids)
            pos = torch.cat([torch.arange(seq, device=self.device).unsqueeze(0).expand(bsz, -1), bpos], 1)
            mask = make_masks(anchors, seq, self.block_size, self.attn, self.device, self.layer_types, self.sliding_window)
        with rf("dflash.drafter_forward"):
            hid = self.drafter(noise, feats, pos, mask)
        labels, weights = labels_and_weights(ids, lm, anchors, keep, self.block_size, self.gamma)
        # the weighted CE *sum*: normalised once per step by the global weight (finish_global_mean)
        with rf("dflash.lm_head_loss"):
            loss_sum, wsum = dflash_loss(
                hid, self.lm_head.weight, labels, weights, chunk_rows=cfg.loss_chunk_rows, mode=cfg.loss_mode, normalize=False
            )
        with rf("dflash.drafter_backward"):
            (loss_sum * scale).backward()
        n_rows = int((weights > 0).sum().item())
        flops = drafter_step_flops(self.dcfg, self.n_layer_params, self.n_fc, seq, anchors, n_rows, self.vocab)
        return loss_sum.detach(), wsum.detach(), flops

    # ---- the loop's steps ----------------------------------------------
    def checkpoint_due(self, step: int) -> bool:
        """Every ``--checkpoint-every`` steps and at the last one (split: both sides stop at this boundary)."""
        every = self.cfg.checkpoint_every
        return step == self.cfg.max_steps or (every > 0 and step % every == 0)

    def validation_due(self, step: int) -> bool:
        """Every ``--eval-every`` steps on a drafter rank, but not at the last one (``export`` evaluates it)."""
        return self.is_drafter and self._eval_due(step) and step != self.cfg.max_steps

    def validate(self, step: int) -> None:
        """The tau evaluation after ``step`` (:meth:`eval`)."""
        self.eval(step)

    def train_step(self) -> bool:
        """One optimizer step: a split target rank produces and sends its batches, a drafter rank trains; True on a stop."""
        step = self.step + 1
        runtime.maybe_fail_for_test(step, self.ctx.rank)
        stop_now = self._target_step(step) if self.role == ROLE_TARGET else self._drafter_step(step)
        self.step = step
        return stop_now

    def _peak(self):
        from gpudeck.trainers.common.flops import peak_flops

        return peak_flops(self.device, "bf16" if "bfloat16" in str(self.dtype) else "fp32")

    def _mem(self) -> dict[str, Any]:
        import torch

        if self.device.type != "cuda":
            return {"mem_allocated_gib": None, "mem_peak_gib": None}
        return {
            "mem_allocated_gib": round(torch.cuda.memory_allocated(self.device) / 2**30, 3),
            "mem_peak_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3),
        }

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def micro_batches(self, step: int) -> Iterator[FeatureBatch]:
        """The drafter's ``--grad-accum`` micro-batches of ``step``: the target's features, computed here or received."""
        import torch

        for _ in range(self.cfg.grad_accum):
            if self.role == ROLE_DRAFTER:
                yield self._receive(step)
                continue
            ids, lm = self._next_local_batch()
            tf = time.perf_counter()
            with torch.no_grad(), torch.profiler.record_function("dflash.target_forward"):
                feats = target_features(self.target, ids, self.layer_ids)
            yield FeatureBatch(ids, lm, feats, self.target_flops.batch(*ids.shape), time.perf_counter() - tf)

    def _receive(self, step: int) -> FeatureBatch:
        """Split drafter rank: the next batch of ``step`` from its target rank, keeping ``--queue-depth`` receives posted."""
        if self.receive_plan is None:
            raise RuntimeError("split drafter: no receive schedule was set up for this step")
        while len(self.inbox) < self.cfg.queue_depth:
            nxt = next(self.receive_plan, None)
            if nxt is None:
                break
            self._post_receive(*nxt)
        ready = sum(1 for it in self.inbox if it[4].is_completed() and it[5].is_completed())
        s, _, meta, feats, w1, w2 = self.inbox.popleft()
        assert s == step, (s, step)
        with self.clock.stall():
            w1.wait()
            w2.wait()
        ids, lm, feats = self._unpack(meta, feats)
        return FeatureBatch(ids, lm, feats, ready=ready)

    def _receives_until(self, step_from: int, step_to: int) -> Iterator[tuple[int, int, int]]:
        """Split drafter rank: (step, global batch, source rank) of the batches it consumes in steps step_from..step_to."""
        for s in range(step_from, step_to + 1):
            if self.votes.is_last(s - 1):
                return  # the ranks stop after step s-1: post nothing beyond it
            for g in self._global_batches(s):
                t_i, d_i = self._batch_owner(g)
                if d_i == self.d_index:
                    yield s, g, self.target_ranks[t_i]

    def _post_receive(self, s: int, g: int, src: int) -> None:
        import torch
        import torch.distributed as dist

        cdev = self._comm_device()
        meta = torch.empty((2 * self.capacity + 2,), dtype=torch.long, device=cdev)
        feats = torch.empty((self.capacity, self.n_ctx * self.hidden), dtype=self.dtype, device=cdev)
        w1 = dist.irecv(meta, src, tag=2 * g)
        w2 = dist.irecv(feats, src, tag=2 * g + 1)
        self.inbox.append((s, g, meta, feats, w1, w2))

    def _drafter_step(self, step: int) -> bool:
        """A drafter rank's optimizer step over :meth:`micro_batches`; True when the ranks stop after it."""
        cfg = self.cfg
        if self.drafter is None:
            raise RuntimeError(f"rank {self.ctx.rank} has no drafter: only drafter ranks train")
        split = self.role == ROLE_DRAFTER
        if split and self.receive_plan is None:
            # post receives up to the next checkpoint boundary only
            stop = step
            while not self.checkpoint_due(stop):
                stop += 1
            self.receive_plan = self._receives_until(step, stop)
        self._profile_begin(step)
        self._sync()
        t_step = time.perf_counter()
        clock_start = self.clock.mark()
        loss_sum, weight_sum, flops, flops_tt, ctx_tokens = 0.0, 0.0, 0.0, 0.0, 0
        drafter_flops = 0.0  # the drafter's forward + backward alone (SpecForge's trainer-GPU figure)
        queue_depth = None
        t_fwd = 0.0
        for micro, batch in enumerate(self.micro_batches(step)):
            flops += batch.target_flops[0]
            flops_tt += batch.target_flops[1]
            t_fwd += batch.target_s
            queue_depth = batch.ready
            ctx_tokens += batch.ids.numel()
            if self.ctx.distributed and hasattr(self.drafter, "set_requires_gradient_sync"):
                self.drafter.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
            part, wpart, fl = self.drafter_forward_backward(batch.ids, batch.loss_mask, batch.feats, 1.0)
            loss_sum += float(part)
            weight_sum += float(wpart)
            flops += fl
            flops_tt += fl
            drafter_flops += fl
        loss_val, gnorm, lr, stop_now = self._drafter_optimizer_step(loss_sum, weight_sum, split, step)
        self._sync()
        dt = time.perf_counter() - t_step
        timing = self.clock.split(dt, clock_start, step)
        self._profile_end(step)
        if split and (self.checkpoint_due(step) or stop_now):
            # everything up to the checkpoint boundary (or the stop) is consumed; re-plan after it
            assert not self.inbox, [it[:2] for it in self.inbox]
            self.receive_plan = None
        self._report_drafter_step(step, loss_val, lr, gnorm, dt, t_fwd, (flops, flops_tt, ctx_tokens), timing, queue_depth, drafter_flops)
        if step == self.start_step + 1 and self.device.type == "cuda":
            runtime.set_collective_timeout(self.ctx, 120)
        return stop_now

    def _drafter_optimizer_step(self, loss_sum: float, weight_sum: float, split: bool, step: int) -> tuple[float, Any, Any, bool]:
        """All-reduce the gradients and the loss (and, colocated, the stop vote), clip, step: (loss, grad norm, lr, stop now)."""
        import torch

        from gpudeck.trainers.dflash.loss import finish_global_mean

        cfg = self.cfg
        if self.drafter is None or self.optimizer is None or self.scheduler is None:
            raise RuntimeError(f"rank {self.ctx.rank} has no drafter, optimizer or scheduler: only drafter ranks train")
        # gradients of sum(w*CE) / sum(w) over every drafter rank and micro-batch (SpecForge's rule);
        # colocated, the stop vote rides on the same all-reduce
        n_group = len(self.drafter_ranks) if self.ctx.distributed else 1
        with self.clock.stall():  # the gradients' and the loss's all-reduces, then the norm's
            loss_val, _, votes = finish_global_mean(
                self.drafter.parameters(),
                loss_sum,
                weight_sum,
                group=self.drafter_group,
                world=n_group,
                extra=[] if split else [1.0 if self.stop.requested else 0.0],
            )
            gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if split:
            self.votes.post(step)
            stop_now = self.votes.is_last(step)
        else:
            stop_now = votes[0] > 0
        return loss_val, gnorm, lr, stop_now

    def _report_drafter_step(
        self,
        step: int,
        loss_val: float,
        lr: float,
        gnorm: Any,
        dt: float,
        t_fwd: float,
        counts: tuple[float, float, int],
        timing: dict,
        queue_depth: int | None,
        drafter_flops: float = 0.0,
    ) -> None:
        """The step's record (throughput, FLOPs, MFU, memory, timing) and the lead drafter's line on stdout."""
        from gpudeck.trainers.common.flops import mfu

        cfg = self.cfg
        flops, flops_tt, n_rank_tokens = counts
        split = self.role == ROLE_DRAFTER
        world_tokens = n_rank_tokens * (len(self.drafter_ranks) if split else self.ctx.world_size)
        rec = dict(
            loss=round(loss_val, 6),
            lr=lr,
            grad_norm=float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm),
            tokens_per_s=round(world_tokens / dt, 2),
            tokens_per_s_rank=round(n_rank_tokens / dt, 2),
            step_s=round(dt, 4),
            target_forward_s=(round(t_fwd, 4) if not split else None),
            flops_per_token=round(flops / max(1, n_rank_tokens), 1),
            step_flops=flops,
            drafter_flops=drafter_flops,
            flops_per_token_torchtitan=round(flops_tt / max(1, n_rank_tokens), 1),
            mfu=mfu(n_rank_tokens / dt, flops / max(1, n_rank_tokens), self.peak),
            mfu_torchtitan=mfu(n_rank_tokens / dt, flops_tt / max(1, n_rank_tokens), self.peak),
            peak_flops=self.peak,
            role=self.role,
            **self._mem(),
            **timing,
        )
        if split:
            rec["queue_depth"] = queue_depth
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            self.tel.step(step, **rec)
            if self.ctx.rank == self.lead_drafter:
                m = f"{rec['mfu'] * 100:.1f}%" if rec["mfu"] is not None else "n/a"
                print(
                    f"[dflash] step {step} loss {loss_val:.4f} tok/s {rec['tokens_per_s']:.0f} mfu {m} step {dt * 1000:.0f} ms",
                    flush=True,
                )

    def _profile_begin(self, step: int) -> None:
        """``--profile-steps A-B``: start torch.profiler before step A (CPU + CUDA activity)."""
        import torch

        span = self.cfg.profile_steps
        if span and step == span[0]:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=acts, record_shapes=False)
            self.profiler.__enter__()

    def _profile_end(self, step: int) -> None:
        """After step B: OUT/profile/rank<r>.txt, the ops and the dflash.* phases by device time."""
        span = self.cfg.profile_steps
        prof = self.profiler
        if not span or prof is None or step != span[1]:
            return
        prof.__exit__(None, None, None)
        self.profiler = None
        cuda = self.device.type == "cuda"
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        avg = prof.key_averages()
        phases = [e for e in avg if e.key.startswith("dflash.")]
        folder = Path(self.cfg.out) / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.ctx.rank}.txt"
        n = span[1] - span[0] + 1
        lines = [f"steps {span[0]}-{span[1]} ({n}), rank {self.ctx.rank}, sorted by {key}", "", "phases:"]
        for e in sorted(phases, key=lambda e: -(e.device_time_total if cuda else e.cpu_time_total)):
            dev = f" device {e.device_time_total / 1000 / n:10.2f} ms/step" if cuda else ""
            lines.append(f"  {e.key:28s} cpu {e.cpu_time_total / 1000 / n:10.2f} ms/step{dev}")
        lines += ["", avg.table(sort_by=key, row_limit=40)]
        path.write_text("\n".join(lines) + "\n")
        self.tel.emit("profile", steps=list(span), path=str(path))

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.eval_every
        return not self.cfg.no_eval and every > 0 and step % every == 0

    def _target_step(self, step: int) -> bool:
        """Split target rank: produce and send its batches of ``step`` (at most ``--queue-depth`` in flight); True on a stop."""
        import torch

        self._sync()
        t_step = time.perf_counter()
        clock_start = self.clock.mark()
        tokens, waited, flops, flops_tt = 0, 0.0, 0.0, 0.0
        for g in self._global_batches(step):
            t_i, d_i = self._batch_owner(g)
            if t_i != self.t_index:
                continue
            ids, lm = self._next_local_batch()
            with torch.inference_mode():
                feats = target_features(self.target, ids, self.layer_ids).to(self.dtype)
            meta, feats = self._pack(ids, lm, feats, self._comm_device())
            waited += self._send(meta, feats, self.drafter_ranks[d_i], g)
            tokens += ids.numel()
            f_causal, f_tt = self.target_flops.batch(*ids.shape)
            flops, flops_tt = flops + f_causal, flops_tt + f_tt
        if self.checkpoint_due(step):
            with self.clock.stall():
                self._drain_sends()
        self._sync()
        dt = time.perf_counter() - t_step
        self._report_target_step(step, tokens, dt, waited, (flops, flops_tt), self.clock.split(dt, clock_start, step))
        self.votes.post(step)
        if self.votes.is_last(step):
            self._drain_sends()
            return True
        return False

    def _send(self, meta, feats, dst: int, g: int) -> float:
        """Post the sends of global batch ``g`` once fewer than ``--queue-depth`` are in flight; returns the seconds waited."""
        import torch.distributed as dist

        tw = time.perf_counter()
        with self.clock.stall():
            while len(self.sends) >= self.cfg.queue_depth:
                for w in self.sends.popleft()[:2]:
                    w.wait()
        waited = time.perf_counter() - tw
        w1 = dist.isend(meta, dst, tag=2 * g)
        w2 = dist.isend(feats, dst, tag=2 * g + 1)
        self.sends.append((w1, w2, meta, feats))
        return waited

    def _drain_sends(self) -> None:
        """Split target rank: wait for every send in flight."""
        while self.sends:
            for w in self.sends.popleft()[:2]:
                w.wait()

    def _report_target_step(self, step: int, tokens: int, dt: float, waited: float, counts: tuple[float, float], timing: dict) -> None:
        """A split target rank's step record: throughput, FLOPs, MFU, the sends in flight, memory, timing."""
        from gpudeck.trainers.common.flops import mfu

        flops, flops_tt = counts
        fpt, fpt_tt = flops / max(1, tokens), flops_tt / max(1, tokens)
        if step % self.cfg.log_every == 0 or step == self.cfg.max_steps:
            self.tel.step(
                step,
                loss=None,
                role=self.role,
                tokens_per_s=round(tokens / dt, 2),
                step_s=round(dt, 4),
                send_wait_s=round(waited, 4),
                flops_per_token=round(fpt, 1),
                flops_per_token_torchtitan=round(fpt_tt, 1),
                mfu=(mfu(tokens / dt, fpt, self.peak) if tokens else 0.0),
                mfu_torchtitan=(mfu(tokens / dt, fpt_tt, self.peak) if tokens else 0.0),
                peak_flops=self.peak,
                queue_depth=len(self.sends),
                **self._mem(),
                **timing,
            )

    def eval(self, step: int) -> None:
        if self.lm_head is None:
            raise RuntimeError(f"rank {self.ctx.rank} has no lm_head: only drafter ranks evaluate")
        res = evaluate_tau(
            self.drafter,
            self.embed,
            self.lm_head.weight,
            self.eval_ids,
            self.eval_feats,
            self.cfg.eval_prompt_len,
            self.block_size,
            self.mask_token_id,
            "sdpa",
        )
        res["step"] = step
        if self.first_eval is None:
            self.first_eval = res
        self.last_eval = res
        if self.ctx.rank == self.lead_drafter:
            self.tel.emit("eval", **res)
            print(
                f"[dflash] eval step {step} tau {res['tau']:.3f} (all anchors {res['tau_all_anchors']:.3f}, {res['eval_blocks']} blocks)",
                flush=True,
            )

    def _end_of_steps(self) -> None:
        """After the last step: the sends and the stop votes still in flight are waited for (idempotent)."""
        if self.role == ROLE_TARGET:
            self._drain_sends()
        self.votes.finish()

    def export(self) -> Path | None:
        """The final eval (unless the last step was just evaluated), then the drafter in OUT/drafter (the lead drafter's path).

        Not called after a stop on a signal: the checkpoint holds the state, and the grace period is
        better spent exiting (``finish`` still writes result.json, ``stopped: true``).
        """
        self._end_of_steps()
        if self.is_drafter and not self.cfg.no_eval and (self.last_eval is None or self.last_eval["step"] != self.step):
            self.eval(self.step)
        return self._save_drafter() if self.is_drafter else None

    def _save_drafter(self) -> Path | None:
        """Gather the FSDP2 shards over the drafter group (every drafter rank); the lead drafter saves them (save_pretrained)."""
        from gpudeck.trainers.dflash.model import DFlashDraftModel

        if self.drafter is None:
            raise RuntimeError(f"rank {self.ctx.rank} is a drafter rank without a drafter to export")
        sd = {}
        for k, v in self.drafter.state_dict().items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            sd[k] = full.detach().float().cpu()
        if self.ctx.rank != self.lead_drafter:
            return None
        plain = DFlashDraftModel(self.dcfg)
        plain.load_state_dict(sd)
        ddir = Path(self.cfg.out) / "drafter"
        if ddir.exists():
            shutil.rmtree(ddir)
        plain.save_pretrained(str(ddir))
        shutil.copy(Path(__file__).with_name("model.py"), ddir / "dflash.py")
        meta = {
            "target": self.cfg.target or self.cfg.target_config,
            "step": self.step,
            "block_size": self.block_size,
            "target_layer_ids": self.layer_ids,
            "mask_token_id": self.mask_token_id,
            "num_target_layers": self.dcfg.num_target_layers,
        }
        (ddir / "dflash_train.json").write_text(json.dumps(meta, indent=2) + "\n")
        return ddir

    def finish(self, exported: Path | None) -> int:
        """OUT/result.json (final_step, stopped, drafter_dir, eval_first, eval_last, topology, world_size), ``done``, a clean exit."""
        import torch.distributed as dist

        self._end_of_steps()
        out = Path(self.cfg.out)
        files: list[str] = []
        if self.ctx.rank == self.lead_drafter:
            result = {
                "final_step": self.step,
                "stopped": self.stopped,
                "drafter_dir": str(exported) if exported else None,
                "eval_first": self.first_eval,
                "eval_last": self.last_eval,
                "topology": self.cfg.topology,
                "world_size": self.ctx.world_size,
            }
            (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
            files = ([str(exported)] if exported else []) + [str(out / "result.json")]
        if self.ctx.distributed:
            objs = [files]
            dist.broadcast_object_list(objs, src=self.lead_drafter)
            files = objs[0]
        runtime.barrier(self.ctx)
        self.tel.emit(
            "done",
            final_step=self.step,
            reason="stopped" if self.stopped else "max_steps",
            result_files=files,
            wall_s=round(time.perf_counter() - self.t0, 3),
        )
        self.tel.close()
        runtime.finish_ok(self.ctx)
        return 0


def _placeholder():
    """What a split target rank contributes to the (collective) checkpoint: one tiny buffer.

    Adapter: gpudeck.trainers.common.checkpoint saves model state through get_model_state_dict, which refuses an
    empty module; target ranks hold no trainable state, but every rank must join the DCP collective.
    """
    import torch
    from torch import nn

    m = nn.Module()
    m.register_buffer("split_target_placeholder", torch.zeros(1))
    return m


def main(argv: list[str] | None = None) -> int:
    """``python -m gpudeck.trainers.dflash``: the checked command line, then the trainer on the shared loop."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    return DFlashTrainer(cfg, [sys.executable, "-m", "gpudeck.trainers.dflash", *argv]).run()
