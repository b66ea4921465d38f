"""Run tracking: a CSV log always, and Weights & Biases (offline unless the user is logged in)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

from eaglet.config.schema import WandbConfig


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
    # metrics.csv sits in the run folder beside Hydra's files, which the CSV logger would warn about.
    warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
    loggers: list[Logger] = [CSVLogger(save_dir=run_dir, name="", version="")]
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
