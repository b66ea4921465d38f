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

# Features waiting for a writer, at most. The forward waits only when the disk falls this far behind; host
# memory peaks near twice this (a writer packs a shard into one buffer before it writes), plus the shard
# being gathered. 8 GiB holds about 4 Llama-3.1-8B shards of 65,536 tokens (32.8 KB a token): a writer takes
# about twice a forward's time for its shard (packing, serialising, hashing, 2026-12-03 on an H200), so with
# 2 in flight the forward waited for the writers.
MAX_BYTES_IN_FLIGHT = 8 << 30
# Writers at once: hashing (about 1.5 GB/s a core) and page-cache writes of one shard take a core each, so a
# few threads keep up with a GPU's 1 GB/s of features; file I/O, hashing and torch's copies release the GIL.
WRITERS = 4


class ShardWriterPool:
    """`submit` returns at once while the shards in flight hold at most `max_bytes` of features, else waits
    for the oldest; finished shards are recorded, in submission order, at every submit."""

    def __init__(
        self,
        out_dir: Path,
        manifest: Manifest,
        dtype: torch.dtype,
        workers: int = WRITERS,
        max_bytes: int = MAX_BYTES_IN_FLIGHT,
    ) -> None:
        self.out_dir, self.manifest, self.dtype, self.max_bytes = out_dir, manifest, dtype, max_bytes
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard-writer")
        self._pending: deque[tuple[int, int, Future[ShardInfo]]] = deque()
        self._bytes = 0

    def submit(self, index: int, sequences: Sequence[SequenceFeatures]) -> None:
        """Write shard `index`: a recorded one again, or the one after the last recorded.

        A writer's error (a full disk, say) is raised here, by the first submit or close after it.
        """
        while self._pending and self._pending[0][2].done():
            self._commit_oldest()
        size = sum(_nbytes(seq) for seq in sequences)
        # One shard larger than the limit still goes, alone.
        while self._pending and self._bytes + size > self.max_bytes:
            self._commit_oldest()
        future = self._pool.submit(write_shard, self.out_dir, index, sequences, self.dtype)
        self._pending.append((index, size, future))
        self._bytes += size

    def _commit_oldest(self) -> None:
        index, size, future = self._pending[0]
        info = future.result()  # re-raises a writer's error here, in the caller
        self._pending.popleft()
        self._bytes -= size
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


def _nbytes(seq: SequenceFeatures) -> int:
    tensors = (seq.input_ids, seq.loss_mask, seq.aux_hidden_states, seq.last_hidden_state)
    return sum(t.numel() * t.element_size() for t in tensors)
