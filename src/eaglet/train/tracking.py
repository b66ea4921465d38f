"""The loggers of conf/logger: metrics.csv in the run folder, and Weights & Biases as the record of the run."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from eaglet.config.trials import trial_name
from eaglet.fsutil import atomic_output
from eaglet.tracking import record_for, wandb_mode


class _ContinuedWriter(ExperimentWriter):
    """Lightning's metrics.csv writer, except that a metrics.csv already there (a resumed run's) is continued.

    Its rows before the first step this process logs stay; the later ones, of steps a resumed run trains again,
    give way to the new rows. Lightning's writer deletes the file instead.
    """

    def _check_log_dir_exists(self) -> None:  # where Lightning's __init__ deletes the file
        self._earlier: list[dict[str, str]] | None = None
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                reader = csv.DictReader(f)
                # A row cut short (a killed run) lacks its last fields: dropped.
                self._earlier = [row for row in reader if None not in row.values()]
                self.metrics_keys = list(reader.fieldnames or [])

    def save(self) -> None:
        if self._earlier is not None and self.metrics:
            first = min(int(m["step"]) for m in self.metrics)
            with atomic_output(self.metrics_file_path) as tmp, open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(row for row in self._earlier if int(row["step"]) < first)
            self._earlier = None
        super().save()


class RunCSVLogger(CSVLogger):
    """metrics.csv in the run folder, saved every step and continued by a resumed run."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(save_dir=run_dir, name="", version="", flush_logs_every_n_steps=1)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(log_dir=self.log_dir)
        return self._experiment


def sweep_group() -> str | None:
    """The sweep folder's name for Hydra multirun jobs: every trial of one sweep shares a W&B group."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return Path(hydra_cfg.sweep.dir).name


def trial_run_name() -> str | None:
    """A multirun job's swept values (`ttt5-vocab8192`); None for a single run."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return trial_name(HydraConfig.get())


def wandb_logger(
    *,
    save_dir: str,
    project: str,
    entity: str | None = None,
    group: str | None = None,
    tags: list[str] | None = None,
    name: str | None = None,
    job_type: str = "train",
    **kwargs: Any,
) -> WandbLogger | None:
    """Lightning's WandbLogger for the run in `save_dir` (conf/logger/wandb.yaml); None when W&B is disabled.

    The W&B run is the one the folder records (eaglet.tracking.record): a run resumed in its folder continues
    its W&B run; a new one starts another and records it. Offline unless wandb has credentials; WANDB_MODE wins.
    """
    mode = wandb_mode()
    if mode == "disabled":
        return None
    record = record_for(
        Path(save_dir),
        project=project,
        entity=entity,
        group=group or sweep_group(),
        name=name or trial_run_name() or Path(save_dir).name,
        write=rank_zero_only.rank == 0,  # the other ranks never start the W&B run
    )
    return WandbLogger(
        save_dir=save_dir,
        project=record.project,
        entity=record.entity,
        group=record.group,
        name=record.name,
        id=record.id,
        resume="allow",
        tags=list(tags or []),
        job_type=job_type,
        mode=mode,
        **kwargs,
    )


def finish_wandb(failed: bool) -> None:
    """Close the W&B run of this job, marking a crash as such (exit code 1)."""
    wandb = sys.modules.get("wandb")  # never imported when tracking is disabled
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)
