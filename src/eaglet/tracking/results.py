"""Results of a later stage written into a folder's W&B run: summary values, images and tables."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eaglet.tracking.mode import wandb_mode
from eaglet.tracking.record import read_record, record_for

log = logging.getLogger(__name__)

Table = tuple[Sequence[str], Sequence[Sequence[Any]]]  # columns, rows


def log_results(
    folder: Path,
    *,
    summary: Mapping[str, Any],
    images: Mapping[str, Path] | None = None,
    tables: Mapping[str, Table] | None = None,
    project: str,
    entity: str | None = None,
    group: str | None = None,
    name: str | None = None,
    job_type: str,
) -> str | None:
    """Write into the W&B run `folder` records (resumed by its id), or into a new one recorded there, and
    finish it. The settings given are used for a new run only; a recorded run keeps its own. Returns the run's
    id; None when W&B is disabled or failed (the results are on disk either way, so a failure is a warning)."""
    mode = wandb_mode()
    if mode == "disabled":
        return None
    new = read_record(folder) is None
    record = record_for(folder, project=project, entity=entity, group=group, name=name)
    import wandb

    try:
        run = wandb.init(
            dir=str(folder),
            id=record.id,
            resume="allow",
            project=record.project,
            entity=record.entity,
            group=record.group,
            name=record.name,
            job_type=job_type if new else None,  # a resumed run keeps its own (train, sweep-summary)
            mode=mode,
        )
    except Exception as exc:  # no server, bad credentials, ...: said once, the stage goes on
        log.warning(
            "W&B: could not open run %s in %s (%s); the results stay in files only", record.id, folder, exc
        )
        return None
    failed = True
    try:
        run.summary.update(dict(summary))
        media: dict[str, Any] = {key: wandb.Image(str(path)) for key, path in (images or {}).items()}
        for key, (columns, rows) in (tables or {}).items():
            media[key] = wandb.Table(columns=list(columns), data=[list(row) for row in rows])
        if media:
            run.log(media)
        failed = False
    finally:
        run.finish(exit_code=1 if failed else 0)
    return record.id
