"""Shard writing off the critical path: threads serialise, hash and fsync while the target computes.

Shards are committed to the manifest in the order they were submitted, each only once it is durable, so a
killed run still resumes after the last recorded shard (a written but unrecorded shard is simply written
again). A shard written again in place of a damaged one replaces its own entry. Under extract.max_disk_gb a
shard starts only once the folder has room for it (eaglet.extract.budget), the shards already in flight counted
at their planned size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.extract.budget import DiskBudget
from eaglet.shards import (
    Manifest,
    SequenceFeatures,
    ShardInfo,
    bytes_per_token,
    shard_name,
    write_manifest,
    write_shard,
)
from eaglet.shards.window import estimated_shard_bytes, folder_bytes

# Features waiting for a writer, at most. The forward waits only when the disk falls this far behind; host
# memory peaks near twice this (a writer packs a shard into one buffer before it writes), plus the shard
# being gathered. 8 GiB holds about 4 Llama-3.1-8B shards of 65,536 tokens (32.8 KB a token): a writer takes
# about twice a forward's time for its shard (packing, serialising, hashing, 2026-12-03 on an H200), so with
# 2 in flight the forward waited for the writers.
MAX_BYTES_IN_FLIGHT = 8 << 30
# Writers at once: hashing (about 1.5 GB/s a core) and page-cache writes of one shard take a core each, so a
# few threads keep up with a GPU's 1 GB/s of features; file I/O, hashing and torch's copies release the GIL.
WRITERS = 4


@dataclass
class _Pending:
    index: int
    size: int  # bytes of features held in memory
    disk: int  # an upper bound of its file
    future: Future[ShardInfo]


class ShardWriterPool:
    """`submit` returns at once while the shards in flight hold at most `max_bytes` of features (and, with a
    `budget`, while the folder has room for the new shard), else waits; finished shards are recorded, in
    submission order, at every submit."""

    def __init__(
        self,
        out_dir: Path,
        manifest: Manifest,
        dtype: torch.dtype,
        workers: int = WRITERS,
        max_bytes: int = MAX_BYTES_IN_FLIGHT,
        budget: DiskBudget | None = None,
    ) -> None:
        self.out_dir, self.manifest, self.dtype, self.max_bytes = out_dir, manifest, dtype, max_bytes
        self.budget = budget
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard-writer")
        self._pending: deque[_Pending] = deque()
        self._bytes = 0

    def submit(self, index: int, sequences: Sequence[SequenceFeatures]) -> None:
        """Write shard `index`: a recorded one again, or the one after the last recorded.

        A writer's error (a full disk, say) is raised here, by the first submit or close after it.
        """
        while self._pending and self._pending[0].future.done():
            self._commit_oldest()
        size = sum(_nbytes(seq) for seq in sequences)
        disk = self._file_bytes(sequences)
        # One shard larger than the limit still goes, alone.
        while self._pending and self._bytes + size > self.max_bytes:
            self._commit_oldest()
        if self.budget is not None:
            self._make_room(index, disk)
        future = self._pool.submit(write_shard, self.out_dir, index, sequences, self.dtype)
        self._pending.append(_Pending(index, size, disk, future))
        self._bytes += size

    def _make_room(self, index: int, size: int) -> None:
        """Return once the folder's files, the shards being written and this one fit the budget; finished
        writes are recorded meanwhile, so that training can go on and free room.

        A file already under shard `index`'s name is one a killed run wrote but did not record, or a damaged
        one: training reads neither, and both are written again now, so it goes first (the two never share
        the bound)."""
        assert self.budget is not None
        (self.out_dir / shard_name(index)).unlink(missing_ok=True)
        wait = self.budget.waiter(index, size)
        while True:
            while self._pending and self._pending[0].future.done():
                self._commit_oldest()
            writing = sum(p.disk for p in self._pending)
            used = folder_bytes(self.out_dir) + writing
            if used + size <= self.budget.max_bytes:
                return
            if self._pending:  # a write in flight frees nothing, but its record may let training go on
                self._commit_oldest()
            else:
                wait.sleep(used)

    def _file_bytes(self, sequences: Sequence[SequenceFeatures]) -> int:
        aux = sequences[0].aux_hidden_states
        per_token = bytes_per_token(aux.shape[1], aux.shape[2], self.dtype.itemsize)
        tokens = sum(seq.input_ids.numel() for seq in sequences)
        return estimated_shard_bytes(tokens, len(sequences), per_token)

    def _commit_oldest(self) -> None:
        oldest = self._pending[0]
        info = oldest.future.result()  # re-raises a writer's error here, in the caller
        self._pending.popleft()
        self._bytes -= oldest.size
        index = oldest.index
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
