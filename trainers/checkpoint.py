"""Provides checkpoints for the trainers: torch.distributed.checkpoint (DCP), explicit starts.

Layout: ``OUT/checkpoints/step_<N>/`` holds a DCP checkpoint (``.metadata`` +
``__*_*.distcp``) and ``gpudeck_checkpoint.json`` (written by rank 0 after every
rank finished; a folder without it is incomplete and ignored).

What a checkpoint holds: the model and optimizer (via
``get_state_dict``/``set_state_dict``, so FSDP2-sharded models save their shards
and reshard on load), every rank's RNG state (torch CPU + CUDA), and ``extra``:
a JSON-able dict the trainer chooses (step, scheduler state, data position, ...).

Public API (kept stable; dflash imports it):

    ``CHECKPOINTS_DIRNAME = "checkpoints"``, ``MARKER_FILE``
    ``checkpoints_dir(out) -> Path``            OUT/checkpoints
    ``checkpoint_path(out, step) -> Path``      OUT/checkpoints/step_<step>
    ``list_checkpoints(out) -> list[int]``      complete checkpoints, ascending
    ``StartError``   (exit code 2 is what trainers use for it)
    ``StartPlan``    fresh: bool, step: int | None; ``describe()`` -> "fresh" | "resume N"
    ``resolve_start(out, fresh, resume, new_run_dir=False) -> StartPlan``
        read-only and deterministic (call it on every rank before heavy work):
        --fresh with existing checkpoints raises unless new_run_dir;
        --resume latest with none raises; --resume N that does not exist raises
        listing the ones that do.
    ``archive_checkpoints(out) -> Path | None``  moves OUT/checkpoints to
        OUT/checkpoints.archived-<UTC time> (rank 0 only; used for --new-run-dir).
    ``save_checkpoint(out, step, model, optimizer, extra, keep=None, rank=0,
        barrier=None) -> (path, seconds)``  collective; prunes to the last
        ``keep`` complete checkpoints afterwards (rank 0).
    ``load_checkpoint(out, step, model, optimizer, rank=0) -> dict``  collective;
        restores model, optimizer and this rank's RNG, returns ``extra``.
    ``read_marker(out, step) -> dict``          the marker JSON of a checkpoint.
    ``rng_state() -> dict[str, Tensor]`` / ``set_rng_state(state)``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudeck.trainers.contract import CHECKPOINT_MARKER as MARKER_FILE
from gpudeck.trainers.contract import CHECKPOINTS_DIRNAME
from gpudeck.trainers.contract import STEP_RE as _STEP_RE


def checkpoints_dir(out: str | os.PathLike) -> Path:
    return Path(out) / CHECKPOINTS_DIRNAME


def checkpoint_path(out: str | os.PathLike, step: int) -> Path:
    return checkpoints_dir(out) / f"step_{int(step)}"


def list_checkpoints(out: str | os.PathLike) -> list[int]:
    """Steps of complete checkpoints (marker present), ascending."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and (child / MARKER_FILE).is_file() and (child / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_marker(out: str | os.PathLike, step: int) -> dict[str, Any]:
    return json.loads((checkpoint_path(out, step) / MARKER_FILE).read_text())


class StartError(Exception):
    """The requested start (fresh / resume) cannot be honoured; trainers exit 2."""


@dataclass(frozen=True)
class StartPlan:
    fresh: bool
    step: int | None = None  # the checkpoint step when resuming
    archive_existing: bool = False

    def describe(self) -> str:
        return "fresh" if self.fresh else f"resume {self.step}"


def _existing_desc(out: str | os.PathLike, steps: list[int]) -> str:
    return ", ".join(f"step_{s}" for s in steps) if steps else "none"


