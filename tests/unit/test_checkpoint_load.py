"""Tests of trainers/common/checkpoint.py's save and load with real torch (one process, no process group): nothing unverified is unpickled."""

from __future__ import annotations

import json
import pickle  # noqa: TID251 - the test builds the hostile pickles the loader must never run
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gpudeck.trainers.checkpoint_trust import CheckpointTrustError, write_manifest
from gpudeck.trainers.common.checkpoint import load_checkpoint, resolve_start, save_checkpoint
from tests.trainer_harness import WritesMarker


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_save_records_digests_and_a_load_gives_the_same_weights(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer(0)
    done = save_checkpoint(tmp_path, 3, model, optimizer, {"step": 3, "note": "x"})
    record = done.record()
    assert len(record["metadata_sha256"]) == 64 and record["shard_bytes"] and all(n > 0 for n in record["shard_bytes"].values())
    manifest = json.loads((done.path / "gpudeck_checkpoint.json").read_text())
    assert manifest["files"][".metadata"]["sha256"] == record["metadata_sha256"]
    plan = resolve_start(tmp_path, fresh=False, resume="latest")
    assert plan.step == 3 and plan.trust is not None and plan.trust.metadata_sha256 == record["metadata_sha256"]
    other, other_opt = model_and_optimizer(1)
    extra = load_checkpoint(tmp_path, 3, other, other_opt)
    assert extra == {"step": 3, "note": "x"}
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)


def test_a_tampered_metadata_is_refused_before_dcp_reads_it(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer(0)
    done = save_checkpoint(tmp_path, 3, model, optimizer, {"step": 3})
    marker = tmp_path / "marker"
    (done.path / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    with pytest.raises(CheckpointTrustError) as exc:
        resolve_start(tmp_path, fresh=False, resume="latest")
    assert exc.value.path == done.path / ".metadata"
    with pytest.raises(CheckpointTrustError):
        load_checkpoint(tmp_path, 3, model, optimizer, trust=True)
    assert not marker.exists()


def test_a_non_tensor_item_is_read_as_plain_data_only(tmp_path: Path) -> None:
    """A shard whose non-tensor item is a hostile pickle (its manifest rewritten to match) still runs nothing."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "marker"
    step_dir = tmp_path / "checkpoints" / "step_5"
    model = torch.nn.Linear(1, 1)
    dcp.save({"model": model.state_dict(), "extra_json": WritesMarker(marker)}, checkpoint_id=str(step_dir))
    write_manifest(step_dir, {"step": 5})
    assert not marker.exists()
    with pytest.raises(CheckpointTrustError, match="its item 'extra_json' is not plain data"):
        load_checkpoint(tmp_path, 5, model, None)
    assert not marker.exists()
