"""Provides causal-LM pretraining with FSDP2 (``python -m gpudeck.trainers.fsdp_lm``), torchtitan-style.

Run it under torchrun (or alone: world size 1)::

    torchrun --nproc-per-node 8 -m gpudeck.trainers.fsdp_lm --model-config llama-1b \\
        --seq-len 2048 --batch-size 8 --compile --fresh --out runs/llama1b

    python -m gpudeck.trainers.fsdp_lm --model-config tiny --seq-len 64 --batch-size 4 \\
        --max-steps 20 --fresh --out /tmp/tiny

What it does, in order:

1. Parses the shared command line (``gpudeck.trainers.common.runtime``); exactly one of
   ``--fresh`` / ``--resume latest|N`` is required. ``--fresh`` refuses (exit 2)
   when ``OUT/checkpoints`` already holds checkpoints, unless ``--new-run-dir``
   (which moves them to ``OUT/checkpoints.archived-<UTC time>/``).
2. Builds a transformers causal LM from a config (a config.json / folder, or a
   preset: ``tiny``, ``llama-1b``, ``llama-3b``, ``qwen3-0.6b``) on the meta device; counts
   its parameters exactly there (unsharded) for the manifest and FLOPs.
3. Activation checkpointing (optional) -> per-block ``torch.compile``
   (optional) -> ``fully_shard`` per decoder block, then the embeddings, then
   norm + lm_head together, then the root. Mixed precision bf16 params / fp32
   reduce on GPU, fp32 on CPU.
4. ``to_empty`` on the device, then weights: each parameter's full tensor is
   drawn from a generator seeded by (seed, parameter name) — or taken from
   ``--init-from`` — and this rank keeps its dim-0 shard. The rotary
   ``inv_freq`` buffers are recomputed (they are garbage after ``to_empty``).
5. AdamW (fused on GPU), linear warmup + cosine decay, gradient accumulation
   with ``set_requires_gradient_sync``, gradient clipping.
6. Checkpoints every ``--checkpoint-every`` steps and at the end (DCP; model,
   optimizer, scheduler, data position, RNG, step), keeping the last ``--keep``.
7. Exports ``OUT/final/`` (``save_pretrained`` of the gathered full state dict
   plus the tokenizer) and ``OUT/result.json``.

Data (``--data``): a token file (``.bin``), a folder written by
``python -m gpudeck.trainers.prepare`` (memory-mapped, never re-tokenised; its tokenizer
is used unless ``--tokenizer`` names the same one), text / JSONL files or
folders, a Hugging Face dataset saved with ``save_to_disk`` (``--data-split``
picks a split), parquet / arrow files or folders of them (read offline through
``datasets``; ``--text-column`` names the text, default ``text`` or the only
string column), or the built-in corpus.

Validation: ``--val-data SRC`` (a second source), ``--val-fraction F`` (the
tail of the token stream), or a prepared folder's ``val`` split; every
``--val-every`` steps (default max_steps/10) and at the last step the mean
next-token loss over ``--val-batches`` fixed batches per rank goes into a
``val_loss`` record (no gradients, no RNG, no data position: resume stays exact).

Telemetry: ``manifest``, ``step``, ``val_loss``, ``heartbeat``, ``checkpoint``,
``done`` and ``error`` records through ``gpudeck.trainers.common.telemetry.Telemetry``
(``GPUDECK_TELEMETRY``). Every rank writes its own records. In ``step`` records
``loss`` is the mean over ranks and micro-batches, ``tokens_per_s`` is the whole
job's (all ranks) over the step's wall time, and ``mfu`` is per GPU:
tokens_per_s / world_size * flops_per_token / peak_flops under the causal
convention (attention FLOPs halved for the causal mask; ``mfu_torchtitan``
beside it counts full attention, the manifest's ``mfu_convention`` says so;
both null with ``mfu_note`` in the manifest when the peak is unknown, e.g. on
CPU). Extra step fields: lr, grad_norm, step_time_s, tokens (seen so far). The
manifest adds params_embedding, dataset_sample_tokens, dataset_documents,
dataset_unique_documents, dataset_sha256, tokens_per_step, flops_per_token,
flops_per_token_torchtitan, peak_flops, dtype, compile, loss_impl, ... .

Performance options (all measured by ``bench/fsdp_mfu.py``): ``--compile``
(per block) with ``--compile-mode``, ``--activation-checkpointing`` with
``--ac-every N`` (every Nth block only), ``--loss-impl chunked`` (lm_head + CE
over row chunks, no [tokens, vocab] logits kept), ``--optimizer-impl``,
``--reduce-dtype``, ``--prefetch`` (next batch pinned and copied while the GPU
works), ``--sdpa-backend``; ``--profile-steps N`` prints the top kernels of N
steps from ``--profile-start`` and the time per kernel class
(``gpudeck.trainers.common.profiling``).

Batch sizes: ``--batch-size`` sequences of ``--seq-len`` tokens per rank per
micro-step; one optimizer step sees batch_size x grad_accum x world_size
sequences.

Output: ``OUT/checkpoints/step_<N>/``, ``OUT/final/`` (config.json,
model.safetensors, the tokenizer: ``gpudeck_byte_tokenizer.json`` for the byte
tokenizer, reloadable with ``gpudeck.trainers.common.tokenizer.load_tokenizer(OUT/final)``), and
``OUT/result.json`` (final_step, start, losses per step, final_loss,
tokens_per_s and mfu means excluding step 1, params, world size, checkpoints).

SIGTERM/SIGINT (``gpudeck.trainers.common.runtime.install_stop_flag``): the ranks agree (one
all-reduce per step, ``reduce_mean_and_stop``) to stop after the current step,
save a checkpoint, export nothing, and exit 0 with a ``done`` record whose
``reason`` is ``"stopped"``. Repeated SIGTERMs are one request; a SIGINT after
the first signal leaves at once (error path).

Error path: an ``error`` record, the traceback on stderr, the process group is
aborted and the process ``os._exit(1)``s, so no rank lingers. Test hook:
``GPUDECK_TEST_FAIL_AT_STEP=N[:RANK]`` raises at step N (on RANK only).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from gpudeck.trainers.checkpoint_trust import CheckpointTrustError
from gpudeck.trainers.common import compat
from gpudeck.trainers.common.checkpoint import (
    StartError,
    StartPlan,
    archive_checkpoints,
    list_checkpoints,
    load_checkpoint,
    resolve_start,
    save_checkpoint,
)
from gpudeck.trainers.common.data import (
    DataError,
    PackedDataset,
    ShardedBatches,
    ValidationBatches,
    is_prepared,
    load_prepared,
    load_tokens,
    read_prepared_manifest,
    split_tokens,
)
from gpudeck.trainers.common.diagnostics import install_flight_recorder_dump, install_stack_dump, maybe_sleep_for_test, step_clock
from gpudeck.trainers.common.flops import MFU_CONVENTION, model_flops, peak_flops
from gpudeck.trainers.common.flops import mfu as compute_mfu
from gpudeck.trainers.common.limits import check_config, read_config_json
from gpudeck.trainers.common.loop import Trainer
from gpudeck.trainers.common.profiling import StepProfiler
from gpudeck.trainers.common.runtime import (
    ExitWith,
    barrier,
    config_hash,
    device_info,
    finish_ok,
    init_distributed,
    install_stop_flag,
    maybe_fail_for_test,
    reduce_mean_and_stop,
    register,
    seed_all,
    set_collective_timeout,
)
from gpudeck.trainers.common.telemetry import Telemetry
from gpudeck.trainers.common.tokenizer import has_tokenizer, load_tokenizer, same_tokenizer
from gpudeck.trainers.errors import InputError
from gpudeck.trainers.fsdp_lm.config import FsdpLmConfig, parse_args
from gpudeck.trainers.presets import PRESETS

# ------------------------------------------------------------------ command line


COLLECTIVE_TIMEOUT_S = 300.0  # a collective not done by then fails the run (set after step 1)


# ------------------------------------------------------------------ model


def build_config(spec: str | None, init_from: str | None):
    """A transformers config from a preset name, a config.json / folder, or --init-from; bounded before it is built.

    Every JSON config passes :func:`gpudeck.trainers.common.limits.check_config` before transformers reads it
    (ConfigLimitError naming the field and the limit, exit 2); a preset or a path that is neither is an InputError.
    """
    # transformers is imported only once the config has passed its checks: a refused one answers without its import
    if init_from is not None:
        read_config_json(init_from, f"--init-from {init_from}")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(init_from)
    if spec is None:
        raise InputError("give --model-config (a preset or a config.json) or --init-from")
    if spec in PRESETS:
        kw = dict(check_config(dict(PRESETS[spec]), f"preset {spec}"))
        from transformers import AutoConfig

        return AutoConfig.for_model(kw.pop("model_type"), **kw)
    path = Path(spec)
    if path.is_dir() or path.name == "config.json":
        read_config_json(path, f"--model-config {spec}")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path if path.is_dir() else path.parent))
    if path.is_file():
        kw = read_config_json(path, f"--model-config {spec}")
        if not isinstance(kw.get("model_type"), str):
            raise InputError(f'--model-config {spec}: the config has no model_type (e.g. "llama", "qwen3"); add it')
        from transformers import AutoConfig

        return AutoConfig.for_model(kw.pop("model_type"), **kw)
    raise InputError(f"--model-config {spec!r}: not a preset ({', '.join(PRESETS)}) and no such file or folder")


REPEAT_KV_ATTENTION = "sdpa_repeat_kv"


def sdpa_repeat_kv(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """SDPA with the key/value heads repeated to the query heads (no ``enable_gqa``).

    transformers' ``sdpa`` passes grouped-query attention to SDPA as ``enable_gqa``,
    which not every kernel accepts (cuDNN attention may not, and then SDPA quietly
    takes flash attention). Repeating the heads costs a copy of K and V per layer
    but lets ``--sdpa-backend cudnn`` really run cuDNN. transformers builds no mask
    for an attention it does not know, so this is the causal, unpadded case
    (``is_causal=True``) — what fsdp_lm trains on.
    """
    import torch.nn.functional as F

    if attention_mask is not None:
        raise ValueError(f"{REPEAT_KV_ATTENTION}: padded or masked inputs are not supported")
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        b, h, t, d = key.shape
        key = key[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)
        value = value[:, :, None].expand(b, h, n_rep, t, value.shape[-1]).reshape(b, h * n_rep, t, -1)
    causal = query.shape[2] > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout if module.training else 0.0, scale=scaling, is_causal=causal)
    return out.transpose(1, 2).contiguous(), None


def _register_attention(name: str) -> None:
    if name != REPEAT_KV_ATTENTION:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(REPEAT_KV_ATTENTION, sdpa_repeat_kv)


def build_meta_model(config, attn_implementation: str):
    """The model on the meta device (no memory), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    _register_attention(attn_implementation)

    compat.set_attn_implementation(config, attn_implementation)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.float()
    return model


