"""Read a sweep folder: one record per trial folder, failed and unfinished trials included."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from eaglet.errors import DataError
from eaglet.sweeps.trial import TRIAL_FILE


@dataclass
class Trial:
    folder: Path
    status: str  # ok, failed, running (died or still going), missing (no sweep_trial.json)
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def number(self) -> int | None:
        """The job number: recorded by the trial, else Hydra's record of the job, else a folder named by it."""
        value = self.data.get("trial")
        if value is None:
            value = _job_number(self.folder)
        return value

    @property
    def error(self) -> str:
        if self.status == "missing":
            return f"no {TRIAL_FILE}: the trial's process ended before writing it (killed?)"
        if self.status == "running":
            return "unfinished: its process died or is still running"
        return self.data.get("error", "")


def _job_number(folder: Path) -> int | None:
    """hydra.job.num of the job that ran in `folder` (its .hydra/hydra.yaml), or a number leading its name."""
    hydra_file = folder / ".hydra" / "hydra.yaml"
    if hydra_file.is_file():
        num = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.job.num", default=None)
        if isinstance(num, int):
            return num
    leading = re.match(r"\d+(?=-|$)", folder.name)
    return int(leading.group()) if leading else None


def _trial_folders(sweep_dir: Path) -> list[Path]:
    """Hydra's job folders (named by their swept values, with a .hydra folder) and any folder holding a trial
    file."""
    folders = {p.parent for p in sweep_dir.glob(f"*/{TRIAL_FILE}")}
    folders |= {p.parent for p in sweep_dir.glob("*/.hydra")}
    return sorted(folders, key=lambda p: p.name)


def load_trials(sweep_dir: Path) -> list[Trial]:
    if not sweep_dir.is_dir():
        raise DataError(f"{sweep_dir} is not a folder; pass a sweep folder (outputs/multirun/<sweep>-<time>)")
    trials = []
    for folder in _trial_folders(sweep_dir):
        path = folder / TRIAL_FILE
        if not path.is_file():
            trials.append(Trial(folder, "missing"))
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path} is not valid JSON ({e}); delete it to list the trial as missing") from e
        trials.append(Trial(folder, str(data.get("status", "missing")), data))
    trials.sort(key=lambda t: (t.number is None, t.number or 0, t.folder.name))  # in the order they ran
    if not trials:
        raise DataError(
            f"{sweep_dir} holds no trial folders; pass the folder a sweep wrote "
            "(python train.py sweeps=... prints it), e.g. outputs/multirun/draft_length_vocab-<time>"
        )
    return trials


def newest_sweep(output_dir: Path) -> Path:
    """The most recent sweep folder under <output_dir>/multirun that holds a trial file."""
    found = sorted(output_dir.glob(f"multirun/*/*/{TRIAL_FILE}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise DataError(
            f"no sweep under {output_dir}/multirun; run one (python train.py sweeps=draft_length_vocab)"
        )
    return found[-1].parent.parent
