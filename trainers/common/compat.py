"""Provides every private name of torch and transformers that the trainers reach, in one place; nothing else reaches one.

A torch or transformers upgrade re-checks this list (``tests/unit/test_compat.py`` fails when a name
moves; ``tests/gpu/`` runs the FSDP2 brackets for real on CUDA):

==========================================================================  ==============================================
private name                                                                what the trainers use it for
==========================================================================  ==============================================
``torch.distributed.fsdp._fully_shard._fsdp_param_group``                   FSDP2's compute stream waits on a collective
``.FSDPParamGroup.wait_for_unshard``                                        (a block's all-gather): bracketed by CUDA
                                                                            events for ``compute_s``/``wait_s``
``...FSDPParamGroup.post_backward``                                         the wait for the previous reduce-scatter
``torch.distributed.fsdp._fully_shard._fsdp_state``                         the wait for the last reduce-scatters at the
``.FSDPState._root_post_backward_final_callback``                           end of backward
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``             activation checkpointing per block (torchtitan
``.checkpoint_wrapper``; its ``_checkpoint_wrapped_module.`` name prefix    imports it from the same place)
``torch._dynamo.config.cache_size_limit``                                   room for one compiled graph per block
``_orig_mod.`` (the name prefix of a ``torch.compile``'d module)            parameter names as saved and exported
``torch._C._distributed_c10d._dump_fr_trace_json``,                         the Flight Recorder's JSON dump (gloo; NCCL in
``._dump_nccl_trace_json``                                                  a CUDA build) on the agent's request
``transformers.PretrainedConfig._attn_implementation``                      the attention kernel a config builds with (set
                                                                            before ``from_config`` on the meta device)
==========================================================================  ==============================================

Tested with torch 2.13.0 (CPU, ``constraints-dev.txt``; every name resolves, the FSDP2 points are
patched only on CUDA) and torch 2.11 on the H200 box (``tests/gpu``); transformers 5.25.
A point that no longer resolves is skipped, not fatal: :func:`patch_fsdp_stalls` returns what it
patched and the trainers' manifest records it, so a silent loss of the brackets shows there too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = [
    "CHECKPOINT_WRAPPER_PREFIX",
    "COMPILED_PREFIX",
    "FSDP_STALL_POINTS",
    "checkpoint_wrapper",
    "clean_fqn",
    "flight_recorder_dumps",
    "patch_fsdp_stalls",
    "raise_dynamo_cache_limit",
    "set_attn_implementation",
]

# FSDP2's points where the compute stream waits on a collective stream: (module, class, method)
FSDP_STALL_POINTS = (
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", "wait_for_unshard"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", "post_backward"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "_root_post_backward_final_callback"),
)
CHECKPOINT_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."
COMPILED_PREFIX = "_orig_mod."
FLIGHT_RECORDER_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
_MARK = "_gpudeck_stall"


def patch_fsdp_stalls(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> list[str]:
    """Replace each FSDP2 stall point with ``wrap(original)`` (once per process); returns ``Class.method`` of those patched."""
    done = []
    for module_name, cls_name, meth in FSDP_STALL_POINTS:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
            original = getattr(cls, meth)
        except (ImportError, AttributeError):
            continue  # another torch: that point is not bracketed (the manifest lists those that are)
        if not getattr(original, _MARK, False):
            wrapped = wrap(original)
            setattr(wrapped, _MARK, True)
            setattr(cls, meth, wrapped)
        done.append(f"{cls_name}.{meth}")
    return done


def checkpoint_wrapper(module: Any, preserve_rng_state: bool = False) -> Any:
    """torch's activation-checkpoint wrapper around ``module`` (its parameters gain :data:`CHECKPOINT_WRAPPER_PREFIX`)."""
    wrapper = importlib.import_module(CHECKPOINT_WRAPPER_MODULE).checkpoint_wrapper
    return wrapper(module, preserve_rng_state=preserve_rng_state)


def clean_fqn(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (activation checkpointing, torch.compile)."""
    return name.replace(CHECKPOINT_WRAPPER_PREFIX, "").replace(COMPILED_PREFIX, "")


def raise_dynamo_cache_limit(at_least: int) -> None:
    """Let dynamo keep at least ``at_least`` compiled graphs per code object (one per block when guards split them)."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, at_least)


def flight_recorder_dumps() -> list[Callable[..., Any]]:
    """torch's JSON dumps of its Flight Recorders: the CPU one (gloo) and, in a CUDA build, NCCL's."""
    try:
        c10d = importlib.import_module("torch._C._distributed_c10d")
    except ImportError:
        return []
    return [f for f in (getattr(c10d, n, None) for n in FLIGHT_RECORDER_DUMPS) if f is not None]


def set_attn_implementation(config: Any, name: str) -> None:
    """Make a transformers config build its attention with ``name`` (sdpa, eager, flex_attention or a registered one)."""
    config._attn_implementation = name
