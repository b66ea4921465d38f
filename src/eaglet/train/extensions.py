"""A training run's callbacks and loggers, built from conf/callbacks and conf/logger (each entry a _target_).

What the config names is all there is: eaglet's checkpoints, throughput and tracking are entries like any a
user adds (`+callbacks.early_stop._target_=...`, `logger=tensorboard`). The one entry training reads back is
`callbacks.best_checkpoint`, the checkpoint it selects, reports and exports (the last one without it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from eaglet.config.plain import plain_config
from eaglet.config.schema import EagletConfig
from eaglet.config.targets import build_entries, check_targets
from eaglet.tracking import forget_record
from eaglet.train.tracking import RunCSVLogger

BEST_CHECKPOINT = "best_checkpoint"


@dataclass
class Extensions:
    callbacks: list[Callback]
    loggers: list[Logger]
    best_checkpoint: ModelCheckpoint | None

    @property
    def progress_bar(self) -> bool:
        """Lightning adds a bar of its own unless told there is none; `callbacks.progress=null` means none."""
        return any(isinstance(callback, ProgressBar) for callback in self.callbacks)


def check_extensions(cfg: EagletConfig) -> None:
    """Every callback and logger entry names a `_target_` that imports (before any work starts)."""
    check_targets(cfg, "callbacks")
    check_targets(cfg, "logger")


def build_extensions(cfg: EagletConfig, run_dir: Path, *, resumed: bool) -> Extensions:
    """The run's callbacks and loggers, writing into `run_dir` (${paths.run_dir}); each logger but the CSV one
    records the composed config (metrics.csv's hparams.yaml keeps the module's; .hydra/config.yaml the rest).

    resumed: the run continues from a checkpoint of `run_dir`, and so does its W&B run; a new run trained into
    a folder that records another's W&B run starts its own."""
    if not resumed and rank_zero_only.rank == 0:
        forget_record(run_dir)
    cfg = copy.deepcopy(cfg)
    cfg.paths.run_dir = str(run_dir)
    callbacks = build_entries(cfg, "callbacks", Callback)
    loggers = build_entries(cfg, "logger", Logger)
    recorded = plain_config(cfg)
    for logger in loggers.values():
        if not isinstance(logger, RunCSVLogger):
            logger.log_hyperparams(recorded)
    best = callbacks.get(BEST_CHECKPOINT)
    return Extensions(
        callbacks=list(callbacks.values()),
        loggers=list(loggers.values()),
        best_checkpoint=best if isinstance(best, ModelCheckpoint) else None,
    )
