"""The learning-rate schedule fitted to a run's time (trainer.fit_steps_to_time, eaglet.train.time_fit)."""

from __future__ import annotations

import csv
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Timer
from test_train import shards, train_overrides  # noqa: F401 (the module-scoped shards fixture)

from eaglet.errors import ConfigError
from eaglet.train.module import SCHEDULE_STEPS
from eaglet.train.run import run_training
from eaglet.train.time_fit import RECENT_REFITS, FitStepsToTime, fitted_steps, timed_rate


def test_the_fitted_length_is_the_steps_the_time_left_allows_at_the_timed_rate() -> None:
    # 10 steps/s, 30 s left: 300 more steps, 291 at a 97% margin.
    common = {"step": 250, "rate": 10.0, "seconds_left": 30.0}
    assert fitted_steps(**common, planned=10_000, margin=1.0) == 550
    assert fitted_steps(**common, planned=10_000, margin=0.97) == 250 + 291
    assert fitted_steps(**common, planned=400, margin=1.0) == 400  # never beyond the plan
    # Out of time: one more step, so the schedule ends at its floor on it.
    assert fitted_steps(**{**common, "seconds_left": 0.0}, planned=10_000, margin=1.0) == 251


def test_the_rate_is_the_slower_of_the_whole_and_the_recent_one() -> None:
    steady = [(10 * i, float(i)) for i in range(30)]  # 10 steps/s throughout
    assert timed_rate(steady) == pytest.approx(10.0)
    n = RECENT_REFITS + 1
    slowed = [*steady, *[(290 + 10 * i, 29.0 + 2 * i) for i in range(1, n + 1)]]  # then 5 steps/s, n refits
    assert timed_rate(slowed) == pytest.approx(5.0)
    quickened = [*steady, *[(290 + 10 * i, 29.0 + 0.5 * i) for i in range(1, n + 1)]]  # then 20 steps/s
    last_step, last_s = quickened[-1]
    assert timed_rate(quickened) == pytest.approx(last_step / last_s)  # the whole run's, the slower


