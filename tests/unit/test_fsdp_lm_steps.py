"""fsdp_lm's steps one by one, without main(): set-up, a train step, validation, a checkpoint, the export.

One plain process on CPU (no torchrun: a one-rank group); the group and the trainer's signal handlers are put back after.
"""

from __future__ import annotations

import signal

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gpudeck.trainers.common.checkpoint import list_checkpoints, resolve_start
from gpudeck.trainers.fsdp_lm.config import parse_args
from gpudeck.trainers.fsdp_lm.trainer import FsdpLmTrainer


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUDECK_TELEMETRY", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    cfg = parse_args(
        ["--model-config", "tiny", "--seq-len", "32", "--batch-size", "2", "--corpus-bytes", "100000", "--max-steps", "4"]
        + ["--val-fraction", "0.1", "--val-batches", "1", "--fresh", "--out", str(tmp_path / "o")]
    )
    t = FsdpLmTrainer(cfg, resolve_start(cfg.out, cfg.fresh, cfg.resume))
    yield t
    for s, h in handlers.items():
        signal.signal(s, h)
    import torch.distributed as dist

    if dist.is_initialized():  # set-up made a one-rank group: leave none behind for the next test
        dist.destroy_process_group()


def test_each_step_on_its_own(trainer, tmp_path) -> None:
    trainer.setup()
    assert trainer.step == 0 and trainer.val_set is not None
    assert trainer.train_step() is False
    assert trainer.step == 1 and set(trainer.losses) == {1}
    trainer.validate(1)
    assert set(trainer.val_losses) == {1} and trainer.val_losses[1] > 0
    trainer.save(1)
    assert list_checkpoints(tmp_path / "o") == [1] and trainer.last_saved == 1
    final = trainer.export()
    assert final is not None and (final / "config.json").is_file()
    assert trainer.stop_after(1) is False and trainer.validation_due(4) and not trainer.checkpoint_due(1)
