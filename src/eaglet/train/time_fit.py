"""The learning-rate schedule fitted to a run's time budget (trainer.fit_steps_to_time).

A run given trainer.max_time_s stops when its time is up. Its schedule spans the steps planned for it
(trainer.max_steps, or max_epochs' worth), so a plan made from a guessed step rate either ends early, leaving time
unused, or is cut mid-decay at a learning rate still high. `FitStepsToTime` measures the run's own rate of
optimizer steps, validations and checkpoints included, and every few steps shortens the schedule to the steps that
the time left allows at that rate, never beyond the plan: the cosine then reaches its floor as the time runs out,
on whatever machine. The fitted length is the module's `schedule_steps`, kept in checkpoints, so a resumed run
continues its schedule (its rate is measured again).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, Timer

from eaglet.train.module import DraftHeadModule

# Steps not timed after the run (or a resumed run) starts: compilation, the allocator and the loader's first
# batches make them slower than the rest.
SETTLE_STEPS = 5
# Refit every this many optimizer steps (a broadcast from rank 0 under several processes).
REFIT_EVERY_N_STEPS = 10
# The share of the measured rate planned on: a rate a few percent slower later (a validation, a checkpoint)
# still ends on the schedule's floor, not at the time limit mid-decay.
RATE_MARGIN = 0.97


# The recent rate is timed over this many refits (500 steps): a run that slows down (a hotter GPU, a loader
# falling behind) is planned on its new rate rather than on its average since the start. Long enough to hold a
# validation (every 400 steps in the scale recipe), so that one does not read as a slowdown.
RECENT_REFITS = 50


def fitted_steps(*, step: int, planned: int, rate: float, seconds_left: float, margin: float) -> int:
    """The schedule's length at `step`: the steps done plus those the time left allows at `rate` (steps a
    second) times `margin`; at most `planned`, at least one more than done."""
    return max(step + 1, min(planned, step + math.floor(seconds_left * rate * margin)))


def timed_rate(marks: Sequence[tuple[int, float]]) -> float:
    """Steps a second from (step, seconds elapsed) marks, oldest first: the slower of the rate since the first
    mark and the rate over the last RECENT_REFITS marks: a rate that falls is believed within RECENT_REFITS
    refits, one that rises only as the whole run's average does (the safe side: the run ends a little early)."""

    def rate(first: tuple[int, float], last: tuple[int, float]) -> float:
        return (last[0] - first[0]) / max(last[1] - first[1], 1e-9)

    return min(rate(marks[0], marks[-1]), rate(marks[max(0, len(marks) - 1 - RECENT_REFITS)], marks[-1]))


class FitStepsToTime(Callback):
    """Shortens `module.schedule_steps` and the trainer's max_steps to what trainer.max_time_s allows."""

    def __init__(
        self,
        *,
        settle_steps: int = SETTLE_STEPS,
        every_n_steps: int = REFIT_EVERY_N_STEPS,
        margin: float = RATE_MARGIN,
    ) -> None:
        self.settle_steps = settle_steps
        self.every_n_steps = every_n_steps
        self.margin = margin
        self._timer: Timer | None = None
        self._planned = 0
        self._start_step = 0
        self._marks: list[
            tuple[int, float]
        ] = []  # (step, seconds elapsed) at the timing's start and each refit
        self._last_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: DraftHeadModule) -> None:
        timers = [callback for callback in trainer.callbacks if isinstance(callback, Timer)]
        if not timers:
            raise RuntimeError("FitStepsToTime needs the trainer's time limit (max_time): none is set")
        self._timer = timers[0]
        self._planned = int(pl_module.hparams.total_steps)
        self._start_step = trainer.global_step
        self._marks = []
        self._last_step = trainer.global_step
        # A resumed run keeps the length its checkpoint fitted.
        self._apply(trainer, pl_module, min(self._planned, int(pl_module.schedule_steps)))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: DraftHeadModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step or self._timer is None:  # a micro-batch that did not step the optimizer
            return
        self._last_step = step
        elapsed = self._timer.time_elapsed("train")
        if not self._marks:
            if step - self._start_step >= self.settle_steps:
                self._marks.append((step, elapsed))
            return
        if (step - self._marks[0][0]) % self.every_n_steps:
            return
        self._marks.append((step, elapsed))
        length = fitted_steps(
            step=step,
            planned=self._planned,
            rate=timed_rate(self._marks),
            seconds_left=self._timer.time_remaining("train") or 0.0,
            margin=self.margin,
        )
        # Every process ends on the same step: rank 0's measurement decides.
        self._apply(trainer, pl_module, int(trainer.strategy.broadcast(length, src=0)))

    @staticmethod
    def _apply(trainer: L.Trainer, pl_module: DraftHeadModule, length: int) -> None:
        pl_module.schedule_steps = length
        trainer.fit_loop.epoch_loop.max_steps = length