def decoder_layers(model):
    """The ModuleList of decoder blocks of a transformers causal LM."""
    base = getattr(model, model.base_model_prefix, None) or model.model
    return base.layers


def _param_seed(seed: int, fqn: str) -> int:
    h = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _init_full(fqn: str, shape, device, std: float, seed: int):
    import torch

    leaf = fqn.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    if len(shape) == 1 and "norm" in fqn:
        return torch.ones(shape, device=device)
    g = torch.Generator(device=device)
    g.manual_seed(_param_seed(seed, fqn))
    return torch.empty(shape, device=device).normal_(mean=0.0, std=std, generator=g)


def _local_shard(full, param):
    """The dim-0 chunk FSDP2 keeps on this rank (torch.chunk semantics)."""
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return full
    mesh_size = param.device_mesh.size()
    coord = param.device_mesh.get_local_rank()
    chunks = torch.chunk(full, mesh_size, dim=0)
    if coord < len(chunks):
        return chunks[coord]
    return full.new_empty((0, *full.shape[1:]))


def recompute_rotary(model, device) -> int:
    """Recompute rotary ``inv_freq`` buffers (garbage after ``to_empty``); returns count."""
    import torch

    n = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "inv_freq"):
            fresh = type(mod)(config=mod.config)
            for name, buf in fresh.named_buffers(recurse=False):
                if hasattr(mod, name) and torch.is_tensor(getattr(mod, name)):
                    getattr(mod, name).data = buf.to(device=device, dtype=getattr(mod, name).dtype)
            if hasattr(fresh, "attention_scaling"):
                mod.attention_scaling = fresh.attention_scaling
            n += 1
    return n


