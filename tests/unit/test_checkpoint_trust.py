"""Unit tests of checkpoint trust (trainers/checkpoint_trust.py, stdlib): what a save records and what a load refuses."""

from __future__ import annotations

import json
import os
import pickle  # noqa: TID251 - the test builds the hostile pickle the check must never read
from pathlib import Path

import pytest

from gpudeck.trainers.checkpoint_trust import CheckpointTrustError, verify_checkpoint, write_manifest
from tests.trainer_harness import WritesMarker


def saved(out: Path, step: int = 4) -> Path:
    """A checkpoint folder as a save leaves it: .metadata, two shards, the manifest with their digests."""
    d = out / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"metadata bytes")
    (d / "__0_0.distcp").write_bytes(b"a" * 100)
    (d / "__1_0.distcp").write_bytes(b"b" * 50)
    write_manifest(d, {"step": step})
    return d


def test_a_saved_checkpoint_verifies_and_its_manifest_records_digest_and_sizes(tmp_path: Path) -> None:
    d = saved(tmp_path / "out")
    manifest = json.loads((d / "gpudeck_checkpoint.json").read_text())
    assert manifest["files"]["__0_0.distcp"] == {"bytes": 100}
    assert manifest["files"][".metadata"]["bytes"] == 14 and len(manifest["files"][".metadata"]["sha256"]) == 64
    verdict = verify_checkpoint(d, out=tmp_path / "out")
    assert verdict.metadata_sha256 == manifest["files"][".metadata"]["sha256"] and verdict.foreign == ()
    assert verdict.record()["checkpoint_trusted_by_flag"] is False


def test_a_tampered_metadata_is_refused_by_name_and_never_unpickled(tmp_path: Path) -> None:
    d = saved(tmp_path / "out")
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(WritesMarker(proof)))
    assert proof.exists()  # the pickle does run code when something unpickles it
    marker = tmp_path / "marker"
    (d / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    for trust in (False, True):  # a digest that differs is refused even with --trust-checkpoint
        with pytest.raises(CheckpointTrustError) as exc:
            verify_checkpoint(d, out=tmp_path / "out", trust=trust)
        assert exc.value.path == d / ".metadata"
        assert ".metadata is not the file this checkpoint saved" in str(exc.value)
    assert not marker.exists()


def test_shards_must_match_the_manifest(tmp_path: Path) -> None:
    d = saved(tmp_path / "out")
    (d / "__1_0.distcp").write_bytes(b"b" * 51)
    with pytest.raises(CheckpointTrustError, match="51 bytes, the save wrote 50") as exc:
        verify_checkpoint(d)
    assert exc.value.path == d / "__1_0.distcp"
    (d / "__1_0.distcp").write_bytes(b"b" * 50)
    (d / "__2_0.distcp").write_bytes(b"c")
    with pytest.raises(CheckpointTrustError, match="not listed"):
        verify_checkpoint(d)
    (d / "__2_0.distcp").unlink()
    (d / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointTrustError, match="__0_0.distcp is missing"):
        verify_checkpoint(d)


@pytest.mark.parametrize("where", ["out", "checkpoints", "step", "metadata"])
def test_a_folder_or_file_another_user_can_write_is_refused_unless_trusted(tmp_path: Path, where: str) -> None:
    out = tmp_path / "out"
    d = saved(out)
    target = {"out": out, "checkpoints": out / "checkpoints", "step": d, "metadata": d / ".metadata"}[where]
    os.chmod(target, 0o777 if target.is_dir() else 0o666)
    with pytest.raises(CheckpointTrustError) as exc:
        verify_checkpoint(d, out=out)
    assert exc.value.path == target
    assert f"{target} is writable by group" in str(exc.value) and "--trust-checkpoint" in str(exc.value) and "chmod go-w" in str(exc.value)
    verdict = verify_checkpoint(d, out=out, trust=True)
    assert verdict.trusted_by_flag and str(target) in verdict.foreign[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_folder_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    d = saved(out)
    os.chown(d, 12345, 12345)
    with pytest.raises(CheckpointTrustError, match="owned by uid 12345"):
        verify_checkpoint(d, out=out)
    assert verify_checkpoint(d, out=out, trust=True).trusted_by_flag


def test_a_symlinked_step_folder_is_refused(tmp_path: Path) -> None:
    real = saved(tmp_path / "elsewhere")
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_4").symlink_to(real)
    with pytest.raises(CheckpointTrustError, match="is a symlink"):
        verify_checkpoint(out / "checkpoints" / "step_4", out=out)


def test_a_manifest_without_digests_needs_the_flag(tmp_path: Path) -> None:
    d = saved(tmp_path / "out")
    (d / "gpudeck_checkpoint.json").write_text('{"step": 4}')
    with pytest.raises(CheckpointTrustError, match="records no digests") as exc:
        verify_checkpoint(d)
    assert exc.value.path == d / "gpudeck_checkpoint.json"
    verdict = verify_checkpoint(d, trust=True)
    assert verdict.trusted_by_flag and verdict.metadata_sha256 is None and "no digests" in verdict.foreign[-1]
    (d / "gpudeck_checkpoint.json").write_text("[1, 2")
    with pytest.raises(CheckpointTrustError, match="not valid JSON"):
        verify_checkpoint(d, trust=True)
