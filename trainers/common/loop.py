"""Provides the training loop the trainers share: a :class:`Trainer` whose steps a trainer overrides (torchtitan's shape).

:meth:`Trainer.run` is the whole loop, and the only place its order is written:

1. :meth:`~Trainer.setup` (processes, data, model, optimizer, a resume's checkpoint: ``self.step``);
2. while ``self.step < max_steps``: :meth:`~Trainer.train_step` (one optimizer step over the
   micro-batches :meth:`~Trainer.micro_batches` gives; it advances ``self.step`` and says whether a stop
   was asked), then stop at :meth:`~Trainer.stop_after`,
   :meth:`~Trainer.validate` when :meth:`~Trainer.validation_due`, :meth:`~Trainer.save` when
   :meth:`~Trainer.checkpoint_due`;
3. the final checkpoint (unless the last step was just saved, or :meth:`~Trainer.final_checkpoint`
   says no), :meth:`~Trainer.export` (not after a stop), :meth:`~Trainer.finish` (result, ``done``).

Each step can be called on its own in a test once :meth:`setup` ran. A trainer overrides what
differs: fsdp_lm (``fsdp_lm/trainer.py``) its set-up, train step, validation, checkpoint and
export; dflash (``dflash/trainer.py``) also :meth:`~Trainer.micro_batches`, whose micro-batches carry the
frozen target's hidden states (computed on the rank, or received from a target rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpudeck.trainers.common.config import TrainConfig

__all__ = ["Trainer"]


class Trainer:
    """The loop (see the module docstring); subclasses override the steps and keep their state on ``self``."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.step = 0  # the last optimizer step taken (a resume sets it in setup)
        self.stopped = False  # asked to stop (a signal, or --stop-at-step)
        self.last_saved: int | None = None  # the step of the newest checkpoint this run saved or resumed from

    def setup(self) -> None:
        """Everything before the first step; sets ``self.step`` when resuming."""
        raise NotImplementedError

    def micro_batches(self, step: int) -> Iterator[Any]:
        """The micro-batches of optimizer step ``step``, in order (a trainer whose train step reads its own feeder needs none)."""
        raise NotImplementedError

    def train_step(self) -> bool:
        """One optimizer step: advances ``self.step``; True when any rank was asked to stop."""
        raise NotImplementedError

    def stop_after(self, step: int) -> bool:
        """Whether to stop after ``step`` as if asked to (checkpoint, no export)."""
        return False

    def validation_due(self, step: int) -> bool:
        """Whether to validate after ``step``."""
        return False

    def validate(self, step: int) -> None:
        """Held-out loss after ``step`` (no gradients, no RNG, no data position: a resume stays exact)."""

    def checkpoint_due(self, step: int) -> bool:
        """Every ``--checkpoint-every`` steps."""
        return bool(self.cfg.checkpoint_every) and step % self.cfg.checkpoint_every == 0

    def save(self, step: int) -> None:
        """A checkpoint of ``step`` (collective); sets ``self.last_saved``."""
        raise NotImplementedError

    def final_checkpoint(self) -> bool:
        """Whether to save a checkpoint at the end."""
        return True

    def export(self) -> Path | None:
        """The trained model in its final form (None: nothing exported)."""
        return None

    def finish(self, exported: Path | None) -> int:
        """The run's result and ``done`` record; returns the exit code."""
        return 0

    def run(self) -> int:
        """Set up, train until ``max_steps`` or a stop, checkpoint, export, finish."""
        self.setup()
        while self.step < self.cfg.max_steps:
            asked = self.train_step()
            if asked or self.stop_after(self.step):
                self.stopped = True
                break
            if self.validation_due(self.step):
                self.validate(self.step)
            if self.checkpoint_due(self.step):
                self.save(self.step)
        if self.last_saved != self.step and self.final_checkpoint():
            self.save(self.step)
        exported = None if self.stopped else self.export()
        return self.finish(exported)
