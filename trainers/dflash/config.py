"""Provides dflash's command line, the checks of its drafter shape, and its typed config (:class:`DFlashConfig`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudeck.trainers.common import runtime
from gpudeck.trainers.common.config import TrainConfig
from gpudeck.trainers.common.limits import LIMITS, check_config, read_config_json
from gpudeck.trainers.presets import PRESETS, parse_index_list


@dataclass(frozen=True, kw_only=True, slots=True)
class DFlashConfig(TrainConfig):
    """dflash's options (``--help`` says what each does), with the drafter shape resolved by :func:`check_args`."""

    batch_size: int = 2
    seq_len: int = 512
    lr: float = 6e-4
    weight_decay: float = 0.0
    target: str | None = None
    target_config: str | None = None
    drafter_config: str | None = None
    drafter_cfg: dict[str, Any] | None = None  # the --drafter-config file, read and checked
    drafter_layers: int = 1
    block_size: int = 16
    num_anchors: int = 512
    gamma: float | None = None
    mask_token_id: int | None = None
    token_budget: int | None = None
    loss_on_prompt: bool = False
    loss_chunk_rows: int = 2048
    loss_mode: str = "fused"
    attn: str = "auto"
    topology: str = "colocated"
    target_ranks: str | None = None
    drafter_ranks: str | None = None
    queue_depth: int = 2
    eval_every: int = 0
    eval_samples: int = 4
    eval_prompt_len: int = 64
    eval_gen_len: int = 64
    val_fraction: float = 0.02
    no_eval: bool = False
    profile_steps: tuple[int, int] | None = None
    dtype: str = "auto"