def resolve_start(out: str | os.PathLike, fresh: bool, resume: str | int | None, new_run_dir: bool = False) -> StartPlan:
    """Turn --fresh / --resume into a plan, or raise StartError saying why not."""
    if fresh == (resume is not None):
        raise StartError("pick exactly one start: --fresh or --resume latest|N")
    steps = list_checkpoints(out)
    root = checkpoints_dir(out)
    if fresh:
        has_any = root.is_dir() and any(_STEP_RE.match(c.name) for c in root.iterdir())
        if has_any and not new_run_dir:
            raise StartError(
                f"--fresh refuses to write into {root}: it already holds checkpoints "
                f"({_existing_desc(out, steps)}). Use --resume latest|N to continue that run, "
                "add --new-run-dir to move them aside and start over here, or pick another --out."
            )
        return StartPlan(fresh=True, step=None, archive_existing=has_any)
    if str(resume) == "latest":
        if not steps:
            raise StartError(f"--resume latest: no complete checkpoint in {root}; use --fresh to start")
        return StartPlan(fresh=False, step=steps[-1])
    want = int(resume)  # type: ignore[arg-type]
    if want not in steps:
        raise StartError(f"--resume {want}: no complete checkpoint step_{want} in {root}; checkpoints there: {_existing_desc(out, steps)}")
    return StartPlan(fresh=False, step=want)


def archive_checkpoints(out: str | os.PathLike) -> Path | None:
    """Move OUT/checkpoints aside (nothing is deleted); returns the new path."""
    root = checkpoints_dir(out)
    if not root.exists():
        return None
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    dest = root.with_name(f"{CHECKPOINTS_DIRNAME}.archived-{stamp}")
    n = 1
    while dest.exists():
        dest = root.with_name(f"{CHECKPOINTS_DIRNAME}.archived-{stamp}-{n}")
        n += 1
    root.rename(dest)
    return dest


# ------------------------------------------------------------------ RNG


def rng_state() -> dict[str, Any]:
    import torch

    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    if "cpu" in state:
        torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


# ------------------------------------------------------------------ save / load


def _app_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(
    out: str | os.PathLike,
    step: int,
    model: Any,
    optimizer: Any,
    extra: dict[str, Any],
    keep: int | None = None,
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
) -> tuple[Path, float]:
    """Save (collective on every rank); returns (path, seconds). Prunes old ones."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    path = checkpoint_path(out, step)
    if rank == 0 and path.exists():  # an incomplete or older save of the same step
        shutil.rmtree(path)
    if barrier:
        barrier()
    state = _app_state(model, optimizer)
    state["extra_json"] = json.dumps(extra, sort_keys=True)
    state[f"rng_rank{rank}"] = rng_state()
    dcp.save(state, checkpoint_id=str(path))
    if barrier:
        barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        marker = {"step": int(step), "saved_at": time.time(), "seconds": seconds, "extra_keys": sorted(extra)}
        tmp = path / (MARKER_FILE + ".tmp")
        tmp.write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(tmp, path / MARKER_FILE)
        if keep:
            prune_checkpoints(out, keep)
    if barrier:
        barrier()
    return path, seconds


def prune_checkpoints(out: str | os.PathLike, keep: int) -> list[int]:
    """Delete all but the last ``keep`` complete checkpoints; returns deleted steps."""
    steps = list_checkpoints(out)
    doomed = steps[:-keep] if keep > 0 else []
    for s in doomed:
        shutil.rmtree(checkpoint_path(out, s), ignore_errors=True)
    return doomed


def load_checkpoint(out: str | os.PathLike, step: int, model: Any, optimizer: Any, rank: int = 0) -> dict[str, Any]:
    """Load into model/optimizer in place (collective); restores RNG; returns extra."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = checkpoint_path(out, step)
    state = _app_state(model, optimizer)
    state["extra_json"] = ""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    rng_key = f"rng_rank{rank}"
    have_rng = any(k.startswith(rng_key + ".") or k == rng_key for k in metadata.state_dict_metadata)
    if have_rng:
        state[rng_key] = rng_state()
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if have_rng:
        set_rng_state(state[rng_key])
    return json.loads(state["extra_json"])
