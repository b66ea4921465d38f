"""A shard folder written under a disk bound (extract.max_disk_gb) and read while it is written
(trainer.features=window): the two records beside manifest.json, and the folder's bytes.

  window.json    extraction's: the bound, and the plan of the stream made before any forward: the shards in
                 production order (an upper bound of each one's file, its tokens and sequences), and the bytes of
                 the rest of the folder
  retired.json   training's: the shards it finished with and deleted, and the run that did

manifest.json stays extraction's: it records each shard once complete, in production order. Each record has one
writer and is replaced whole (temporary file, fsync, rename): a reader sees the old or the new one, and neither
process ever rewrites what the other wrote. Training records a shard retired before it deletes the file, so a
recorded shard whose file is missing is retired or damaged, never in between.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from eaglet.errors import DataError
from eaglet.fsutil import atomic_write_json, fsync_dir
from eaglet.shards.format import shard_name

STREAM_FILE = "window.json"
RETIRED_FILE = "retired.json"
# A shard file beyond its tensors: the safetensors header (about 600 bytes for six tensors) and per sequence an
# int64 offset and an int64 sample id (one more offset per shard).
SHARD_HEADER_BYTES = 1024
PER_SEQUENCE_BYTES = 16


def estimated_shard_bytes(num_tokens: int, num_sequences: int, bytes_per_token: int) -> int:
    """An upper bound of the file eaglet.shards.format.write_shard writes for these sequences."""
    return num_tokens * bytes_per_token + PER_SEQUENCE_BYTES * num_sequences + 8 + SHARD_HEADER_BYTES


@dataclass(frozen=True)
class StreamPlan:
    """window.json: what extraction under extract.max_disk_gb will write."""

    max_disk_bytes: int
    shard_bytes: list[int]  # per planned shard, an upper bound of its file
    shard_tokens: list[int]  # per planned shard
    shard_sequences: list[int]  # per planned shard
    fixed_bytes: int  # the rest of the folder: target head, token counts, manifests, these records

    @property
    def shards(self) -> int:
        return len(self.shard_bytes)


def write_stream_plan(directory: str | Path, plan: StreamPlan) -> None:
    atomic_write_json(Path(directory) / STREAM_FILE, asdict(plan))


def read_stream_plan(directory: str | Path) -> StreamPlan | None:
    """The folder's stream plan; None when it was not extracted under a disk bound (or not yet)."""
    path = Path(directory) / STREAM_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return StreamPlan(**data)
    except (json.JSONDecodeError, TypeError) as e:
        raise DataError(f"{path}: unreadable ({e}); re-run the extraction command, which writes it") from e


def read_retired(directory: str | Path) -> list[int]:
    """The shards training retired (deleted once trained on), in the order it did; empty when none."""
    path = Path(directory) / RETIRED_FILE
    if not path.is_file():
        return []
    try:
        retired = json.loads(path.read_text())["retired"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path}: unreadable ({e}); it records which shards training deleted") from e
    return [int(index) for index in retired]


def retired_by(directory: str | Path) -> str | None:
    """The training run that retired the folder's shards (its folder), if any did."""
    path = Path(directory) / RETIRED_FILE
    return json.loads(path.read_text()).get("run") if path.is_file() else None


def retire(directory: str | Path, shards: Iterable[int], run: str) -> list[int]:
    """Record `shards` retired, then delete their files (and any retired shard's file still there: a run killed
    between the two); returns the shards newly recorded."""
    directory = Path(directory)
    retired = read_retired(directory)
    new = [index for index in dict.fromkeys(shards) if index not in set(retired)]
    if new:
        atomic_write_json(directory / RETIRED_FILE, {"retired": retired + new, "run": run})
    removed = False
    for index in retired + new:
        path = directory / shard_name(index)
        if path.exists():
            path.unlink()
            removed = True
    if removed:
        fsync_dir(directory)
    return new


def folder_bytes(directory: str | Path) -> int:
    """Bytes of the files under their final names in `directory` (not the temporaries of writes in progress)."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:  # deleted (retired) while scanned
                continue
    return total
