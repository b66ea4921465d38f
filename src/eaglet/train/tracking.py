"""Run tracking: a CSV log always, and Weights & Biases (offline unless the user is logged in)."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from eaglet.config.schema import WandbConfig
from eaglet.fsutil import atomic_output


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

    def __init__(self, run_dir: Path) -> None:
        super().__init__(save_dir=run_dir, name="", version="", flush_logs_every_n_steps=1)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(log_dir=self.log_dir)
        return self._experiment


def wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def sweep_group() -> str | None:
    """The sweep folder's name for Hydra multirun jobs: every trial of one sweep shares a W&B group."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return Path(hydra_cfg.sweep.dir).name


def make_loggers(
    wandb_cfg: WandbConfig, run_config: dict[str, Any], run_dir: Path, job_type: str
) -> list[Logger]:
    """A CSV logger, and a W&B one (recording `run_config`) unless WANDB_MODE=disabled."""
    loggers: list[Logger] = [RunCSVLogger(run_dir)]
    if "WANDB_MODE" not in os.environ and not wandb_logged_in():
        os.environ["WANDB_MODE"] = "offline"
    if os.environ.get("WANDB_MODE") == "disabled":
        return loggers
    loggers.append(
        WandbLogger(
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            group=wandb_cfg.group or sweep_group(),
            tags=list(wandb_cfg.tags),
            name=run_dir.name,
            job_type=job_type,
            save_dir=str(run_dir),
            config=run_config,
        )
    )
    return loggers


def finish_wandb(failed: bool) -> None:
    """Close the W&B run of this job, marking a crash as such (exit code 1)."""
    wandb = sys.modules.get("wandb")  # never imported when tracking is disabled
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)