class ClockTimer(Timer):
    """Lightning's Timer on a clock the test moves."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(duration={"seconds": limit_s})
        self.now = 0.0
        self.limit_s = limit_s

    def time_elapsed(self, stage: str = "train") -> float:
        return self.now

    def time_remaining(self, stage: str = "train") -> float:
        return max(0.0, self.limit_s - self.now)


def fake_run(timer: ClockTimer, planned: int, schedule_steps: int | None = None, global_step: int = 0):
    epoch_loop = SimpleNamespace(max_steps=planned)
    trainer = SimpleNamespace(
        callbacks=[timer],
        global_step=global_step,
        fit_loop=SimpleNamespace(epoch_loop=epoch_loop),
        strategy=SimpleNamespace(broadcast=lambda value, src=0: value),
    )
    module = SimpleNamespace(
        hparams=SimpleNamespace(total_steps=planned),
        schedule_steps=planned if schedule_steps is None else schedule_steps,
    )
    return trainer, module


def step_through(
    fit: FitStepsToTime, trainer, module, timer: ClockTimer, seconds_per_step, until: int
) -> None:
    """Optimizer steps at `seconds_per_step(step)` each (two micro-batches a step) until the trainer's max_steps or
    `until`, the way Lightning calls the callback."""
    while trainer.global_step < min(until, trainer.fit_loop.epoch_loop.max_steps):
        fit.on_train_batch_end(trainer, module, None, None, 0)  # the accumulating micro-batch: no step
        timer.now += seconds_per_step(trainer.global_step)
        trainer.global_step += 1
        fit.on_train_batch_end(trainer, module, None, None, 0)


def test_the_schedule_ends_as_the_time_does_at_the_runs_own_rate() -> None:
    """Planned for 10,000 steps, given 60 s at 0.05 s a step (a first, slow step): ~1,200 steps, ending in time."""
    timer = ClockTimer(60.0)
    trainer, module = fake_run(timer, planned=10_000)
    fit = FitStepsToTime()
    fit.on_train_start(trainer, module)
    step_through(fit, trainer, module, timer, lambda step: 5.0 if step == 0 else 0.05, until=10_000)
    # The run's end is the schedule's: max_steps and schedule_steps agree, within the time, close to its end.
    assert trainer.global_step == trainer.fit_loop.epoch_loop.max_steps == module.schedule_steps
    assert 55.0 * 0.95 <= timer.now <= 60.0
    assert 1_050 <= trainer.global_step <= 1_100  # (60 - 5) / 0.05 = 1,100 steps fit after the first


def test_a_run_slower_than_its_first_steps_still_ends_within_its_time() -> None:
    """The rate halves halfway: later refits shorten the schedule again, and the run ends before the time."""
    timer = ClockTimer(100.0)
    trainer, module = fake_run(timer, planned=50_000)
    fit = FitStepsToTime()
    fit.on_train_start(trainer, module)
    step_through(fit, trainer, module, timer, lambda step: 0.01 if timer.now < 50 else 0.02, until=50_000)
    assert trainer.global_step == module.schedule_steps and timer.now <= 100.0
    assert timer.now >= 90.0  # and the time is used


def test_a_plan_shorter_than_the_time_is_kept() -> None:
    timer = ClockTimer(1_000.0)
    trainer, module = fake_run(timer, planned=300)
    fit = FitStepsToTime()
    fit.on_train_start(trainer, module)
    step_through(fit, trainer, module, timer, lambda step: 0.1, until=10_000)
    assert trainer.global_step == module.schedule_steps == 300 and timer.now == pytest.approx(30.0)


def test_a_resumed_run_keeps_the_length_its_checkpoint_fitted() -> None:
    timer = ClockTimer(60.0)
    trainer, module = fake_run(timer, planned=10_000, schedule_steps=700, global_step=400)
    FitStepsToTime().on_train_start(trainer, module)
    assert trainer.fit_loop.epoch_loop.max_steps == module.schedule_steps == 700


def test_fitting_needs_a_time_limit_and_a_run_of_steps(compose) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.fit_steps_to_time=true .* trainer\.max_time_s"):
        compose("trainer.fit_steps_to_time=true")
    with pytest.raises(ConfigError, match=r"trainer\.features=window"):
        compose("trainer.fit_steps_to_time=true", "trainer.max_time_s=60", "trainer.features=window")


def lr_rows(run_dir: Path) -> list[tuple[int, float]]:
    rows = csv.DictReader(open(run_dir / "metrics.csv"))
    return [(int(r["step"]), float(r["lr-AdamW"])) for r in rows if r.get("lr-AdamW")]


class StepClock:
    """A Timer's two readings on a clock that moves 0.1 s per optimizer step: a real run's timing, without the
    machine's speed in it."""

    def __init__(self, trainer, limit_s: float) -> None:
        self.trainer, self.limit_s = trainer, limit_s

    def time_elapsed(self, stage: str = "train") -> float:
        return 0.1 * self.trainer.global_step

    def time_remaining(self, stage: str = "train") -> float:
        return max(0.0, self.limit_s - self.time_elapsed())


class FitToStepClock(FitStepsToTime):
    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._timer = StepClock(trainer, limit_s=3.0)


def test_a_real_run_fitted_to_its_time_decays_to_the_floor(
    compose,
    shards: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real run planned for 100,000 steps whose clock gives it 3 s at 10 steps a second: it ends on its fitted
    schedule's last step, step 30 as the clock runs out (each refit plans 97% of the steps left, and at least one
    more), at the cosine's floor, and its checkpoint records the length. (Lightning's own time limit, 600 s, never
    comes; refits every 2 steps after 1.)"""
    monkeypatch.setattr(
        "eaglet.train.run.FitStepsToTime", partial(FitToStepClock, settle_steps=1, every_n_steps=2)
    )
    run_dir = tmp_path / "run"
    overrides = train_overrides(
        shards, tmp_path, "trainer.max_steps=100000", "trainer.max_time_s=600", "trainer.fit_steps_to_time=true",
        "trainer.val_every_n_steps=100000", "trainer.checkpoint_every_n_steps=100000", "trainer.lr=1e-3",
    )  # fmt: skip
    summary = run_training(compose(*overrides), run_dir)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert summary.steps == checkpoint[SCHEDULE_STEPS] == 30
    lrs = lr_rows(run_dir)
    # Unfitted, the 100,000-step plan's warm-up (1,000 steps) would hold the rate under 3.1e-5 for all 30 steps.
    assert max(lr for _, lr in lrs) >= 0.9e-3
    assert lrs[-1][0] == 29 and lrs[-1][1] <= 0.11e-3  # the last step's rate: the floor, 10% of the peak