def materialize(model, device, seed: int, std: float, source_state: dict | None = None) -> None:
    """``to_empty`` then fill every parameter (this rank's shard) deterministically."""
    import torch

    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fqn = compat.clean_fqn(name)
            shape = tuple(param.shape)  # global shape for DTensors
            if source_state is not None:
                if fqn not in source_state:
                    raise KeyError(f"--init-from has no weight for {fqn}")
                full = source_state[fqn].to(device=device, dtype=torch.float32)
                if tuple(full.shape) != shape:
                    raise ValueError(f"{fqn}: shape {tuple(full.shape)} in --init-from, {shape} in model")
            else:
                full = _init_full(fqn, shape, device, std, seed)
            local = param.to_local() if hasattr(param, "to_local") else param
            shard = _local_shard(full, param)
            if tuple(shard.shape) != tuple(local.shape):
                raise RuntimeError(f"{fqn}: shard shape {tuple(shard.shape)} != local {tuple(local.shape)}")
            local.copy_(shard)
    recompute_rotary(model, device)


def apply_parallelism(model, args, ctx, compute_dtype) -> dict[str, Any]:
    """AC -> per-block compile -> fully_shard (blocks, embeddings, norm+lm_head, root)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = decoder_layers(model)
    if args.activation_checkpointing:
        for i in range(0, len(layers), args.ac_every):
            layers[i] = compat.checkpoint_wrapper(layers[i], preserve_rng_state=False)
    if args.compile:
        # one graph serves every block; leave room in case guards split them
        compat.raise_dynamo_cache_limit(2 * len(layers) + 8)
        for i in range(len(layers)):
            layers[i].compile(dynamic=False, mode=None if args.compile_mode == "default" else args.compile_mode)
    mp = None
    if compute_dtype != torch.float32:
        reduce = torch.bfloat16 if args.reduce_dtype == "bf16" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce)
    if args.reshard_after_forward == "auto":
        rafw = ctx.world_size > 1
    else:
        rafw = args.reshard_after_forward == "yes"
    kw: dict[str, Any] = {}
    if mp is not None:
        kw["mp_policy"] = mp
    for block in layers:
        fully_shard(block, reshard_after_forward=rafw, **kw)
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    base = getattr(model, model.base_model_prefix)
    norm = getattr(base, "norm", None)
    if not tied:
        fully_shard(emb, reshard_after_forward=rafw, **kw)
        group = [m for m in (norm, head) if m is not None]
        if group:
            fully_shard(group, reshard_after_forward=False, **kw)
    # tied embeddings stay in the root group together with norm
    fully_shard(model, reshard_after_forward=rafw, **kw)
    return {"reshard_after_forward": rafw, "tied_embeddings": tied, "mixed_precision": str(compute_dtype).replace("torch.", "")}


def lr_lambda_factory(max_steps: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:  # step = number of optimizer steps already taken
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, max_steps - warmup)
        progress = min(max(progress, 0.0), 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def cross_entropy(logits, labels):
    """Mean next-token CE; the fp32 upcast happens inside (fused away when compiled)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class BatchFeeder:
    """This rank's batches on the device; with ``ahead`` the next one is gathered and copied early.

    ``prefetch()`` (called once the step's kernels are queued) gathers the next batch,
    pins it and starts its copy; ``next()`` hands it over. ``state_dict()`` is the data
    position *before* a batch fetched ahead, so a checkpoint resumes exactly.
    """

    def __init__(self, batches, device, pin: bool, ahead: bool) -> None:
        self.batches = batches
        self.device = device
        self.pin = pin
        self.ahead = ahead
        self._pending: tuple[dict[str, Any], Any] | None = None  # (state before it, the batch on the device)

    def _fetch(self):
        batch = self.batches.next_batch()
        if self.pin:
            batch = batch.pin_memory()
        return batch.to(self.device, non_blocking=True)

    def prefetch(self) -> None:
        if self.ahead and self._pending is None:
            state = self.batches.state_dict()
            self._pending = (state, self._fetch())

    def next(self):
        if self._pending is not None:
            batch, self._pending = self._pending[1], None
            return batch
        return self._fetch()

    def state_dict(self) -> dict[str, Any]:
        return self._pending[0] if self._pending is not None else self.batches.state_dict()


