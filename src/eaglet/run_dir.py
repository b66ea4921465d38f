"""A training run's folder: what `python train.py` writes there, and what the later stages read back.

outputs/train/<time>/        a run (hydra.run.dir of train.py, under paths.output_dir)
  draft/                     the head in the EAGLE format (config.json + model.safetensors)
  checkpoints/               the selected best-step*.ckpt and last.ckpt
  report.json                the training summary
  eval.json                  the results of `python evaluate.py`
  export-<format>/           the default folder of `python export.py`
  .hydra/config.yaml         the composed config the run was trained with
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from eaglet.errors import ConfigError, DataError
from eaglet.formats.folder import CONFIG_FILE

# Training runs under paths.output_dir (conf/hydra: outputs/train/<time>).
TRAIN_RUNS = "train"


@dataclass(frozen=True)
class RunDir:
    """The folder of one training run and where each of its parts lies."""

    path: Path

    DRAFT_DIR = "draft"
    CHECKPOINTS_DIR = "checkpoints"
    LAST_CHECKPOINT = "last.ckpt"  # Lightning's name for ModelCheckpoint(save_last=True)
    REPORT_FILE = "report.json"
    RESULTS_FILE = "eval.json"
    SETTINGS_FILE = ".hydra/config.yaml"

    @property
    def draft_dir(self) -> Path:
        return self.path / self.DRAFT_DIR

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
        """A training run folder; null or "last" = the newest run that has a report.

        `key` is the setting `value` came from (eval.run, export.run): the messages name it.
        """
        if value in (None, "last"):
            return cls.newest(output_dir, key=key)
        run = cls(Path(value))
        if not run.has_head():
            raise DataError(
                f"{key}={value}: {run.path} holds no finished head (no {cls.DRAFT_DIR}/{CONFIG_FILE}): pass "
                f"{key}=<run folder> of a completed python train.py, or let it finish (python train.py "
                "ckpt_path=last)"
            )
        return run


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