def parse_args(argv: list[str]) -> DFlashConfig:
    """The checked command line as a typed config (exit 2, one line, on a bad option)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return DFlashConfig.from_args(args)


# ------------------------------------------------------------------ command line


def parse_rank_list(text: str) -> list[int]:
    """'0,1' / '0-1' / '2' -> sorted unique rank list."""
    return parse_index_list(text)


def _step_span(text: str) -> tuple[int, int]:
    a, _, b = str(text).partition("-")
    try:
        lo, hi = int(a), int(b or a)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give steps as A-B (e.g. 6-7)") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"{text!r}: give a rising span of steps >= 1 (e.g. 6-7)")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = runtime.TrainerArgumentParser(
        prog="python -m gpudeck.trainers.dflash",
        description="Train a DFlash drafter on a frozen target's hidden states (colocated or split).",
    )
    runtime.add_common_args(p)
    g = p.add_argument_group("dflash")
    g.add_argument("--target", default=None, help="local pretrained target folder (from_pretrained)")
    g.add_argument(
        "--target-config",
        default=None,
        help=f"random-weight target from a preset ({', '.join(PRESETS)}) or config.json (speed benchmarks); --model-config is an alias",
    )
    g.add_argument(
        "--drafter-config",
        default=None,
        help="a drafter config.json of the published shape (SpecForge's configs/*-dflash.json): "
        "its num_hidden_layers, layer_types, sliding_window, intermediate_size, heads, "
        "block_size and dflash_config (target_layer_ids, mask_token_id) are used; "
        "hidden_size and vocab_size, where given, must be the target's",
    )
    g.add_argument(
        "--drafter-layers",
        type=int,
        default=None,
        help="drafter decoder layers, 1-5 (default 1; with --init-from: the saved drafter's, and a different value is refused)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per block (default 16; with --init-from: the saved drafter's, and a different value is refused)",
    )
    g.add_argument("--num-anchors", type=int, default=512)
    g.add_argument(
        "--gamma",
        type=float,
        default=None,
        help="loss decay gamma (default: the published 4/5/7 for block 8/10/16; other block sizes need it)",
    )
    g.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="block mask token (default, SpecForge's rule: the drafter config's, the tokenizer's "
        "mask token, the first unused embedding slot len(tokenizer), then pad/eos)",
    )
    g.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="prompt/response data: batches of whole records with count x padded length <= "
        "this many tokens (instead of --batch-size records padded to --seq-len)",
    )
    g.add_argument(
        "--loss-on-prompt", action="store_true", help="prompt/response data: supervise the prompt tokens too (default: mask 0 there)"
    )
    g.add_argument("--loss-chunk-rows", type=int, default=2048)
    g.add_argument("--loss-mode", default="fused", choices=["fused", "recompute", "plain"])
    g.add_argument(
        "--attn",
        default="auto",
        choices=["auto", "sdpa", "flex"],
        help="drafter attention in training: dense bool mask + SDPA, or flex attention "
        "with a block mask (CUDA); auto: flex on CUDA, sdpa on CPU. Evaluation "
        "always uses the dense SDPA mask",
    )
    g.add_argument("--topology", default="colocated", choices=["colocated", "split"])
    g.add_argument("--target-ranks", default=None, help="split: ranks running the target (0,1 or 0-1)")
    g.add_argument("--drafter-ranks", default=None, help="split: ranks training the drafter")
    g.add_argument("--queue-depth", type=int, default=2, help="split: batches in flight per rank")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate tau every N steps (0: start/end only)")
    g.add_argument("--eval-samples", type=int, default=4)
    g.add_argument("--eval-prompt-len", type=int, default=64)
    g.add_argument("--eval-gen-len", type=int, default=64)
    g.add_argument("--val-fraction", type=float, default=0.02, help="tail of the stream held out for eval")
    g.add_argument("--no-eval", action="store_true", help="skip tau evaluation (benchmarks)")
    g.add_argument(
        "--profile-steps",
        type=_step_span,
        default=None,
        help="A-B: torch.profiler over steps A..B; the table goes to OUT/profile/rank<r>.txt "
        "(the dflash.* phases and the top ops by device time)",
    )
    g.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="target/compute dtype (auto: bf16 on CUDA, fp32 on CPU)"
    )
    p.set_defaults(lr=6e-4, weight_decay=0.0, seq_len=512, batch_size=2, max_steps=100)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    runtime.check_common_args(p, args)
    if args.target_config is None:
        args.target_config = args.model_config
    if (args.target is None) == (args.target_config is None):
        p.error("give exactly one of --target PATH or --target-config/--model-config")
    if args.target is not None:  # bounded before transformers builds anything from it (ConfigLimitError, exit 2)
        read_config_json(args.target, f"--target {args.target}")
    resolve_drafter_config(p, args)
    resolve_saved_shape(p, args)
    if not 1 <= args.drafter_layers <= 8:
        p.error("--drafter-layers must be in 1..8 (DFlash uses 1-5)")
    if not 2 <= args.block_size <= LIMITS["block_size"]:
        p.error(f"--block-size must be in 2..{LIMITS['block_size']} (DFlash uses 8-16)")
    if not 1 <= args.num_anchors <= MAX_ANCHORS:
        p.error(f"--num-anchors must be in 1..{MAX_ANCHORS} (SpecForge uses 512-1024)")
    from gpudeck.trainers.dflash.gamma import GammaError, decay_gamma  # torch-free: a refusal imports no torch

    try:
        decay_gamma(args.block_size, args.gamma)
    except GammaError as exc:
        p.error(f"--block-size {args.block_size}: {exc}")
    if args.token_budget is not None and args.token_budget < 1:
        p.error("--token-budget must be a positive number of tokens")
    if args.topology == "split" and (not args.target_ranks or not args.drafter_ranks):
        p.error("--topology split needs --target-ranks and --drafter-ranks")
    if args.queue_depth < 1:
        p.error("--queue-depth must be >= 1")


DEFAULT_BLOCK_SIZE = 16
MAX_ANCHORS = 16_384  # anchors x block size drafter positions per sample: 16,384 x 16 is 8x SpecForge's largest
DEFAULT_DRAFTER_LAYERS = 1
# (argparse dest, option, key in the saved drafter's config.json, default, what it is)
_SAVED_SHAPE = [
    ("block_size", "--block-size", "block_size", DEFAULT_BLOCK_SIZE, "block size"),
    ("drafter_layers", "--drafter-layers", "num_hidden_layers", DEFAULT_DRAFTER_LAYERS, "number of layers"),
]


# the drafter's layer kinds as a config's layer_types names them. trainers/dflash/model.py spells the same two: it is
# copied next to a saved drafter as dflash.py and so imports nothing of gpudeck, and importing it (transformers, torch)
# to check a file made a refused run take seconds; tests/unit/test_dflash_shapes.py checks that the two agree
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def read_drafter_config(path: str) -> dict[str, Any]:
    """The ``--drafter-config`` file as a dict, checked; ValueError naming the field and the fix."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--drafter-config {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--drafter-config {path}: the file holds a {type(cfg).__name__}, not a config object")
    check_config(cfg, f"--drafter-config {path}")  # before any list is built from its numbers
    n = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types")
    if n is None and isinstance(types, list):
        n = cfg["num_hidden_layers"] = len(types)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--drafter-config {path}: num_hidden_layers must be a positive integer (got {n!r})")
    if types is None:
        types = cfg["layer_types"] = [FULL_ATTENTION] * n
    if not isinstance(types, list) or len(types) != n or not set(types) <= set(LAYER_TYPES):
        raise ValueError(
            f"--drafter-config {path}: layer_types must list {n} entries (num_hidden_layers), each one "
            f"of {list(LAYER_TYPES)} (got {types!r})"
        )
    if SLIDING_ATTENTION in types:
        w = cfg.get("sliding_window")
        if not isinstance(w, int) or w <= 0 or cfg.get("use_sliding_window") is False:
            raise ValueError(
                f"--drafter-config {path}: sliding_attention layers need a positive sliding_window "
                f"and use_sliding_window true (got sliding_window={w!r}, "
                f"use_sliding_window={cfg.get('use_sliding_window')!r})"
            )
    block = cfg.get("block_size")
    if block is not None and (not isinstance(block, int) or block < 2):
        raise ValueError(f"--drafter-config {path}: block_size must be an integer >= 2 (got {block!r})")
    dc = cfg.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise ValueError(f"--drafter-config {path}: dflash_config must be an object")
    ids = dc.get("target_layer_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids) or not ids):
        raise ValueError(f"--drafter-config {path}: dflash_config.target_layer_ids must be a list of layer indices")
    return cfg


def resolve_drafter_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--drafter-config``: read it, and take its layer count and block size where none is given."""
    args.drafter_cfg = None
    if args.drafter_config is None:
        return
    if args.init_from is not None:
        p.error("give --drafter-config (a new drafter of that shape) or --init-from (continue a saved one), not both")
    try:
        cfg = read_drafter_config(args.drafter_config)
    except ValueError as exc:
        p.error(str(exc))
    n = cfg["num_hidden_layers"]
    if args.drafter_layers is not None and args.drafter_layers != n:
        p.error(
            f"--drafter-layers {args.drafter_layers} differs from the {n} layers (layer_types) of "
            f"--drafter-config {args.drafter_config}; leave out --drafter-layers"
        )
    args.drafter_layers = n
    if args.block_size is None and cfg.get("block_size") is not None:
        args.block_size = int(cfg["block_size"])
    elif args.block_size is not None and cfg.get("block_size") not in (None, args.block_size) and os.environ.get("RANK", "0") == "0":
        print(
            f"dflash: --block-size {args.block_size} replaces the block_size {cfg['block_size']} of --drafter-config {args.drafter_config}",
            file=sys.stderr,
            flush=True,
        )
    args.drafter_cfg = cfg


def drafter_config_from_file(cfg: dict[str, Any], target_config, block_size: int, mask_token_id: int):
    """The drafter's Qwen3Config from a ``--drafter-config`` dict on this target (widths checked)."""
    from gpudeck.trainers.dflash.model import drafter_config_from_target

    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) is not None and int(cfg[key]) != int(getattr(tc, key)):
            raise ValueError(
                f"--drafter-config: {key} {cfg[key]} differs from the target's {getattr(tc, key)}; "
                "the drafter reads the target's embeddings and hidden states at the target's width "
                f"(remove {key} from the file or use a config made for this target)"
            )
    n_target = int(tc.num_hidden_layers)
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if ids is not None and max(ids) >= n_target:
        raise ValueError(
            f"--drafter-config: dflash_config.target_layer_ids {ids} name layers the target does not "
            f"have (it has {n_target}); remove target_layer_ids to space them over this target"
        )
    dcfg = drafter_config_from_target(
        target_config,
        cfg["num_hidden_layers"],
        block_size,
        mask_token_id,
        target_layer_ids=ids,
        layer_types=cfg["layer_types"],
        sliding_window=cfg.get("sliding_window"),
        intermediate_size=cfg.get("intermediate_size"),
    )
    # the published shape's attention widths and RoPE where the file gives them
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings"):
        if cfg.get(key) is not None:
            setattr(dcfg, key, cfg[key])
    rope = cfg.get("rope_parameters")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or cfg.get("rope_theta")
    if theta:
        dcfg.rope_parameters = {"rope_type": "default", "rope_theta": float(theta)}
    return dcfg


