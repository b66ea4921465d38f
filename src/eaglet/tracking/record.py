"""Which W&B run a folder is: its id, project, entity, group and name, kept in <folder>/wandb/eaglet-run.json.

A training run writes it when its W&B run starts; a run resumed from its checkpoint (ckpt_path=last) reads it
and continues that W&B run rather than starting another, and evaluate.py writes its results into the same run.
A sweep folder keeps the record of its summary's run the same way.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from eaglet.fsutil import atomic_write_json

RECORD_FILE = Path("wandb") / "eaglet-run.json"


@dataclass(frozen=True)
class WandbRecord:
    id: str
    project: str
    entity: str | None = None
    group: str | None = None
    name: str | None = None


def read_record(folder: Path) -> WandbRecord | None:
    path = Path(folder) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        return WandbRecord(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError):  # cut short or edited: a new W&B run rather than a crash
        return None


def record_for(
    folder: Path,
    *,
    project: str,
    entity: str | None = None,
    group: str | None = None,
    name: str | None = None,
    write: bool = True,
) -> WandbRecord:
    """The folder's W&B run: the recorded one (its id, project and entity kept; an unset group or name filled
    in), else a new one, written down when `write` (rank 0 only)."""
    earlier = read_record(folder)
    if earlier is not None:
        record = replace(earlier, group=earlier.group or group, name=earlier.name or name)
    else:
        record = WandbRecord(id=new_run_id(), project=project, entity=entity, group=group, name=name)
    if write and record != earlier:
        path = Path(folder) / RECORD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, asdict(record))
    return record


def new_run_id() -> str:
    """A fresh W&B run id: eight lowercase letters and digits, as wandb makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def forget_record(folder: Path) -> None:
    """A new run trained into a folder that holds another's record (a pinned hydra.run.dir) gets its own."""
    (Path(folder) / RECORD_FILE).unlink(missing_ok=True)
