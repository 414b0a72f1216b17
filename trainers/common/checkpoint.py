"""Provides checkpoints for the trainers: torch.distributed.checkpoint (DCP), explicit starts.

Layout: ``OUT/checkpoints/step_<N>/`` holds a DCP checkpoint (``.metadata`` +
``__*_*.distcp``) and ``gpudeck_checkpoint.json`` (written by rank 0 after every
rank finished; a folder without it is incomplete and ignored). The manifest records
``.metadata``'s sha256 and every shard's size, and nothing is read from a checkpoint
before :func:`gpudeck.trainers.checkpoint_trust.verify_checkpoint` passed (DCP unpickles
``.metadata``); non-tensor items are read with ``torch.load(weights_only=True)``
(a ``DefaultLoadPlanner`` subclass), so a shard cannot run code either.

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
    ``resolve_start(out, fresh, resume, new_run_dir=False, trust=False) -> StartPlan``
        read-only and deterministic (call it on every rank before heavy work):
        --fresh with existing checkpoints raises unless new_run_dir;
        --resume latest with none raises; --resume N that does not exist raises
        listing the ones that do; a resume's checkpoint is verified (``plan.trust``,
        or :class:`~gpudeck.trainers.checkpoint_trust.CheckpointTrustError`).
    ``archive_checkpoints(out) -> Path | None``  moves OUT/checkpoints to
        OUT/checkpoints.archived-<UTC time> (rank 0 only; used for --new-run-dir).
    ``save_checkpoint(out, step, model, optimizer, extra, keep=None, rank=0,
        barrier=None) -> Saved``  collective; path, seconds, the manifest's files
        (rank 0); prunes to the last ``keep`` complete checkpoints afterwards (rank 0).
    ``load_checkpoint(out, step, model, optimizer, rank=0, trust=False) -> dict``
        collective; verifies the folder first, restores model, optimizer and this
        rank's RNG, returns ``extra``.
    ``read_marker(out, step) -> dict``          the marker JSON of a checkpoint.
    ``rng_state() -> dict[str, Tensor]`` / ``set_rng_state(state)``.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from gpudeck.trainers.checkpoint_trust import CheckpointTrustError, TrustVerdict, harden, verify_checkpoint, write_manifest
from gpudeck.trainers.contract import CHECKPOINT_MARKER as MARKER_FILE
from gpudeck.trainers.contract import CHECKPOINT_METADATA, CHECKPOINTS_DIRNAME
from gpudeck.trainers.contract import STEP_RE as _STEP_RE
from gpudeck.trainers.errors import InputError


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


class StartError(InputError):
    """The requested start (fresh / resume) cannot be honoured; trainers exit 2."""


@dataclass(frozen=True)
class StartPlan:
    fresh: bool
    step: int | None = None  # the checkpoint step when resuming
    archive_existing: bool = False
    trust: TrustVerdict | None = None  # what the resume's checkpoint check found

    def describe(self) -> str:
        return "fresh" if self.fresh else f"resume {self.step}"


def _existing_desc(out: str | os.PathLike, steps: list[int]) -> str:
    return ", ".join(f"step_{s}" for s in steps) if steps else "none"


def resolve_start(
    out: str | os.PathLike, fresh: bool, resume: str | int | None, new_run_dir: bool = False, trust: bool = False
) -> StartPlan:
    """Turn --fresh / --resume into a plan, or raise StartError (or CheckpointTrustError) saying why not."""
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
        want = steps[-1]
    else:
        want = int(resume)  # type: ignore[arg-type]
        if want not in steps:
            raise StartError(
                f"--resume {want}: no complete checkpoint step_{want} in {root}; checkpoints there: {_existing_desc(out, steps)}"
            )
    verdict = verify_checkpoint(checkpoint_path(out, want), out=Path(out), trust=trust)
    return StartPlan(fresh=False, step=want, trust=verdict)


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


class Saved(NamedTuple):
    """A finished save: where, how long, and (rank 0) what its manifest records of its files."""

    path: Path
    seconds: float
    files: dict[str, dict[str, Any]]

    def record(self) -> dict[str, Any]:
        """The telemetry fields of a ``checkpoint`` record: the digest a later resume checks, and the shard sizes."""
        record: dict[str, Any] = {"path": str(self.path), "seconds": round(self.seconds, 3)}
        if self.files:  # rank 0 wrote the manifest
            record["metadata_sha256"] = self.files[CHECKPOINT_METADATA]["sha256"]
            record["shard_bytes"] = {name: f["bytes"] for name, f in self.files.items() if name != CHECKPOINT_METADATA}
        return record


def save_checkpoint(
    out: str | os.PathLike,
    step: int,
    model: Any,
    optimizer: Any,
    extra: dict[str, Any],
    keep: int | None = None,
    rank: int = 0,
    barrier: Callable[[], None] | None = None,
) -> Saved:
    """Save (collective on every rank); returns where and how long. Prunes old ones."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    path = checkpoint_path(out, step)
    if rank == 0:
        if path.exists():  # an incomplete or older save of the same step
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        harden([path.parent])
    if barrier:
        barrier()
    state = _app_state(model, optimizer)
    state["extra_json"] = json.dumps(extra, sort_keys=True)
    state[f"rng_rank{rank}"] = rng_state()
    dcp.save(state, checkpoint_id=str(path))
    if barrier:
        barrier()
    seconds = time.perf_counter() - t0
    files: dict[str, dict[str, Any]] = {}
    if rank == 0:
        harden([path, *path.iterdir()])  # a resume refuses group- or other-writable files
        marker = {"step": int(step), "saved_at": time.time(), "seconds": seconds, "extra_keys": sorted(extra)}
        files = write_manifest(path, marker)["files"]
        if keep:
            prune_checkpoints(out, keep)
    if barrier:
        barrier()
    return Saved(path, seconds, files)


