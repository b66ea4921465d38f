"""A training run extended from the config (conf/callbacks, conf/logger) and recorded in W&B: a callback added
on the command line is called, wrong entries fail naming their key, ckpt_path=last continues the same W&B
run and evaluation writes into it (tiny random Llama target, W&B offline)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from test_train import shards, train_overrides  # noqa: F401  (module fixture: shards by the real extraction)

from eaglet.errors import ConfigError
from eaglet.evaluate.record import track_evaluation
from eaglet.evaluate.stage import plot_acceptance
from eaglet.tracking import read_record
from eaglet.train.extensions import build_extensions
from eaglet.train.run import run_training

SHORT = ("trainer.max_steps=2", "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2")


class Recorder(L.Callback):
    """Writes the optimizer step after every training batch to `path`: proof it was built and called."""

    def __init__(self, path: str, tag: str) -> None:
        self.path, self.tag = Path(path), tag

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        with open(self.path, "a") as f:
            f.write(f"{self.tag} {trainer.global_step}\n")


def test_a_callback_from_the_command_line_is_called_and_logger_none_logs_nothing(
    compose,
    shards: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    calls = tmp_path / "calls.txt"
    added = [
        f"+callbacks.recorder._target_={__name__}.Recorder",
        f"+callbacks.recorder.path={calls}",
        "+callbacks.recorder.tag=seen",
        "logger=none",
    ]
    summary = run_training(compose(*train_overrides(shards, tmp_path, *SHORT, *added)), tmp_path / "run")
    # Two micro-batches per optimizer step (global batch 1024, 512 tokens per device), two steps.
    assert calls.read_text().split("\n")[:-1] == ["seen 0", "seen 1", "seen 1", "seen 2"]
    assert summary.steps == 2 and Path(summary.best_checkpoint).is_file()
    assert not (tmp_path / "run" / "metrics.csv").exists() and not (tmp_path / "run" / "wandb").exists()


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (
            "+callbacks.early_stop._target_=lightning.pytorch.callbacks.EarlyStoping",
            "callbacks.early_stop._target_=lightning.pytorch.callbacks.EarlyStoping does not import",
        ),
        ("+callbacks.early_stop.monitor=val/loss", "callbacks.early_stop has no _target_"),
        (
            "logger.csv._target_=eaglet.nowhere.Logger",
            "logger.csv._target_=eaglet.nowhere.Logger does not import",
        ),
        (
            "callbacks.throughput.length_fn._target_=eaglet.train.monitors.tokens",
            "callbacks.throughput.length_fn._target_=eaglet.train.monitors.tokens does not import",
        ),
    ],
)
def test_a_wrong_entry_stops_training_before_any_work_naming_its_key(
    compose, tmp_path: Path, override: str, match: str
) -> None:
    cfg = compose(*train_overrides(tmp_path / "no-shards", tmp_path), override)
    with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
        run_training(cfg, tmp_path / "run")  # before the missing shards are noticed


def test_an_entry_that_cannot_be_built_names_its_key(compose, tmp_path: Path) -> None:
    cfg = compose(
        "+callbacks.early_stop._target_=lightning.pytorch.callbacks.EarlyStopping",
        "+callbacks.early_stop.monitr=val/loss",
    )
    with pytest.raises(
        ConfigError,
        match=r"callbacks\.early_stop could not be built \(.*EarlyStopping\): TypeError: .*monitr",
    ):
        build_extensions(cfg, tmp_path, resumed=False)
    cfg = compose(
        "+callbacks.lr._target_=eaglet.train.monitors.packed_tokens", "+callbacks.lr._partial_=true"
    )
    with pytest.raises(
        ConfigError, match=r"callbacks\.lr\._target_=eaglet.train.monitors.packed_tokens built a "
    ):
        build_extensions(cfg, tmp_path, resumed=False)


def test_logger_options_compose(compose, tmp_path: Path) -> None:
    assert set(compose("logger=[wandb,tensorboard]").logger) == {"csv", "wandb", "tensorboard"}
    assert set(compose("logger=csv").logger) == {"csv"}
    none = compose("logger=none")
    assert not none.logger and none.callbacks.lr_monitor is None
    try:  # tensorboard is an optional package: without it, one message that names the key and the package
        built = build_extensions(compose("logger=tensorboard"), tmp_path, resumed=False)
        assert [type(lg).__name__ for lg in built.loggers] == ["RunCSVLogger", "TensorBoardLogger"]
    except ConfigError as exc:
        assert str(exc).startswith("logger.tensorboard could not be built") and "tensorboard" in str(exc)[40:]


def _offline_runs(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "wandb").glob("offline-run-*"))


def test_ckpt_path_last_continues_the_same_wandb_run_and_evaluation_writes_into_it(
    compose,
    shards: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    overrides = train_overrides(shards, tmp_path, *SHORT)
    first = Path(run_training(compose(*overrides), tmp_path / "train" / "first").run_dir)
    record = read_record(first)
    assert record.name == "first" and [name[-8:] for name in _offline_runs(first)] == [record.id]

    resumed = run_training(compose(*overrides, "ckpt_path=last"), tmp_path / "train" / "second")
    assert Path(resumed.run_dir) == first and not (tmp_path / "train" / "second").exists()
    assert read_record(first) == record
    # The second process wrote into the same W&B run: one id, two offline segments (wandb sync joins them).
    runs = _offline_runs(first)
    assert len(runs) == 2 and {name[-8:] for name in runs} == {record.id}

    # A new run trained into the same folder (no checkpoint to resume) is a W&B run of its own.
    run_training(compose(*overrides), first)
    assert read_record(first).id != record.id

    results = {
        "run": str(first),
        "num_spec_tokens": 2,
        "sets": {
            "math": {
                "prompts": 2,
                "overlap_dropped": 0,
                "results": {
                    "eaglet": {"tau": 1.5, "acceptance_rates": [0.4, 0.1], "tokens_per_forward": 1.4,
                               "speedup": 1.1, "near_ties": 0},
                },
            }
        },
    }  # fmt: skip
    plot = plot_acceptance(results, tmp_path / "acceptance.png")
    assert track_evaluation(compose(*overrides), results, plot) == read_record(first).id
    assert len(_offline_runs(first)) == 4