class _ChunkedLossHead:
    """Mixed into the lm_head's class: ``head(hidden, labels)`` is the mean CE, chunked.

    Called as a module (so FSDP2's hooks gather the weight); without labels it is the
    plain linear layer. The chunks are ``gpudeck.trainers.dflash.loss.chunked_linear_cross_entropy``
    (fused mode: each chunk's gradients are computed in the forward, no [tokens, vocab]
    logits are kept).
    """

    loss_chunk_rows = 4096

    def forward(self, hidden, labels=None):
        if labels is None:
            return super().forward(hidden)
        import torch

        from gpudeck.trainers.dflash.loss import chunked_linear_cross_entropy

        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        w = torch.full(y.shape, 1.0 / y.numel(), device=y.device, dtype=acc)
        return chunked_linear_cross_entropy(h, self.weight, y, w, chunk_rows=self.loss_chunk_rows, mode="fused")


def install_chunked_loss(model, chunk_rows: int) -> None:
    """``model(input_ids=..., labels=...)`` returns the mean next-token loss through the chunked head.

    Same parameters and names (checkpoints and exports are unchanged); ``labels`` are
    the already shifted targets, as the trainer passes them. Without labels the model
    behaves as before.
    """
    import types

    head = model.get_output_embeddings()
    head.__class__ = type(f"Chunked{type(head).__name__}", (_ChunkedLossHead, type(head)), {})
    head.loss_chunk_rows = chunk_rows
    plain_forward = model.forward
    base = getattr(model, model.base_model_prefix)

    def forward(self, input_ids=None, labels=None, **kw):
        if labels is None:
            return plain_forward(input_ids=input_ids, **kw)
        hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state
        return head(hidden, labels)

    model.forward = types.MethodType(forward, model)


def evaluate(model, val_set, ctx, device, sdpa_ctx) -> tuple[float, int]:
    """Mean next-token loss over the validation batches of all ranks: (loss, tokens scored).

    No gradients, no RNG, no data position: training after it is bit-identical to
    training without it. The model stays in train mode (the presets have no dropout,
    and switching modes would recompile the compiled blocks).
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sums = torch.zeros(2, device=device, dtype=torch.float64)
    with torch.no_grad():
        for batch in val_set:
            batch = batch.to(device, non_blocking=True)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            with sdpa_ctx():
                logits = model(input_ids=inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            sums[0] += loss.double()
            sums[1] += labels.numel()
            del logits, loss
    if ctx.distributed and ctx.world_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    total, count = sums.tolist()
    return total / count, int(count)


# ------------------------------------------------------------------ export


def export_final(model, config, tokenizer, out: Path, ctx, attn_impl: str) -> Path | None:
    """Gather the full state dict (collective) and save_pretrained on rank 0."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    final = out / "final"
    if ctx.rank == 0:
        sd = {compat.clean_fqn(k): v for k, v in sd.items()}
        plain = build_meta_model(config, "sdpa" if attn_impl == REPEAT_KV_ATTENTION else attn_impl)
        plain.to_empty(device="cpu")
        missing, unexpected = plain.load_state_dict(sd, strict=False)
        missing = [k for k in missing if "rotary" not in k]
        if unexpected or (missing and not (len(missing) == 1 and missing[0].endswith("lm_head.weight"))):
            raise RuntimeError(f"export: missing {missing}, unexpected {unexpected}")
        if getattr(config, "tie_word_embeddings", False):
            plain.tie_weights()
        recompute_rotary(plain, torch.device("cpu"))
        final.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(str(final))
        tokenizer.save(final)
        (final / "gpudeck_tokenizer.json").write_text(json.dumps(tokenizer.describe(), indent=2) + "\n")
    del sd
    return final if ctx.rank == 0 else None


# ------------------------------------------------------------------ main