def resolve_saved_shape(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set ``--block-size`` and ``--drafter-layers``: as given, the saved drafter's (``--init-from``), or the defaults.

    A drafter is trained for one shape, so ``--init-from`` with a different value
    is refused (exit 2) rather than silently replaced; a value left out is taken
    from the saved drafter and said so on stderr.
    """
    if args.init_from is None:
        for dest, _, _, default, _ in _SAVED_SHAPE:
            if getattr(args, dest) is None:
                setattr(args, dest, default)
        return
    cfg_file = Path(args.init_from) / "config.json"
    saved_cfg = read_config_json(cfg_file, f"--init-from {args.init_from} (the saved drafter)")
    for dest, option, key, _, what in _SAVED_SHAPE:
        saved = saved_cfg.get(key)
        if not isinstance(saved, int):
            p.error(
                f"--init-from {args.init_from}: {cfg_file} has no {key}; is it a saved drafter (OUT/drafter of gpudeck.trainers.dflash)?"
            )
        given = getattr(args, dest)
        if given is None:
            setattr(args, dest, saved)
            if os.environ.get("RANK", "0") == "0":
                print(f"dflash: --init-from {args.init_from}: using its {what} {saved} (no {option} given)", file=sys.stderr, flush=True)
        elif given != saved:
            p.error(
                f"{option} {given} differs from the {what} {saved} of the drafter in "
                f"--init-from {args.init_from}; a drafter is trained for one shape: leave out "
                f"{option} (or pass {option} {saved}) to continue training it, or drop "
                f"--init-from to train a new drafter with {option} {given}"
            )
