"""last.ckpt for window training: StepCheckpoint's, plus one as soon as a round that frees shards is trained,
each followed by the deletion of the shards it covers (and only those)."""

from __future__ import annotations

from typing import Any

import lightning as L

from eaglet.train.checkpoints import StepCheckpoint, _validation_follows
from eaglet.train.window import WindowDataModule


class WindowCheckpoint(StepCheckpoint):
    """Deletes a shard only once last.ckpt covers its last round: the rounds a checkpoint covers are counted when
    it is taken, and its file is durable (written beside, fsynced, renamed) before any shard goes.

    A round that frees a shard ends at a micro-batch; the checkpoint is taken after the optimizer step that
    follows it (never inside a gradient accumulation, whose gradients a checkpoint does not hold), and after
    that step's validation when one follows, as StepCheckpoint does.
    """

    def __init__(self, dirpath: Any, every_n_train_steps: int, data: WindowDataModule, run: str) -> None:
        super().__init__(dirpath, every_n_train_steps)
        self.data, self.run = data, run
        self._step_before = 0
        self._covered = 0  # rounds the latest checkpoint covers: the same on every rank

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        super().on_train_start(trainer, module)
        self._covered = self.data.rounds_done()
        # A run killed between a checkpoint and its deletions: the checkpoint resumed from covers them.
        if trainer.is_global_zero:
            self.data.retire_done(self._covered, self.run)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        stepped = trainer.global_step > self._step_before
        done_with = self.data.schedule.done_with
        frees = len(done_with(self.data.rounds_done())) > len(done_with(self._covered))
        if stepped and frees and not self._should_skip_saving_checkpoint(trainer):
            if _validation_follows(trainer):
                self._defer_save_until_validation = True  # ModelCheckpoint.on_validation_end saves it
                return
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            return
        super().on_train_batch_end(trainer, *args)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        covered = self.data.rounds_done()
        super()._save_checkpoint(trainer, filepath)
        self._covered = covered
        if trainer.is_global_zero:
            self.data.retire_done(covered, self.run)
