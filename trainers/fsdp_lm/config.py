"""Provides fsdp_lm's command line and its typed config (:class:`FsdpLmConfig`, built once by :func:`parse_args`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gpudeck.trainers.common.config import TrainConfig
from gpudeck.trainers.common.runtime import TrainerArgumentParser, add_common_args, check_common_args


@dataclass(frozen=True, kw_only=True, slots=True)
class FsdpLmConfig(TrainConfig):
    """fsdp_lm's options (``--help`` says what each does); the shared ones come from :class:`TrainConfig`."""

    dtype: str = "auto"
    reshard_after_forward: str = "auto"
    attn_implementation: str = "sdpa"
    no_export: bool = False
    compile_loss: str = "auto"
    sdpa_backend: str = "auto"
    compile_mode: str = "default"
    ac_every: int = 1
    loss_impl: str = "plain"
    loss_chunk_rows: int = 4096
    optimizer_impl: str = "auto"
    reduce_dtype: str = "fp32"
    prefetch: str = "auto"
    profile_steps: int = 0
    profile_start: int = 6
    stop_at_step: int | None = None
    no_final_checkpoint: bool = False
    text_column: str | None = None
    data_split: str | None = None
    val_data: str | None = None
    val_fraction: float = 0.0
    val_every: int | None = None
    val_batches: int = 8
    deterministic: bool = False


def build_parser() -> argparse.ArgumentParser:
    p = TrainerArgumentParser(
        prog="python -m gpudeck.trainers.fsdp_lm",
        description="FSDP2 causal-LM pretraining on transformers models (gpudeck).",
    )
    add_common_args(p)
    g = p.add_argument_group("fsdp_lm")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="compute dtype (auto: bf16 on GPU, fp32 on CPU); master weights stay fp32",
    )
    g.add_argument(
        "--reshard-after-forward",
        default="auto",
        choices=["auto", "yes", "no"],
        help="free gathered block params after forward (auto: yes when world size > 1)",
    )
    g.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="transformers attention (sdpa, eager, ...) or sdpa_repeat_kv: SDPA with "
        "the key/value heads repeated, so kernels without grouped-query support "
        "(--sdpa-backend cudnn) can run",
    )
    g.add_argument("--no-export", action="store_true", help="skip writing OUT/final/")
    g.add_argument(
        "--compile-loss", default="auto", choices=["auto", "yes", "no"], help="torch.compile the cross-entropy (auto: with --compile)"
    )
    g.add_argument(
        "--sdpa-backend",
        default="auto",
        choices=["auto", "cudnn", "flash", "efficient"],
        help="preferred scaled-dot-product-attention kernel on GPU (falls back in order cudnn/flash/efficient/math)",
    )
    _add_performance_args(p)
    return p


def _add_performance_args(p: argparse.ArgumentParser) -> None:
    """fsdp_lm's performance options (compile, activation checkpointing, loss, optimizer, prefetch, profiling)."""
    g = p.add_argument_group("fsdp_lm performance")
    g.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "max-autotune-no-cudagraphs", "max-autotune"],
        help="torch.compile mode of the blocks (with --compile); max-autotune tunes the matmuls (minutes of compile time)",
    )
    g.add_argument(
        "--ac-every",
        type=int,
        default=1,
        help="with --activation-checkpointing: checkpoint every Nth block only (selective by layer; 1: all blocks)",
    )
    g.add_argument(
        "--loss-impl",
        default="plain",
        choices=["plain", "chunked"],
        help="plain: lm_head logits then cross-entropy; chunked: lm_head + CE over "
        "row chunks, gradients computed in the forward, the full [tokens, vocab] "
        "logits never stored (less memory: room for a larger --batch-size)",
    )
    g.add_argument("--loss-chunk-rows", type=int, default=4096, help="rows (tokens) per chunk of --loss-impl chunked")
    g.add_argument(
        "--optimizer-impl", default="auto", choices=["auto", "fused", "foreach"], help="AdamW kernel (auto: fused on GPU, foreach on CPU)"
    )
    g.add_argument(
        "--reduce-dtype", default="fp32", choices=["fp32", "bf16"], help="gradient reduce-scatter dtype under bf16 mixed precision"
    )
    g.add_argument(
        "--prefetch",
        default="auto",
        choices=["auto", "yes", "no"],
        help="gather the next batch (pinned, copied ahead on its own) while the GPU works (auto: on GPU)",
    )
    g.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many steps with torch.profiler and print the top kernels "
        "and where the time went (lines starting with 'profile')",
    )
    g.add_argument("--profile-start", type=int, default=6, help="first profiled step (after compilation and warm-up)")
    g.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="stop after this step as if asked to (checkpoint, no export); the schedule still follows --max-steps",
    )
    g.add_argument("--no-final-checkpoint", action="store_true", help="do not save a checkpoint at the end (benchmarks)")
    g.add_argument(
        "--text-column",
        default=None,
        help="the column of a dataset / parquet / arrow --data (or field of JSONL) that "
        "holds the text (default: 'text', else the only string column)",
    )
    g.add_argument("--data-split", default=None, help="split of a saved DatasetDict --data (default: train, or its only split)")
    g.add_argument("--val-data", default=None, help="a second source for the validation loss (any --data kind)")
    g.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="hold out this tail fraction of the tokens for the validation loss "
        "(default 0: a prepared --data's val split if it has one, else none)",
    )
    g.add_argument(
        "--val-every",
        type=int,
        default=None,
        help="validation loss every N steps and at the end (default: max_steps/10 when there is a validation set; 0: only at the end)",
    )
    g.add_argument("--val-batches", type=int, default=8, help="batches of --batch-size per rank that one validation pass reads")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(warn_only) + CUBLAS_WORKSPACE_CONFIG; "
        "for bitwise-reproducible GPU resume also pass --attn-implementation "
        "eager (the flash-attention backward is not deterministic)",
    )


def parse_args(argv: list[str] | None = None) -> FsdpLmConfig:
    """The checked command line as a typed config (exit 2, one line, on a bad option)."""
    p = build_parser()
    args = p.parse_args(argv)
    check_common_args(p, args)
    if args.model_config is None and args.init_from is None:
        args.model_config = "tiny"
    if args.model_config is not None and args.init_from is not None:
        p.error("give --model-config or --init-from, not both")
    if not 0.0 <= args.val_fraction < 1.0:
        p.error(f"--val-fraction {args.val_fraction}: must be in [0, 1)")
    if args.val_fraction > 0 and args.val_data is not None:
        p.error("give --val-data or --val-fraction, not both")
    if args.val_every is not None and args.val_every < 0:
        p.error("--val-every must be >= 0")
    if args.val_batches <= 0:
        p.error("--val-batches must be positive")
    if args.ac_every < 1:
        p.error("--ac-every must be >= 1")
    if args.loss_chunk_rows < 1:
        p.error("--loss-chunk-rows must be positive")
    if args.profile_steps < 0 or args.profile_start < 1:
        p.error("--profile-steps must be >= 0 and --profile-start >= 1")
    return FsdpLmConfig.from_args(args)
