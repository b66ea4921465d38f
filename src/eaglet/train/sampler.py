"""Which sequences each step sees: the train/validation split and the per-rank, resumable order of micro-batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from eaglet.errors import ConfigError, DataError
from eaglet.train.packing import pack_sequences


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fixed, well-mixed hash of uint64 values (numpy wraps on overflow)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniform(sample_ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed draw in [0, 1) per sample id: the top 53 bits of a hash of (id, salt)."""
    ids = np.asarray(sample_ids, dtype=np.int64).astype(np.uint64)
    hashes = _mix64(_mix64(ids) ^ np.uint64(salt % 2**64))
    return (hashes >> np.uint64(11)).astype(np.float64) / float(2**53)


def split_by_sample_id(
    sample_ids: np.ndarray, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split positions 0..N-1 into (train, val), each sorted, by a hash of (sample id, seed).

    A sequence's side depends on its own id only, so appending data never moves existing sequences
    between the splits. With val_fraction > 0 at least one sequence is held out (the one of smallest hash).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    uniform = _uniform(sample_ids, seed)
    is_val = uniform < val_fraction
    n = len(uniform)
    if val_fraction > 0 and n >= 2 and not is_val.any():
        is_val[np.argmin(uniform)] = True
    train, val = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    if len(train) == 0:
        raise DataError(
            f"the training split is empty: all {n} sequences went to validation "
            f"(trainer.val_fraction={val_fraction}); extract more conversations or lower trainer.val_fraction"
        )
    if val_fraction > 0 and len(val) == 0:
        raise DataError(
            f"the validation split is empty: {n} sequence(s) cannot give a held-out set with "
            f"trainer.val_fraction={val_fraction}; extract more conversations or set trainer.val_fraction=0 "
            "to train without validation"
        )
    return train.astype(np.int64), val.astype(np.int64)


def subset_by_sample_id(
    sample_ids: np.ndarray, positions: np.ndarray, fraction: float, seed: int
) -> np.ndarray:
    """The positions whose sequence falls in a fixed random `fraction` of them, by a hash of (sample id, seed)
    independent of the validation split's: the same sequences whatever else the data holds, so a smaller share
    is a subset of a larger one. At least one position is kept."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"train_fraction must be in (0, 1], got {fraction}")
    if fraction == 1.0 or len(positions) == 0:
        return positions
    # Salted: another draw than the split's.
    uniform = _uniform(np.asarray(sample_ids)[positions], seed ^ 0x5EED_F4AC_7105)
    keep = uniform < fraction
    if not keep.any():
        keep[np.argmin(uniform)] = True
    return positions[keep]


def balance_bins(bins: list[list[int]], world_size: int) -> list[list[int]]:
    """Make the number of bins a multiple of `world_size`, so that every rank runs the same number of steps.

    Bins are split first (one sequence moves out of the bin holding the most), which keeps each sequence
    exactly once per epoch; only when every bin holds a single sequence (fewer sequences than the target
    count) are bins repeated, from the first, to fill the last round.
    """
    target = -(-len(bins) // world_size) * world_size
    bins = [list(b) for b in bins]
    repeated = 0
    while len(bins) < target:
        fullest = max(range(len(bins)), key=lambda b: len(bins[b]))
        if len(bins[fullest]) > 1:
            bins.append([bins[fullest].pop()])
        else:
            bins.append(list(bins[repeated]))
            repeated += 1
    return bins


class PackedBatchSampler(Sampler[list[int]]):
    """Yields one list of sequence indices per micro-batch: this rank's share of an epoch's packed bins.

    Every rank packs the same bins from (seed, epoch), balanced to a multiple of `world_size` (see
    `balance_bins`), and takes every `world_size`-th bin from position `rank`: ranks are disjoint and run
    the same number of batches. `state_dict()` records how many batches of the current epoch were yielded;
    after `load_state_dict()` the next iteration yields exactly the rest, in the same order.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        indices: np.ndarray,
        tokens_per_batch: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if len(indices) == 0:
            raise ValueError("PackedBatchSampler needs at least one sequence")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.tokens_per_batch = tokens_per_batch
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self.epoch = 0
        self._start = 0  # batches to skip on the next iteration (set by load_state_dict)
        self._done = 0  # batches of self.epoch yielded so far
        self._cached: tuple[int, list[list[int]]] | None = None
        self._num_batches = len(self.epoch_bins()) // world_size

    def epoch_bins(self) -> list[list[int]]:
        """All ranks' bins of the current epoch, in order; rank r runs bins r, r + world_size, ..."""
        if self._cached is None or self._cached[0] != self.epoch:
            bins = pack_sequences(
                self.lengths, self.indices, self.tokens_per_batch, self.seed, self.epoch, shuffle=self.shuffle
            )
            self._cached = (self.epoch, balance_bins(bins, self.world_size))
        return self._cached[1]

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._start, self._done = epoch, 0, 0

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank, also while resuming in the middle of one."""
        return self._num_batches

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.epoch_bins()[self.rank :: self.world_size]
        start, self._start = self._start, 0
        self._done = start
        for batch in mine[start:]:
            self._done += 1
            yield list(batch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_done": self._done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"epoch", "batches_done"} - set(state)
        if missing:
            raise DataError(
                f"sampler state {state!r} lacks {sorted(missing)}; the checkpoint is not from eaglet"
            )
        done = int(state["batches_done"])
        if not 0 <= done <= self._num_batches:
            raise ConfigError(
                f"the checkpoint says {done} batches of epoch {state['epoch']} were done, but an epoch has "
                f"{self._num_batches} batches per rank here: the shards, tokens_per_batch or the number of "
                "devices changed since it was saved; resume with the same settings"
            )
        epoch = int(state["epoch"])
        if done == self._num_batches:
            # A finished epoch resumes at the start of the next one. Lightning creates the resumed loader's
            # iterator (and workers draw from this sampler) before it calls set_epoch.
            epoch, done = epoch + 1, 0
        self.epoch, self._start, self._done = epoch, done, done
