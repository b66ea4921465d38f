"""extract.max_disk_gb at work: before a shard is written, the folder's files, the shards still being written and
the new one must fit the bound; until they do, extraction waits for training to retire shards it is done with.

The bound covers the whole folder (shards, target head, token counts, manifests), measured on disk before every
shard rather than counted: shards training deleted are gone from the count, whoever deleted them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.errors import DataError
from eaglet.fsutil import human_bytes

# How often a waiting extraction looks at the folder again, and says it is still waiting.
POLL_S = 0.2
REMIND_S = 300.0


@dataclass
class DiskBudget:
    """The bound (bytes) of a folder and how long extraction may wait for room without any being freed."""

    directory: Path
    max_bytes: int
    timeout_s: float
    told: float | None = None  # when a wait was last said: once, then every REMIND_S across waits

    def waiter(self, index: int, size: int) -> RoomWait:
        return RoomWait(self, index, size)


@dataclass
class RoomWait:
    """One wait for room for shard `index` (`size` bytes): says so once, again every REMIND_S, and stops after
    the budget's timeout_s without a byte freed."""

    budget: DiskBudget
    index: int
    size: int
    _since: float = field(default_factory=time.monotonic)
    _least: int | None = None

    def sleep(self, used: int) -> None:
        """Wait a moment; `used` is what the folder holds now (files and writes in progress)."""
        now = time.monotonic()
        if self._least is None or used < self._least:  # training freed room: progress, the clock restarts
            self._least, self._since = used, now
        b = self.budget
        what = (
            f"{human_bytes(used)} in {b.directory} + {human_bytes(self.size)} for shard {self.index} > "
            f"extract.max_disk_gb={b.max_bytes / 1e9:g}"
        )
        if now - self._since > b.timeout_s:
            raise DataError(
                f"waited {b.timeout_s:g} s for training to delete shards it finished with ({what}): start or resume "
                "`python train.py trainer.features=window ...` on this folder (ckpt_path=last resumes it), then "
                f"re-run this command: it resumes at shard {self.index} (extract.window_timeout_s sets the wait)"
            )
        if b.told is None or now - b.told > REMIND_S:
            again = "" if b.told is None else " (still)"
            print(
                f"window: waiting{again} for training to delete shards it finished with: {what}", flush=True
            )
            b.told = now
        time.sleep(POLL_S)