class FsdpLmTrainer(Trainer):
    """fsdp_lm on the shared loop: FSDP2 causal-LM pretraining (module docstring); the state lives on ``self``."""

    cfg: FsdpLmConfig

    def __init__(self, cfg: FsdpLmConfig, plan: StartPlan) -> None:
        super().__init__(cfg)
        self.out = Path(cfg.out)
        self.plan = plan
        self.losses: dict[int, float] = {}
        self.val_losses: dict[int, float] = {}
        self.tps_hist: list[float] = []
        self.mfu_hist: list[float] = []
        self.mfu_tt_hist: list[float] = []
        self.saved: list[int] = []

    def setup(self) -> None:
        """Processes, device, data, model, optimizer, a resume's checkpoint, the step's tools, the manifest."""
        self._start()
        self._set_device()
        self._setup_data()
        self._setup_model()
        self._resume()
        self._setup_step_tools()
        self._emit_manifest()

    def _start(self) -> None:
        """Stop flag, process group, telemetry, triage hooks; --new-run-dir moves old checkpoints aside."""
        self.stop = install_stop_flag()
        self.ctx = init_distributed(self.cfg.device, init_timeout_s=300.0, single_process_group=True)
        self.tel = Telemetry(rank=self.ctx.rank)
        register(ctx=self.ctx, telemetry=self.tel)
        self.tel.start_heartbeat()
        self.stack_fields = install_stack_dump(self.ctx.rank)  # every thread's stack into the run's folder on SIGUSR2 (gpudeck triage)
        self.stack_fields.update(install_flight_recorder_dump(self.ctx.rank))  # the Flight Recorder as JSON on the agent's request
        self.t_start = time.time()

        if self.plan.archive_existing:
            barrier(self.ctx)
            if self.ctx.rank == 0:
                dest = archive_checkpoints(self.out)
                print(f"fsdp_lm: --new-run-dir: moved old checkpoints to {dest}", file=sys.stderr)
            barrier(self.ctx)
        if self.ctx.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)

    def _set_device(self) -> None:
        """Compute dtype, TF32, determinism, seeds, the SDPA kernel choice."""
        import torch

        self.device = self.ctx.device
        self.on_gpu = self.device.type == "cuda"
        if self.cfg.dtype == "auto":
            self.compute_dtype = torch.bfloat16 if self.on_gpu else torch.float32
        else:
            self.compute_dtype = torch.bfloat16 if self.cfg.dtype == "bf16" else torch.float32
        if self.on_gpu:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if self.cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False
        seed_all(self.cfg.seed)
        self.sdpa_ctx = _sdpa_context(self.cfg.sdpa_backend if self.on_gpu else "auto")

    def _setup_data(self) -> None:
        """Tokenizer, training tokens, validation set (bad data: exit 2 with the fix)."""
        # tokenizer and data
        tok_spec = self.cfg.tokenizer
        self.prepared = None
        if self.cfg.data is not None and is_prepared(self.cfg.data):
            try:
                self.prepared = read_prepared_manifest(self.cfg.data)
            except DataError as exc:
                raise ExitWith(2, str(exc)) from None
            if tok_spec is None:  # the tokenizer the corpus was prepared with
                tok_spec = str(Path(self.cfg.data) / "tokenizer")
        if tok_spec is None and self.cfg.init_from is not None and has_tokenizer(self.cfg.init_from):
            tok_spec = self.cfg.init_from
        self.tokenizer = load_tokenizer(tok_spec)
        if self.prepared is not None and not same_tokenizer(self.tokenizer.describe(), self.prepared["tokenizer"]):
            raise ExitWith(
                2,
                f"--tokenizer {self.cfg.tokenizer}: {self.tokenizer.describe()} is not the tokenizer "
                f"{self.cfg.data} was prepared with ({self.prepared['tokenizer']}); drop --tokenizer "
                "(the prepared one is used) or prepare the corpus again with this one",
            )
        self.config = build_config(self.cfg.model_config, self.cfg.init_from)
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise ExitWith(2, f"tokenizer vocab {self.tokenizer.vocab_size} does not fit the model's vocab_size {self.config.vocab_size}")
        max_pos = getattr(self.config, "max_position_embeddings", None)
        if max_pos is not None and self.cfg.seq_len > max_pos:
            raise ExitWith(2, f"--seq-len {self.cfg.seq_len} exceeds max_position_embeddings {max_pos}")
        try:
            self.source = load_tokens(
                self.cfg.data,
                self.tokenizer,
                dtype=self.cfg.data_dtype,
                max_bytes=self.cfg.corpus_bytes,
                text_column=self.cfg.text_column,
                split=self.cfg.data_split,
            )
        except (DataError, FileNotFoundError) as exc:
            raise ExitWith(2, str(exc)) from None
        top = _max_token(self.source)
        if top >= self.config.vocab_size:
            raise ExitWith(2, f"data has token id {top} >= vocab_size {self.config.vocab_size}")
        self.train_tokens, self.val_tokens, self.val_desc = self.source.tokens, None, None
        try:
            if self.cfg.val_data is not None:
                vsrc = load_tokens(self.cfg.val_data, self.tokenizer, dtype=self.cfg.data_dtype, text_column=self.cfg.text_column)
                self.val_tokens, self.val_desc = vsrc.tokens, vsrc.description
            elif self.cfg.val_fraction > 0:
                self.train_tokens, self.val_tokens = split_tokens(self.source.tokens, self.cfg.val_fraction)
                self.val_desc = f"last {self.cfg.val_fraction:g} of --data's tokens"
            elif self.prepared is not None and self.cfg.data is not None and "val" in self.prepared["splits"]:
                vsrc = load_prepared(self.cfg.data, "val")
                self.val_tokens, self.val_desc = vsrc.tokens, vsrc.description
        except (DataError, FileNotFoundError) as exc:
            raise ExitWith(2, str(exc)) from None
        self.dataset = PackedDataset(self.train_tokens, self.cfg.seq_len)
        self.batches = ShardedBatches(self.dataset, self.cfg.batch_size, self.ctx.rank, self.ctx.world_size, seed=self.cfg.seed)
        self.val_set = None
        if self.val_tokens is not None:
            if self.val_desc is None:  # every branch that sets val_tokens names them too
                raise RuntimeError("validation tokens were loaded without a description")
            try:
                self.val_set = ValidationBatches(
                    PackedDataset(self.val_tokens, self.cfg.seq_len),
                    self.cfg.batch_size,
                    self.cfg.val_batches,
                    self.ctx.rank,
                    self.ctx.world_size,
                    where=self.val_desc,
                )
            except DataError as exc:
                raise ExitWith(2, str(exc)) from None
        self.val_every = self.cfg.val_every
        if self.val_every is None:
            self.val_every = max(1, self.cfg.max_steps // 10) if self.val_set is not None else 0

    def _setup_model(self) -> None:
        """The model on meta, FLOPs, parallelism, weights (from --init-from or seeded), optimizer, schedule."""
        import torch

        # model
        self.model = build_meta_model(self.config, self.cfg.attn_implementation)
        self.counts = model_flops(self.model, self.config, self.cfg.seq_len, training=True)
        self.peak, self.peak_reason = peak_flops(self.device, "bf16" if self.compute_dtype == torch.bfloat16 else "fp32")
        self.par = apply_parallelism(self.model, self.cfg, self.ctx, self.compute_dtype)
        source_state = None
        if self.cfg.init_from is not None:
            from transformers import AutoModelForCausalLM

            src_model = AutoModelForCausalLM.from_pretrained(self.cfg.init_from, dtype=torch.float32)
            source_state = {k: v for k, v in src_model.state_dict().items()}
            del src_model
        materialize(self.model, self.device, self.cfg.seed, float(getattr(self.config, "initializer_range", 0.02)), source_state)
        del source_state
        self.model.train()

        opt_kw: dict[str, Any] = dict(lr=self.cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=self.cfg.weight_decay)
        self.opt_impl = self.cfg.optimizer_impl if self.cfg.optimizer_impl != "auto" else ("fused" if self.on_gpu else "foreach")
        opt_kw[self.opt_impl] = True
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **opt_kw)
        warmup = self.cfg.warmup_steps if self.cfg.warmup_steps is not None else max(1, self.cfg.max_steps // 20)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda_factory(self.cfg.max_steps, warmup, self.cfg.min_lr_ratio)
        )

    def _resume(self) -> None:
        """A resume's model, optimizer, schedule, data position and RNG."""
        self.step = 0
        if not self.plan.fresh:
            if self.plan.step is None:  # resolve_start gives every resume plan its step
                raise RuntimeError(f"resume plan without a checkpoint step: {self.plan}")
            extra = load_checkpoint(
                self.out, self.plan.step, self.model, self.optimizer, rank=self.ctx.rank, trust=self.cfg.trust_checkpoint
            )
            self.step = int(extra["step"])
            self.last_saved = self.step  # nothing new to save when no step follows
            self.scheduler.load_state_dict(extra["scheduler"])
            self.batches.load_state_dict(extra["data"])
            recompute_rotary(self.model, self.device)

    def _setup_step_tools(self) -> None:
        """Loss function, batch feeder, step clock, profiler."""
        import torch

        self.loss_fn = cross_entropy
        if self.cfg.compile_loss == "yes" or (self.cfg.compile_loss == "auto" and self.cfg.compile):
            self.loss_fn = torch.compile(cross_entropy, dynamic=False)
        if self.cfg.loss_impl == "chunked":
            install_chunked_loss(self.model, self.cfg.loss_chunk_rows)
        self.prefetch = self.cfg.prefetch == "yes" or (self.cfg.prefetch == "auto" and self.on_gpu)
        self.feeder = BatchFeeder(self.batches, self.device, pin=self.on_gpu, ahead=self.prefetch)
        self.clock = step_clock(self.on_gpu)  # a step's compute vs collective-wait seconds (CUDA events on GPU, wall time on CPU)
        self.profiler = StepProfiler(self.cfg.profile_start, self.cfg.profile_steps, self.on_gpu, self.ctx.rank)

    def _emit_manifest(self) -> None:
        """The run's manifest record (and its first line on stdout)."""
        import torch

        self.info = device_info(self.device)
        self.tokens_per_step = self.cfg.batch_size * self.cfg.seq_len * self.cfg.grad_accum * self.ctx.world_size
        cfg_dict = self.config.to_dict()
        self.manifest = dict(
            kind="fsdp",
            role="trainer",
            params_total=self.counts.params_total,
            params_trainable=self.counts.params_trainable,
            params_embedding=self.counts.params_embedding,
            config_hash=config_hash(cfg_dict),
            model=self.cfg.model_config or self.cfg.init_from,
            model_type=self.config.model_type,
            world_size=self.ctx.world_size,
            local_rank=self.ctx.local_rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            **self.info,
            dataset_samples=len(self.dataset),
            dataset_tokens=self.dataset.source_tokens,
            dataset_sample_tokens=self.dataset.num_tokens,
            dataset=self.source.description,
            dataset_documents=self.source.documents,
            dataset_unique_documents=self.source.unique_documents,
            dataset_sha256=self.source.sha256,
            dataset_prepared=self.prepared is not None,
            val_dataset=self.val_desc,
            val_samples=None if self.val_set is None else len(self.val_set.dataset),
            val_tokens_per_eval=None if self.val_set is None else self.val_set.tokens_per_rank * self.ctx.world_size,
            val_every=self.val_every if self.val_set is not None else None,
            tokenizer=self.tokenizer.describe(),
            argv=sys.argv,
            start=self.plan.describe(),
            **(self.plan.trust.record() if self.plan.trust is not None else {}),
            seq_len=self.cfg.seq_len,
            batch_size=self.cfg.batch_size,
            grad_accum=self.cfg.grad_accum,
            tokens_per_step=self.tokens_per_step,
            max_steps=self.cfg.max_steps,
            flops_per_token=self.counts.flops_per_token,
            flops_per_token_torchtitan=self.counts.flops_per_token_torchtitan,
            flops_note=self.counts.note,
            mfu_convention=MFU_CONVENTION,
            peak_flops=self.peak,
            mfu_note=self.peak_reason,
            dtype=str(self.compute_dtype).replace("torch.", ""),
            compile=self.cfg.compile,
            compile_mode=self.cfg.compile_mode,
            activation_checkpointing=self.cfg.activation_checkpointing,
            ac_every=self.cfg.ac_every if self.cfg.activation_checkpointing else None,
            loss_impl=self.cfg.loss_impl,
            optimizer_impl=self.opt_impl,
            reduce_dtype=self.cfg.reduce_dtype,
            prefetch=self.prefetch,
            sdpa_backend=self.cfg.sdpa_backend,
            deterministic=self.cfg.deterministic,
            torch=torch.__version__,
            transformers=_transformers_version(),
            **self.par,
            **self.stack_fields,
            compute_timing=self.clock.method,
        )
        self.tel.manifest(**self.manifest)
        if self.ctx.rank == 0:
            print(
                f"fsdp_lm: {self.counts.params_total:,} params ({self.config.model_type}), world {self.ctx.world_size}, "
                f"{self.info['device']}, data {self.source.description}, {len(self.dataset):,} samples, "
                f"start {self.plan.describe()}",
                flush=True,
            )

    def train_step(self) -> bool:
        """One optimizer step over --grad-accum micro-batches; True when any rank was asked to stop."""
        import torch

        maybe_sleep_for_test(self.step + 1, self.ctx.rank)
        t0 = time.perf_counter()
        clock_start = self.clock.mark()
        maybe_fail_for_test(self.step + 1, self.ctx.rank)
        self.profiler.before_step(self.step + 1)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.cfg.grad_accum):
            batch = self.feeder.next()
            inputs, labels = batch[:, :-1], batch[:, 1:]
            self.model.set_requires_gradient_sync(micro == self.cfg.grad_accum - 1)
            with self.sdpa_ctx():
                if self.cfg.loss_impl == "chunked":
                    loss = self.model(input_ids=inputs, labels=labels)
                else:
                    logits = self.model(input_ids=inputs, use_cache=False).logits
                    loss = self.loss_fn(logits, labels)
                    del logits
                (loss / self.cfg.grad_accum).backward()
            loss_sum += loss.detach()
            del loss
            if micro < self.cfg.grad_accum - 1:
                self.feeder.prefetch()
        with self.clock.stall():  # the gradient norm's all-reduce
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        if self.step < self.cfg.max_steps:
            self.feeder.prefetch()  # the GPU still works through this step's kernels
        # one small all-reduce: mean loss over ranks and "anyone asked to stop"
        with self.clock.stall():
            loss_val, stop_now = reduce_mean_and_stop(self.ctx, loss_sum / self.cfg.grad_accum, self.stop.requested)
        gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        gn_val = float(gn)
        dt = time.perf_counter() - t0
        self._report_step(loss_val, gn_val, dt, clock_start)
        return stop_now

    def _report_step(self, loss_val: float, gn_val: float, dt: float, clock_start: Any) -> None:
        """Throughput, MFU and memory: the step's record, its line on stdout; the profiler; the collective timeout after step 1."""
        import torch

        tps = self.tokens_per_step / dt
        mfu_val = compute_mfu(tps / self.ctx.world_size, self.counts.flops_per_token, self.peak)
        mfu_tt = compute_mfu(tps / self.ctx.world_size, self.counts.flops_per_token_torchtitan, self.peak)
        self.losses[self.step] = loss_val
        if self.step > 1:
            self.tps_hist.append(tps)
            if mfu_val is not None and mfu_tt is not None:  # both None together: no peak
                self.mfu_hist.append(mfu_val)
                self.mfu_tt_hist.append(mfu_tt)
        mem_alloc = mem_peak = None
        if self.on_gpu:
            mem_alloc = torch.cuda.memory_allocated(self.device) / 2**30
            mem_peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.tel.step(
            self.step,
            loss=loss_val,
            tokens_per_s=round(tps, 2),
            mfu=None if mfu_val is None else round(mfu_val, 5),
            mfu_torchtitan=None if mfu_tt is None else round(mfu_tt, 5),
            flops_per_token=self.counts.flops_per_token,
            peak_flops=self.peak,
            mem_allocated_gib=None if mem_alloc is None else round(mem_alloc, 3),
            mem_peak_gib=None if mem_peak is None else round(mem_peak, 3),
            lr=self.scheduler.get_last_lr()[0],
            grad_norm=gn_val,
            step_time_s=round(dt, 5),
            tokens=self.step * self.tokens_per_step,
            **self.clock.split(dt, clock_start, self.step),
        )
        if self.ctx.rank == 0 and (self.step % self.cfg.log_every == 0 or self.step == self.cfg.max_steps):
            mfu_s = f"{100 * mfu_val:.1f}%" if mfu_val is not None else "n/a"
            if mfu_tt is not None:
                mfu_s += f" (torchtitan {100 * mfu_tt:.1f}%)"
            print(
                f"step {self.step} loss {loss_val:.6f} tok/s {tps:,.0f} mfu {mfu_s} "
                f"gnorm {gn_val:.3f} lr {self.scheduler.get_last_lr()[0]:.2e} {dt * 1000:.0f} ms",
                flush=True,
            )
        self.profiler.after_step(self.step)
        if self.step == 1:
            # torchtitan shortens it to 100 s here; gpudeck's hang alert (120 s by default) and its triage
            # (within 30 s) must come while the ranks are still alive to be looked at
            set_collective_timeout(self.ctx, COLLECTIVE_TIMEOUT_S)

    def stop_after(self, step: int) -> bool:
        """--stop-at-step: stop as if asked to (checkpoint, no export)."""
        return self.cfg.stop_at_step is not None and step >= self.cfg.stop_at_step

    def validation_due(self, step: int) -> bool:
        """Every --val-every steps and at the last one, when there is a validation set."""
        return self.val_set is not None and (bool(self.val_every and step % self.val_every == 0) or step == self.cfg.max_steps)

    def validate(self, step: int) -> None:
        """Mean next-token loss over the held-out batches of all ranks (a ``val_loss`` record)."""
        t_val = time.perf_counter()
        vloss, vtokens = evaluate(self.model, self.val_set, self.ctx, self.device, self.sdpa_ctx)
        self.val_losses[step] = vloss
        self.tel.emit("val_loss", step=step, val_loss=vloss, val_tokens=vtokens, seconds=round(time.perf_counter() - t_val, 3))
        if self.ctx.rank == 0:
            print(f"step {step} val_loss {vloss:.6f} ({vtokens:,} tokens)", flush=True)

    def save(self, step: int) -> None:
        """A DCP checkpoint of model, optimizer, schedule, data position and RNG (collective)."""
        extra = {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "data": self.feeder.state_dict(),
            "world_size": self.ctx.world_size,
            "config_hash": self.manifest["config_hash"],
        }
        ctx = self.ctx
        done = save_checkpoint(
            self.out, step, self.model, self.optimizer, extra, keep=self.cfg.keep, rank=ctx.rank, barrier=lambda: barrier(ctx)
        )
        self.tel.emit("checkpoint", step=step, **done.record())
        self.saved.append(step)
        self.last_saved = step

    def final_checkpoint(self) -> bool:
        """Not with --no-final-checkpoint (benchmarks)."""
        return not self.cfg.no_final_checkpoint

    def export(self) -> Path | None:
        """OUT/final: config, safetensors and tokenizer, loadable with from_pretrained (not with --no-export)."""
        if self.cfg.no_export:
            return None
        return export_final(self.model, self.config, self.tokenizer, self.out, self.ctx, self.cfg.attn_implementation)

    def finish(self, final: Path | None) -> int:
        """OUT/result.json, the ``done`` record, a clean exit of every rank."""
        result = dict(
            final_step=self.step,
            start=self.plan.describe(),
            stopped=self.stopped,
            losses={str(k): v for k, v in self.losses.items()},
            final_loss=self.losses.get(self.step),
            val_losses={str(k): v for k, v in self.val_losses.items()},
            final_val_loss=self.val_losses.get(self.step),
            tokens_per_s=_mean(self.tps_hist),
            mfu=_mean(self.mfu_hist),
            mfu_torchtitan=_mean(self.mfu_tt_hist),
            mfu_convention=MFU_CONVENTION,
            mfu_note=self.peak_reason,
            flops_per_token=self.counts.flops_per_token,
            flops_per_token_torchtitan=self.counts.flops_per_token_torchtitan,
            peak_flops=self.peak,
            params_total=self.counts.params_total,
            params_trainable=self.counts.params_trainable,
            world_size=self.ctx.world_size,
            device=self.info["device"],
            dataset_samples=len(self.dataset),
            dataset_tokens=self.dataset.source_tokens,
            checkpoints=list_checkpoints(self.out) if self.ctx.rank == 0 else None,
            final_dir=str(final) if final else None,
            seconds=round(time.time() - self.t_start, 3),
        )
        files = []
        if self.ctx.rank == 0:
            (self.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
            files = [str(self.out / "result.json")] + ([str(final)] if final else [])
        self.tel.emit(
            "done",
            final_step=self.step,
            reason="stopped" if self.stopped else "max_steps",
            files=files,
            tokens_per_s=result["tokens_per_s"],
            mfu=result["mfu"],
            mfu_torchtitan=result["mfu_torchtitan"],
        )
        barrier(self.ctx)
        self.tel.close()
        finish_ok(self.ctx)
        return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m gpudeck.trainers.fsdp_lm``: check the command line and the start, then run the trainer."""
    cfg = parse_args(argv)
    try:
        plan = resolve_start(cfg.out, cfg.fresh, cfg.resume, cfg.new_run_dir, trust=cfg.trust_checkpoint)
    except (StartError, CheckpointTrustError) as exc:
        print(f"fsdp_lm: {' '.join(str(exc).split())}", file=sys.stderr)
        with Telemetry() as tel:
            tel.emit("error", message=f"StartError: {exc}", exit_code=2)
        return 2
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return FsdpLmTrainer(cfg, plan).run()


def _sdpa_context(backend: str):
    """A context-manager factory that prefers one SDPA kernel (no-op for "auto")."""
    import contextlib

    if backend == "auto":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if backend == "cudnn":
        order.insert(0, SDPBackend.CUDNN_ATTENTION)
    elif backend == "efficient":
        order = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

    def ctx():
        try:
            return sdpa_kernel(order, set_priority=True)
        except TypeError:  # torch without set_priority
            return sdpa_kernel(order)

    return ctx


def _max_token(source) -> int:
    """Largest token id of a source (a prepared folder's manifest says it without a scan)."""
    if source.manifest is not None and "max_token_id" in source.manifest:
        return int(source.manifest["max_token_id"])
    return int(source.tokens.max(initial=0))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
