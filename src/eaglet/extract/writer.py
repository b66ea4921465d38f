"""Shard writing off the critical path: threads serialise, hash and fsync while the target computes.

Shards are committed to the manifest in the order they were submitted, each only once it is durable, so a
killed run still resumes after the last recorded shard (a written but unrecorded shard is simply written
again). A shard written again in place of a damaged one replaces its own entry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from eaglet.shards import Manifest, SequenceFeatures, ShardInfo, write_manifest, write_shard


class ShardWriterPool:
    """`submit` returns at once while fewer than `workers` shards are in flight, else waits for the oldest."""

    def __init__(self, out_dir: Path, manifest: Manifest, dtype: torch.dtype, workers: int = 2) -> None:
        self.out_dir, self.manifest, self.dtype, self.workers = out_dir, manifest, dtype, workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard-writer")
        self._pending: deque[tuple[int, Future[ShardInfo]]] = deque()

    def submit(self, index: int, sequences: Sequence[SequenceFeatures]) -> None:
        """Write shard `index`: a recorded one again, or the one after the last recorded."""
        while len(self._pending) >= self.workers:
            self._commit_oldest()
        future = self._pool.submit(write_shard, self.out_dir, index, sequences, self.dtype)
        self._pending.append((index, future))

    def _commit_oldest(self) -> None:
        index, future = self._pending.popleft()
        info = future.result()  # re-raises a writer's error here, in the caller
        shards = self.manifest.shards
        if index < len(shards):
            shards[index] = info
        else:
            shards.append(info)
        write_manifest(self.out_dir, self.manifest)

    def close(self) -> None:
        """Wait for every shard and record it."""
        try:
            while self._pending:
                self._commit_oldest()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> ShardWriterPool:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # leave what is durable; record nothing further
            self._pool.shutdown(wait=True, cancel_futures=True)
