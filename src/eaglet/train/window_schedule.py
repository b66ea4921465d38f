"""What window training (trainer.features=window) reads when: rounds over a rolling window of shards.

Extraction writes the planned shards 0..N-1 in order. Shard 0 is the validation set when validation is on (read
at every validation, never trained on, deleted never); the others are training shards t = 0..M-1. A window of
W = trainer.window_shards shards (null: trainer.max_epochs = E) rolls over them: round r trains on the
training shards r-W+1..r (those that exist), so every shard spends W consecutive rounds in the window, and there
are M + W - 1 rounds. A sequence is read in E of its shard's W rounds, spread evenly: the sequence at position p
of its shard has the slot u = (p + o) mod W (o drawn from the seed and the shard), and is read in the rounds
t + (u + floor(k W / E)) mod W, k = 0..E-1. With W = E that is every round of the window; with W > E a round
reads E/W of each shard in its window, so it mixes W shards, and no round before the last shard's is empty
while every shard holds at least W sequences (train.py checks the plan for it).
After round t + W - 1 the shard is done with: it leaves the window, and training deletes it once a checkpoint
covers that round.

This is not offline training's epochs: an offline epoch passes over the whole data in a fresh order, while
here the data arrives in extraction order and each round mixes only the shards of its window. Each sequence is
still read exactly E times, and which round reads it depends only on the plan, the seed and W, never on timing:
a run killed and resumed trains what the uninterrupted one does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eaglet.errors import DataError
from eaglet.train.sampler import _mix64


@dataclass(frozen=True)
class WindowSchedule:
    shards: int  # planned shards of the folder (window.json)
    window: int  # W
    epochs: int  # E: reads of each training sequence
    validation: bool  # shard 0 is the validation set
    seed: int

    def __post_init__(self) -> None:
        if not 1 <= self.epochs <= self.window:
            raise ValueError(f"a window of {self.window} shards cannot read a shard {self.epochs} times")
        if self.train_shards < 1:
            raise DataError(
                f"the extraction plans {self.shards} shard(s) and validation keeps shard 0: nothing is left to "
                "train on; lower extract.shard_tokens (more, smaller shards) or set trainer.val_fraction=0"
            )

    @property
    def first(self) -> int:
        """The folder index of training shard 0."""
        return 1 if self.validation else 0

    @property
    def train_shards(self) -> int:
        return self.shards - self.first

    @property
    def rounds(self) -> int:
        return self.train_shards + self.window - 1

    def round_shards(self, r: int) -> list[int]:
        """The folder indices of the shards round `r` reads, oldest first."""
        if not 0 <= r < self.rounds:
            raise IndexError(f"round {r} is not in [0, {self.rounds})")
        oldest, newest = max(0, r - self.window + 1), min(r, self.train_shards - 1)
        return [self.first + t for t in range(oldest, newest + 1)]

    def read_in_round(self, r: int, shard: int, sequences: int) -> np.ndarray:
        """Which of `shard`'s `sequences` (in shard order) round `r` reads: bool, one per sequence."""
        age = r - (shard - self.first)  # rounds since the shard entered the window
        if shard < self.first or not 0 <= age < self.window:
            return np.zeros(sequences, dtype=bool)
        if self.window == self.epochs:
            return np.ones(sequences, dtype=bool)
        seed = _mix64(np.array([self.seed % 2**64], dtype=np.uint64))
        offset = int(_mix64(np.array([shard], dtype=np.uint64) ^ seed)[0] % np.uint64(self.window))
        slot = (np.arange(sequences) + offset) % self.window
        reads = np.array([k * self.window // self.epochs for k in range(self.epochs)])
        return np.isin((age - slot) % self.window, reads)

    def done_with(self, rounds_done: int) -> list[int]:
        """The training shards (folder indices) no round after the first `rounds_done` reads."""
        last = min(rounds_done - self.window, self.train_shards - 1)  # shard t's last round is t + W - 1
        return [self.first + t for t in range(last + 1)]
