"""The shard folder as window training sees it: written by a running extraction, so read as it grows.

Training waits for what it needs (the folder's start, the next shard), each wait bounded by
trainer.window_timeout_s, and stops with what to do when extraction does not deliver.
"""

from __future__ import annotations

import time
from pathlib import Path

from eaglet.errors import DataError
from eaglet.shards import Manifest, read_manifest
from eaglet.shards.window import StreamPlan, read_retired, read_stream_plan, retired_by

POLL_S = 0.2
REMIND_S = 300.0
_EXTRACT = "`python extract.py extract.max_disk_gb=...` with this run's model, dataset and extract settings"


class WindowFolder:
    """A shard folder extraction writes under extract.max_disk_gb."""

    def __init__(self, directory: Path, timeout_s: float) -> None:
        self.directory = directory
        self.timeout_s = timeout_s

    def stream_plan(self) -> StreamPlan:
        """window.json, once extraction wrote it (after the manifest, target head and token counts)."""
        waited = self._waiting("extraction to start (window.json)")
        while True:
            plan = read_stream_plan(self.directory)
            if plan is not None:
                return plan
            manifest = self._manifest()
            if manifest is not None and manifest.complete:
                raise DataError(
                    f"{self.directory} was extracted without a disk bound (no window.json): train on it with "
                    "trainer.features=shards, or extract into a new folder with extract.max_disk_gb=..."
                )
            next(waited)

    def shard(self, index: int) -> Manifest:
        """The manifest, once it records shard `index`."""
        waited = self._waiting(f"shard {index} from extraction")
        while True:
            manifest = self._manifest()
            recorded = 0 if manifest is None else len(manifest.shards)
            if manifest is not None and recorded > index:
                return manifest
            if manifest is not None and manifest.complete:
                raise DataError(
                    f"{self.directory}: extraction finished with {recorded} shards, and window training expects "
                    f"shard {index} (window.json plans more): the folder was extracted with other settings; "
                    "extract it again with extract.overwrite=true"
                )
            next(waited)

    def check_present(self, shards: list[int]) -> None:
        """Stop when a shard this round reads was retired: the checkpoint resumed from is older than the run's
        last one, whose rounds had finished with it."""
        gone = sorted(set(shards) & set(read_retired(self.directory)))
        if gone:
            raise DataError(
                f"{self.directory}: shards {gone} were deleted by window training ({retired_by(self.directory)}) "
                "after a later checkpoint than the one resumed from: resume from that run's last checkpoint "
                "(ckpt_path=last), or extract again into a new folder to train anew"
            )

    def _manifest(self) -> Manifest | None:
        try:
            return read_manifest(self.directory)
        except DataError:  # not written yet
            return None

    def _waiting(self, what: str):
        """A generator whose every `next` sleeps a moment; says what it waits for, and stops after the timeout."""
        start = told = time.monotonic()
        print(f"window: waiting for {what} in {self.directory}", flush=True)
        while True:
            now = time.monotonic()
            if now - start > self.timeout_s:
                raise DataError(
                    f"{self.directory}: waited {self.timeout_s:g} s for {what}: extraction is not running, or "
                    f"stopped. Start or re-run {_EXTRACT} (it resumes), then resume training with ckpt_path=last "
                    "(trainer.window_timeout_s sets the wait)"
                )
            if now - told > REMIND_S:
                print(f"window: still waiting for {what} ({now - start:.0f} s)", flush=True)
                told = now
            time.sleep(POLL_S)
            yield
