"""Provides the trainers' typed configs: frozen, keyword-only dataclasses built once from the parsed command line.

:class:`TrainConfig` holds the options both trainers share (``runtime.add_common_args``); each
trainer's config subclasses it with its own (``fsdp_lm.config.FsdpLmConfig``,
``dflash.config.DFlashConfig``). :meth:`TrainConfig.from_args` takes every field from the argparse
namespace and refuses a namespace with an option the config does not declare, so an option
added to a parser without a typed field fails at once (``tests/unit/test_trainer_config.py``).
Nothing is added to a config after it is built: state derived while training lives on the trainer.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Self

__all__ = ["TrainConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """The options both trainers share (see ``runtime.add_common_args`` for what each means)."""

    # model
    model_config: str | None = None
    init_from: str | None = None
    # data
    data: str | None = None
    tokenizer: str | None = None
    data_dtype: str = "uint16"
    corpus_bytes: int = 16 * 1024 * 1024
    # start
    fresh: bool = False
    resume: str | None = None
    new_run_dir: bool = False
    trust_checkpoint: bool = False
    # training
    max_steps: int = 100
    batch_size: int = 8
    seq_len: int = 512
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    # checkpoints and output
    checkpoint_every: int = 0
    keep: int = 3
    out: str
    log_every: int = 1
    # performance
    compile: bool = False
    activation_checkpointing: bool = False
    device: str = "auto"

    @classmethod
    def from_args(cls, ns: argparse.Namespace, **derived: Any) -> Self:
        """The config of a parsed command line (``derived``: fields the parser's checks worked out, e.g. a read file)."""
        names = {f.name for f in fields(cls)}
        given = {**vars(ns), **derived}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"{cls.__name__} declares no field for {', '.join(unknown)}: add them to the config")
        return cls(**{k: v for k, v in given.items() if k in names})
