"""dflash's steps one by one on the shared loop, without main(): set-up, micro-batches, a train step, the eval, a checkpoint, the export.

One plain process on CPU (no torchrun: a one-rank group, colocated); the group and the trainer's signal
handlers are put back after.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gpudeck.trainers.common import checkpoint
from gpudeck.trainers.common.loop import Trainer
from gpudeck.trainers.dflash import config
from gpudeck.trainers.dflash import trainer as dflash_trainer
from tests.trainer_harness import DFLASH_SMALL, steps_in_this_process


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    """A colocated DFlash trainer in this process (one-rank group), 3 steps, 2 micro-batches each, an eval after every step, step 1 profiled."""
    monkeypatch.delenv("GPUDECK_TELEMETRY", raising=False)
    argv = [*DFLASH_SMALL, "--eval-prompt-len", "16", "--eval-gen-len", "16", "--eval-samples", "2", "--max-steps", "3"]
    argv += ["--grad-accum", "2", "--eval-every", "1", "--profile-steps", "1-1", "--fresh", "--out", str(tmp_path / "o")]
    (tmp_path / "o").mkdir()
    with steps_in_this_process():
        yield dflash_trainer.DFlashTrainer(config.parse_args(argv), ["dflash", *argv])


def test_each_step_on_its_own(trainer, tmp_path) -> None:
    assert isinstance(trainer, Trainer)
    trainer.setup()
    assert trainer.step == 0 and trainer.role == "colocated" and trainer.first_eval is not None
    assert trainer.first_eval["step"] == 0 and trainer.last_saved is None

    micro = list(trainer.micro_batches(1))  # --grad-accum 2: two micro-batches of the target's features
    assert len(micro) == 2 and all(isinstance(b, dflash_trainer.FeatureBatch) for b in micro)
    b = micro[0]
    assert b.ids.shape == (2, 64) and b.loss_mask.shape == (2, 64) and torch.equal(b.loss_mask, torch.ones_like(b.ids))
    assert b.feats.shape == (2, 64, trainer.n_ctx * trainer.hidden) and not b.feats.requires_grad
    assert b.target_flops[0] > 0 and b.target_s > 0 and b.ready is None

    assert trainer.train_step() is False and trainer.step == 1
    assert "dflash.drafter_forward" in (tmp_path / "o" / "profile" / "rank0.txt").read_text() and trainer.profiler is None
    assert trainer.validation_due(1) and not trainer.validation_due(3)  # the last step is evaluated by export()
    trainer.validate(1)
    assert trainer.last_eval is not None and trainer.last_eval["step"] == 1
    assert not trainer.checkpoint_due(1) and trainer.checkpoint_due(3)
    trainer.save(1)
    assert checkpoint.list_checkpoints(tmp_path / "o") == [1] and trainer.last_saved == 1

    drafter = trainer.export()
    assert drafter == tmp_path / "o" / "drafter" and (drafter / "model.safetensors").is_file()
    assert json.loads((drafter / "dflash_train.json").read_text())["step"] == 1
    assert trainer.finish(drafter) == 0
    result = json.loads((tmp_path / "o" / "result.json").read_text())
    assert result["final_step"] == 1 and result["stopped"] is False and result["drafter_dir"] == str(drafter)
