"""A training run's folder: what `python train.py` writes there, and what the later stages read back.

outputs/train/<time>/        a run (hydra.run.dir of train.py, under paths.output_dir)
  draft/                     the head in the EAGLE format (config.json + model.safetensors)
  checkpoints/               the selected best-step*.ckpt and last.ckpt
  metrics.csv                the logged metrics (a resumed run continues it)
  wandb/                     the W&B run's offline files, and eaglet-run.json: which W&B run this folder is
  report.json                the training summary
  eval.json                  the results of `python evaluate.py`
  export-<format>/           the default folder of `python export.py`
  .hydra/config.yaml         the composed config the run was trained with

A head folder by itself (config.json + model.safetensors, say an export or another trainer's EAGLE-3 head) is read
as a run whose draft/ is the folder itself, so evaluate.py and export.py take it too (eval.json is written beside).

A run resumed from one of its checkpoints (ckpt_path=...) continues in this folder; the folder Hydra made for
the resuming command is left empty and removed, as is the folder of a run that failed before it trained.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from eaglet.errors import ConfigError, DataError
from eaglet.formats.folder import CONFIG_FILE, WEIGHTS_FILE

# Training runs under paths.output_dir (conf/hydra: outputs/train/<time>).
TRAIN_RUNS = "train"


@dataclass(frozen=True)
class RunDir:
    """The folder of one training run and where each of its parts lies."""

    path: Path

    DRAFT_DIR = "draft"
    CHECKPOINTS_DIR = "checkpoints"
    LAST_CHECKPOINT = "last.ckpt"  # Lightning's name for ModelCheckpoint(save_last=True)
    METRICS_FILE = "metrics.csv"  # Lightning's CSVLogger, saving into the run folder itself
    REPORT_FILE = "report.json"
    RESULTS_FILE = "eval.json"
    SETTINGS_FILE = ".hydra/config.yaml"

    @property
    def draft_dir(self) -> Path:
        nested = self.path / self.DRAFT_DIR
        return self.path if not nested.exists() and self.is_head_folder() else nested

    def is_head_folder(self) -> bool:
        """Whether the folder is a head itself rather than a training run."""
        return (self.path / CONFIG_FILE).is_file() and (self.path / WEIGHTS_FILE).is_file()

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / self.CHECKPOINTS_DIR

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints_dir / self.LAST_CHECKPOINT

    @property
    def report_file(self) -> Path:
        return self.path / self.REPORT_FILE

    @property
    def results_file(self) -> Path:
        return self.path / self.RESULTS_FILE

    @property
    def settings_file(self) -> Path:
        return self.path / self.SETTINGS_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / self.METRICS_FILE

    def export_dir(self, fmt: str) -> Path:
        return self.path / f"export-{fmt}"

    def has_head(self) -> bool:
        """Whether training finished and wrote its head."""
        return (self.draft_dir / CONFIG_FILE).is_file()

    def settings(self) -> DictConfig | None:
        """The composed config the run was trained with, as Hydra saved it; None when it has none."""
        if not self.settings_file.is_file():
            return None
        return OmegaConf.load(self.settings_file)

    def has_progress(self) -> bool:
        """Whether a run got anywhere here: a checkpoint, a head, or a logged metric."""
        if self.has_head() or self.report_file.is_file():
            return True
        if self.checkpoints_dir.is_dir() and any(self.checkpoints_dir.iterdir()):
            return True
        if not self.metrics_file.is_file():
            return False
        with open(self.metrics_file) as f:
            return len(f.readlines(1 << 16)) > 1  # a header and at least one row

    def discard_if_unused(self) -> None:
        """Remove the folder when no run got anywhere in it: only what every start writes is there.

        Only those start files are removed (Hydra's config and log, Lightning's hparams and empty logs, the
        W&B record); anything else keeps the folder.
        """
        if not self.path.is_dir() or self.has_progress():
            return
        for entry in self.path.iterdir():
            if entry.name in _START_FILES or entry.name.startswith(_START_PREFIXES) or entry.suffix == ".log":
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        try:
            self.path.rmdir()
        except OSError:  # something else is there (or another rank removed it first)
            pass

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> RunDir | None:
        """The run whose checkpoints folder holds `checkpoint`; None for a checkpoint kept elsewhere."""
        checkpoint = Path(checkpoint).resolve()
        if checkpoint.parent.name != cls.CHECKPOINTS_DIR:
            return None
        return cls(checkpoint.parent.parent)

    @classmethod
    def newest(cls, output_dir: Path, *, key: str) -> RunDir:
        """The newest training run under `output_dir` that has a report; `key` is the stage's run setting."""
        run = _newest(output_dir, cls.REPORT_FILE)
        if run is None:
            raise ConfigError(
                f"no finished training run under {output_dir}/{TRAIN_RUNS}; train one (python train.py) or pass "
                f"{key}=<run folder>"
            )
        return run

    @classmethod
    def resolve(cls, value: str | None, output_dir: Path, *, key: str) -> RunDir:
        """A training run folder (or a head folder by itself); null or "last" = the newest run that has a report.

        `key` is the setting `value` came from (eval.run, export.run): the messages name it.
        """
        if value in (None, "last"):
            return cls.newest(output_dir, key=key)
        run = cls(Path(value))
        if not run.has_head():
            raise DataError(
                f"{key}={value}: {run.path} holds no finished head (no {cls.DRAFT_DIR}/{CONFIG_FILE}, nor "
                f"{CONFIG_FILE} + {WEIGHTS_FILE} of a head folder): pass {key}=<run folder> of a completed "
                "python train.py or a head folder, or let the run finish (python train.py ckpt_path=last)"
            )
        return run


# What a start writes before any training: Hydra's config (.hydra; .pl_hydra_<rank> of DDP children) and log
# (<job>.log), Lightning's hparams.yaml and metrics.csv header, a W&B record, an empty checkpoints folder.
_START_FILES = {".hydra", "hparams.yaml", RunDir.METRICS_FILE, "wandb", RunDir.CHECKPOINTS_DIR}
_START_PREFIXES = (".pl_hydra",)


def _newest(output_dir: Path, inside: str) -> RunDir | None:
    """The training run under `output_dir` whose file `inside` (a path relative to the run) is the newest."""
    found = sorted(output_dir.glob(f"{TRAIN_RUNS}/*/{inside}"), key=lambda p: p.stat().st_mtime)
    return RunDir(found[-1].parents[len(Path(inside).parts) - 1]) if found else None


def resolve_ckpt_path(value: str | None, output_dir: Path) -> str | None:
    """`last` = the newest last.ckpt of any earlier training run; otherwise a path (checked)."""
    if value is None:
        return None
    if value == "last":
        run = _newest(output_dir, f"{RunDir.CHECKPOINTS_DIR}/{RunDir.LAST_CHECKPOINT}")
        if run is None:
            raise ConfigError(
                f"ckpt_path=last: no earlier run under {output_dir}/{TRAIN_RUNS} has a {RunDir.LAST_CHECKPOINT}"
            )
        return str(run.last_checkpoint)
    if not Path(value).is_file():
        raise ConfigError(f"ckpt_path={value}: no such checkpoint file")
    return value