def prune_checkpoints(out: str | os.PathLike, keep: int) -> list[int]:
    """Delete all but the last ``keep`` complete checkpoints; returns deleted steps."""
    steps = list_checkpoints(out)
    doomed = steps[:-keep] if keep > 0 else []
    for s in doomed:
        shutil.rmtree(checkpoint_path(out, s), ignore_errors=True)
    return doomed


def _plain_data_planner(path: Path) -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class PlainDataLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, except that non-tensor items are read with ``weights_only=True`` (plain data only)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            import pickle  # noqa: TID251 - only its error type: the item is read by torch.load(weights_only=True)

            import torch

            try:
                plain = torch.load(value, weights_only=True)  # raises on anything but tensors and plain containers
            except pickle.UnpicklingError:
                item = read_item.dest_index.fqn
                raise CheckpointTrustError(
                    path, f"refusing checkpoint {path}: its item {item!r} is not plain data (a pickle that would run code)"
                ) from None
            again = io.BytesIO()
            torch.save(plain, again)
            again.seek(0)
            super().load_bytes(read_item, again)

    return PlainDataLoadPlanner()


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` with the plain-data planner; a refused item comes out as the CheckpointTrustError it is."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=str(path), planner=_plain_data_planner(path))
    except dcp.CheckpointException as exc:
        refused = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointTrustError)]
        if refused:
            raise refused[0] from None
        raise


def load_checkpoint(out: str | os.PathLike, step: int, model: Any, optimizer: Any, rank: int = 0, trust: bool = False) -> dict[str, Any]:
    """Verify the folder, then load into model/optimizer in place (collective); restores RNG; returns extra."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = checkpoint_path(out, step)
    verify_checkpoint(path, out=Path(out), trust=trust)  # before DCP unpickles .metadata
    state = _app_state(model, optimizer)
    state["extra_json"] = ""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    rng_key = f"rng_rank{rank}"
    have_rng = any(k.startswith(rng_key + ".") or k == rng_key for k in metadata.state_dict_metadata)
    if have_rng:
        state[rng_key] = rng_state()
    _dcp_load(state, path)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if have_rng:
        set_rng_state(state[rng_key])
    return json.loads(state["extra_json"])
