"""Provides the contract the trainers, the agent and the console share, stdlib only.

One table each, read by every side instead of a copy per side:

- :data:`TRAINER_MODULES`: the launch kind -> the trainer module it runs;
- :data:`START_FLAGS`: the trainers' start options (``--fresh``, ``--resume N``,
  ``--new-run-dir``) and :func:`start_argv` / :func:`strip_start`;
- the checkpoint folder layout (``OUT/checkpoints/step_<N>/`` with the marker
  and DCP's ``.metadata`` when complete), as ``trainers/common/checkpoint.py`` writes it;
- the named model configs (:data:`PRESETS`) and the index-list syntax
  (:func:`parse_index_list`: ``0,1`` / ``0-3``), from ``trainers/presets.py``;
- :func:`stack_file`: where a trainer rank's faulthandler writes its stacks in
  the run's folder (``RUN_DIR/stacks/rank<R>.<PID>.txt``), for gpudeck's triage;
  :func:`flight_recorder_request_file` / :func:`flight_recorder_dump_file`: the
  Flight Recorder request the agent writes and the JSON dump each rank answers with;
- :data:`TRAINER_ARGS`: the trainer options that pre-flight's memory estimate
  reads, declared once (name, what it takes, default, which trainers have it).

Stdlib only: the agent has no torch, and the console imports this too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from gpudeck.trainers.presets import PRESETS, parse_index_list

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "CHECKPOINT_MARKER",
    "CHECKPOINT_METADATA",
    "KINDS",
    "PRESETS",
    "START_FLAGS",
    "STEP_RE",
    "LEGACY_MODULES",
    "TRAINER_ARGS",
    "TRAINER_KINDS",
    "TRAINER_MODULES",
    "TrainerArg",
    "kind_of_module",
    "parse_index_list",
    "flight_recorder_dump_file",
    "flight_recorder_request_file",
    "stack_file",
    "trainer_module",
    "start_argv",
    "step_dirname",
    "strip_start",
    "trainer_args",
]

# ----------------------------------------------------------------------------- kinds

KINDS = ("command", "fsdp", "dflash")
TRAINER_MODULES: dict[str, str] = {"fsdp": "gpudeck.trainers.fsdp_lm", "dflash": "gpudeck.trainers.dflash"}
TRAINER_KINDS = tuple(TRAINER_MODULES)


# Runs recorded before gpudeck's packages moved under the ``gpudeck`` namespace ran ``-m trainers.X``
# from a checkout: their specs still name that module, and relaunching one must still find its trainer.
LEGACY_MODULES: dict[str, str] = {m.removeprefix("gpudeck."): m for m in TRAINER_MODULES.values()}


def trainer_module(module_or_script: str) -> str | None:
    """The trainer module that ``-m MODULE`` or ``python SCRIPT`` runs, or None for any other program.

    Accepts the module name, its pre-namespace name (``trainers.fsdp_lm``) and a path to the file
    (``trainers/fsdp_lm.py``, ``/src/gpudeck/trainers/dflash.py``: the files before the trainers became packages).
    """
    if module_or_script in TRAINER_MODULES.values():
        return module_or_script
    if module_or_script in LEGACY_MODULES:
        return LEGACY_MODULES[module_or_script]
    path = module_or_script.replace("\\", "/")
    for module in TRAINER_MODULES.values():
        if path == (tail := "/".join(module.split(".")[-2:]) + ".py") or path.endswith("/" + tail):
            return module
    return None


def kind_of_module(module: str) -> str | None:
    """The launch kind whose trainer is ``module`` (None for any other module)."""
    found = trainer_module(module)
    return next((k for k, m in TRAINER_MODULES.items() if m == found), None)


# ----------------------------------------------------------------------------- starts

# every trainer takes exactly one of --fresh / --resume latest|N; --new-run-dir only with --fresh
START_FLAGS = ("--fresh", "--resume", "--new-run-dir")


def strip_start(argv: list[str]) -> list[str]:
    """``argv`` without any start option (``--fresh``, ``--new-run-dir``, ``--resume N``, ``--resume=N``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--fresh", "--new-run-dir") or a.startswith("--resume="):
            continue
        if a == "--resume":
            skip = True
            continue
        out.append(a)
    return out


def start_argv(start: str) -> list[str]:
    """The trainer options for a start: ``fresh`` -> ``--fresh``; ``resume N`` -> ``--resume N``."""
    if start == "fresh":
        return ["--fresh"]
    what, _, step = start.partition(" ")
    if what != "resume" or not step:
        raise ValueError(f"start {start!r} is neither 'fresh' nor 'resume N'")
    return ["--resume", step]


# ----------------------------------------------------------------------------- checkpoints


def stack_file(run_dir: str, rank: int, pid: int) -> str:
    """Where rank ``rank`` (pid ``pid``) of a trainer appends its stacks on the triage's signal (trainers/common/diagnostics.py)."""
    return f"{run_dir}/stacks/rank{rank}.{pid}.txt"


def flight_recorder_request_file(run_dir: str) -> str:
    """The file the agent writes a nonce into to ask every trainer rank for a Flight Recorder dump (trainers/common/diagnostics.py)."""
    return f"{run_dir}/flight_recorder/request"


def flight_recorder_dump_file(run_dir: str, rank: int, pid: int) -> str:
    """Where rank ``rank`` (pid ``pid``) writes its Flight Recorder dump, JSON, on the agent's request."""
    return f"{run_dir}/flight_recorder/rank{rank}.{pid}.json"


CHECKPOINTS_DIRNAME = "checkpoints"  # OUT/checkpoints
CHECKPOINT_MARKER = "gpudeck_checkpoint.json"  # written by rank 0 once every rank finished
CHECKPOINT_METADATA = ".metadata"  # DCP's own index
STEP_RE = re.compile(r"^step_(\d+)$")


def step_dirname(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"step_{int(step)}"


# ----------------------------------------------------------------------------- trainer arguments


@dataclass(frozen=True)
class TrainerArg:
    """One trainer option as pre-flight reads it: what it takes, its default, which trainers have it."""

    flag: str
    takes: Literal["str", "int", "flag"] = "str"
    default: str | int | bool | None = None
    trainers: tuple[str, ...] = tuple(TRAINER_MODULES.values())


_BOTH = tuple(TRAINER_MODULES.values())
_FSDP = ("gpudeck.trainers.fsdp_lm",)
_DFLASH = ("gpudeck.trainers.dflash",)

# Every option that takes a value is declared (as str where the estimate ignores it), so a value is never
# mistaken for something else. Defaults follow the trainers (tests/unit/test_estimate.py compares them).
TRAINER_ARGS: tuple[TrainerArg, ...] = (
    *(
        TrainerArg(f)
        for f in (
            "--model-config",
            "--init-from",
            "--data",
            "--tokenizer",
            "--data-dtype",
            "--corpus-bytes",
            "--max-steps",
            "--lr",
            "--min-lr-ratio",
            "--warmup-steps",
            "--weight-decay",
            "--grad-clip",
            "--seed",
            "--checkpoint-every",
            "--keep",
            "--out",
            "--log-every",
            "--resume",
        )
    ),
    TrainerArg("--device", default="auto"),
    TrainerArg("--dtype", default="auto"),
    *(TrainerArg(f, "flag", False) for f in ("--fresh", "--new-run-dir", "--trust-checkpoint", "--compile", "--activation-checkpointing")),
    TrainerArg("--batch-size", "int", 8, _FSDP),
    TrainerArg("--seq-len", "int", 512, _FSDP),
    TrainerArg("--batch-size", "int", 2, _DFLASH),
    TrainerArg("--seq-len", "int", 512, _DFLASH),
    TrainerArg("--grad-accum", "int", 1),
    # dflash
    *(
        TrainerArg(f, trainers=_DFLASH)
        for f in (
            "--target",
            "--target-config",
            "--gamma",
            "--mask-token-id",
            "--target-ranks",
            "--drafter-ranks",
            "--eval-every",
            "--eval-samples",
            "--eval-prompt-len",
            "--eval-gen-len",
            "--val-fraction",
        )
    ),
    TrainerArg("--drafter-layers", "int", None, _DFLASH),  # None until resolved (from the target's depth)
    TrainerArg("--block-size", "int", None, _DFLASH),
    TrainerArg("--num-anchors", "int", 512, _DFLASH),
    TrainerArg("--loss-chunk-rows", "int", 2048, _DFLASH),
    TrainerArg("--loss-mode", default="fused", trainers=_DFLASH),
    TrainerArg("--attn", default="auto", trainers=_DFLASH),
    TrainerArg("--topology", default="colocated", trainers=_DFLASH),
    TrainerArg("--queue-depth", "int", 2, _DFLASH),
    TrainerArg("--no-eval", "flag", False, _DFLASH),
    *(TrainerArg(f, trainers=_DFLASH) for f in ("--drafter-config", "--profile-steps")),
    TrainerArg("--token-budget", "int", None, _DFLASH),
    TrainerArg("--loss-on-prompt", "flag", False, _DFLASH),
    # fsdp_lm
    *(TrainerArg(f, trainers=_FSDP) for f in ("--attn-implementation", "--sdpa-backend", "--stop-at-step")),
    TrainerArg("--compile-loss", default="auto", trainers=_FSDP),
    TrainerArg("--reshard-after-forward", default="auto", trainers=_FSDP),
    *(TrainerArg(f, "flag", False, _FSDP) for f in ("--no-export", "--no-final-checkpoint", "--deterministic")),
    # fsdp_lm corpora, validation and performance options (--loss-impl chunked and --ac-every change
    # the activations; the estimate does not read them yet)
    *(
        TrainerArg(f, trainers=_FSDP)
        for f in (
            "--text-column",
            "--data-split",
            "--val-data",
            "--val-fraction",
            "--val-every",
            "--val-batches",
            "--compile-mode",
            "--ac-every",
            "--optimizer-impl",
            "--reduce-dtype",
            "--prefetch",
            "--profile-steps",
            "--profile-start",
        )
    ),
    TrainerArg("--loss-impl", default="plain", trainers=_FSDP),
    TrainerArg("--loss-chunk-rows", "int", 4096, _FSDP),
)


def trainer_args(trainer: str) -> list[TrainerArg]:
    """The declared options of one trainer module."""
    return [a for a in TRAINER_ARGS if trainer in a.trainers]
