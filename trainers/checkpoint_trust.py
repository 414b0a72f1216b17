"""Provides checkpoint trust: what a checkpoint's manifest records at save, and the check before anything is unpickled.

Stdlib only: the trainers run it before torch reads a checkpoint, and the agent's pre-flight
(``resume_checkpoint``) runs the same check before it launches a resume.

Why: torch.distributed.checkpoint unpickles ``step_<N>/.metadata`` to read a checkpoint (and
``torch.load``\\s its non-tensor items), so whoever can write that folder can run code in the
trainer, as the trainer's (often the agent's) user. So:

- at save, rank 0 records in the manifest (``gpudeck_checkpoint.json``) the sha256 and size of
  ``.metadata`` and the size of every shard (:func:`describe_files`, :func:`write_manifest`), and
  takes group/other write off the folder and its files (:func:`harden`);
- before a load, :func:`verify_checkpoint` refuses (:class:`CheckpointTrustError`, naming the file)
  a folder on the way from ``--out`` to the files that another user can write (group- or
  other-writable, owned by another uid than ours or root, or a symlink below ``--out``), a
  manifest without digests (saved before they were recorded), a ``.metadata`` whose digest or
  size differs, and a shard missing, resized or not listed.

A checkpoint from elsewhere (another user's folder, an old one without digests) loads only with
``--trust-checkpoint``; the digests are checked even then, and the run's telemetry says it was trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudeck.trainers.contract import CHECKPOINT_MARKER, CHECKPOINT_METADATA, CHECKPOINTS_DIRNAME
from gpudeck.trainers.errors import InputError

MANIFEST_FORMAT = 2  # 1: no digests (before checkpoint trust); 2: ``files`` with .metadata's sha256 and every shard's size
MAX_MANIFEST_BYTES = 1 << 20
SHARD_SUFFIX = ".distcp"
TRUST_FLAG = "--trust-checkpoint"

__all__ = [
    "MANIFEST_FORMAT",
    "TRUST_FLAG",
    "CheckpointTrustError",
    "TrustVerdict",
    "describe_files",
    "harden",
    "sha256_file",
    "verify_checkpoint",
    "write_manifest",
]


class CheckpointTrustError(InputError):
    """A checkpoint that must not be loaded: ``path`` names the file or folder, the message says what to do."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class TrustVerdict:
    """What :func:`verify_checkpoint` found: the digest it checked and why the folder is foreign (empty when it is ours)."""

    folder: str
    metadata_sha256: str | None
    foreign: tuple[str, ...] = field(default_factory=tuple)
    trusted_by_flag: bool = False

    def record(self) -> dict[str, Any]:
        """The fields a run's telemetry (manifest and checkpoint load) carries."""
        return {
            "checkpoint_folder": self.folder,
            "checkpoint_metadata_sha256": self.metadata_sha256,
            "checkpoint_trusted_by_flag": self.trusted_by_flag,
            "checkpoint_foreign": list(self.foreign),
        }


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def describe_files(step_dir: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": n[, "sha256": hex]}}`` for ``.metadata`` (with its digest) and every shard of a saved checkpoint."""
    files: dict[str, dict[str, Any]] = {}
    meta = step_dir / CHECKPOINT_METADATA
    files[CHECKPOINT_METADATA] = {"bytes": meta.stat().st_size, "sha256": sha256_file(meta)}
    for shard in sorted(step_dir.glob("*" + SHARD_SUFFIX)):
        files[shard.name] = {"bytes": shard.stat().st_size}
    return files


def write_manifest(step_dir: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """Write ``gpudeck_checkpoint.json`` (atomically) with ``fields``, the format and the files' digests; returns it."""
    manifest = {**fields, "format": MANIFEST_FORMAT, "files": describe_files(step_dir)}
    tmp = step_dir / (CHECKPOINT_MARKER + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, step_dir / CHECKPOINT_MARKER)
    return manifest


def harden(paths: list[Path]) -> None:
    """Take group and other write off each path we own (folders and files a save made under a loose umask)."""
    me = os.geteuid()
    for p in paths:
        st = os.lstat(p)
        if st.st_uid == me and not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
            os.chmod(p, stat.S_IMODE(st.st_mode) & ~0o022)


def _owner_problem(path: Path, follow: bool) -> str | None:
    """Why another user could write ``path`` (None when only we or root can)."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink (it can point anywhere)"
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if st.st_mode & 0o022:
        who = "group" if st.st_mode & 0o020 else "other users"
        return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}); `chmod go-w {path}`"
    return None


def _ownership_problems(out: Path | None, step_dir: Path) -> list[tuple[Path, str]]:
    """Every folder from ``out`` down to ``step_dir``, and every file in it, that another user can write: (path, why)."""
    problems = []
    chain: list[tuple[Path, bool]] = []
    if out is not None:
        chain.append((out, True))  # --out itself may be a symlink the user made
        chain.append((out / CHECKPOINTS_DIRNAME, False))
    else:
        chain.append((step_dir.parent, True))
    chain.append((step_dir, False))
    chain.extend((p, False) for p in sorted(step_dir.iterdir()))
    for path, follow in chain:
        problem = _owner_problem(path, follow)
        if problem:
            problems.append((path, problem))
    return problems


def _read_manifest(step_dir: Path) -> dict[str, Any]:
    path = step_dir / CHECKPOINT_MARKER
    if not path.is_file():
        raise CheckpointTrustError(path, f"{path} is missing: the checkpoint is incomplete; resume from another one or start --fresh")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointTrustError(path, f"{path} is over {MAX_MANIFEST_BYTES} bytes: not a manifest gpudeck wrote")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointTrustError(path, f"{path} is not valid JSON ({exc}): not a manifest gpudeck wrote") from None
    if not isinstance(manifest, dict):
        raise CheckpointTrustError(path, f"{path} is not a JSON object: not a manifest gpudeck wrote")
    return manifest


def _check_files(step_dir: Path, files: dict[str, Any]) -> str:
    """Check ``.metadata``'s digest and every shard's size against the manifest; returns the digest."""
    manifest = step_dir / CHECKPOINT_MARKER
    meta_entry = files.get(CHECKPOINT_METADATA)
    if not isinstance(meta_entry, dict) or not isinstance(meta_entry.get("sha256"), str):
        raise CheckpointTrustError(manifest, f"{manifest} records no sha256 for {CHECKPOINT_METADATA}: not a manifest gpudeck wrote")
    meta = step_dir / CHECKPOINT_METADATA
    if not meta.is_file():
        raise CheckpointTrustError(meta, f"{meta} is missing: the checkpoint is incomplete")
    if meta.stat().st_size != meta_entry.get("bytes") or sha256_file(meta) != meta_entry["sha256"]:
        raise CheckpointTrustError(
            meta,
            f"{meta} is not the file this checkpoint saved (its sha256 differs from {manifest}'s); "
            "it was replaced or damaged and is not read: resume from another checkpoint or start --fresh",
        )
    on_disk = {p.name for p in step_dir.glob("*" + SHARD_SUFFIX)}
    listed = {name for name in files if name.endswith(SHARD_SUFFIX)}
    for name in sorted(on_disk - listed):
        raise CheckpointTrustError(step_dir / name, f"{step_dir / name} is not listed in {manifest}: a file added after the save")
    for name in sorted(listed):
        shard = step_dir / name
        want = files[name].get("bytes") if isinstance(files[name], dict) else None
        if not shard.is_file():
            raise CheckpointTrustError(shard, f"{shard} is missing: the checkpoint is incomplete")
        if shard.stat().st_size != want:
            raise CheckpointTrustError(shard, f"{shard} has {shard.stat().st_size} bytes, the save wrote {want}: replaced or damaged")
    return meta_entry["sha256"]


def verify_checkpoint(step_dir: Path, out: Path | None = None, trust: bool = False) -> TrustVerdict:
    """Check a checkpoint folder before anything in it is unpickled; raise :class:`CheckpointTrustError` naming the file.

    ``out``: the run's ``--out`` (the chain of folders checked starts there; None: the step's parent).
    ``trust`` (``--trust-checkpoint``): load a foreign folder or one saved without digests; the digests
    that are recorded are checked anyway.
    """
    step_dir = Path(step_dir)
    problems = _ownership_problems(out, step_dir)
    foreign = tuple(why for _, why in problems)
    if problems and not trust:
        raise CheckpointTrustError(
            problems[0][0],
            f"refusing to load checkpoint {step_dir}: {foreign[0]}; another user could have put code in it. "
            f"Fix the permissions, or pass {TRUST_FLAG} if you know who wrote it",
        )
    manifest = _read_manifest(step_dir)
    files = manifest.get("files")
    if not isinstance(files, dict):
        if not trust:
            path = step_dir / CHECKPOINT_MARKER
            raise CheckpointTrustError(
                path,
                f"refusing to load checkpoint {step_dir}: {path} records no digests (saved before gpudeck recorded them, "
                f"or not by gpudeck); pass {TRUST_FLAG} if you know who wrote it",
            )
        return TrustVerdict(str(step_dir), None, (*foreign, "the manifest records no digests"), trusted_by_flag=True)
    digest = _check_files(step_dir, files)
    return TrustVerdict(str(step_dir), digest, foreign, trusted_by_flag=bool(trust and foreign))
