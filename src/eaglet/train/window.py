"""Window training's data (trainer.features=window): the rounds of eaglet.train.window_schedule as one stream of
packed micro-batches, read from a folder extraction is still writing, each shard deleted once done with.

Lightning sees one epoch of unknown length: the stream runs round after round, waiting for the next shard when
training catches up with extraction. Its position (the round, and the micro-batches of it trained) is saved in
every checkpoint, so a run killed anywhere resumes at the same micro-batch; which rounds a checkpoint covers
decides which shards may go (WindowCheckpoint): a shard is deleted only after a checkpoint taken past its last
round is on disk, so no crash loses data that training still needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from eaglet.errors import DataError
from eaglet.shards import ShardReader
from eaglet.shards.window import retire
from eaglet.train.datamodule import PackedShardDataset
from eaglet.train.prefetch import DeviceCopier, PrefetchLoader
from eaglet.train.sampler import PackedBatchSampler
from eaglet.train.window_folder import WindowFolder
from eaglet.train.window_schedule import WindowSchedule


@dataclass(frozen=True)
class RoundSpan:
    """A round the stream started: its micro-batches are the stream's [first, first + batches)."""

    round: int
    first: int
    batches: int


class WindowDataModule(LightningDataModule):
    """The train stream and the validation shard of a folder extraction writes under extract.max_disk_gb.

    Build the Trainer with use_distributed_sampler=False (each rank reads its own bins, as ShardDataModule's) and
    check_val_every_n_epoch=None: the one epoch ends only when the last round does.
    """

    def __init__(
        self,
        folder: WindowFolder,
        schedule: WindowSchedule,
        tokens_per_batch: int,
        seed: int,
        *,
        loader_threads: int = 2,
        check_finite: bool = False,
    ) -> None:
        super().__init__()
        self.folder, self.schedule = folder, schedule
        self.tokens_per_batch, self.seed = tokens_per_batch, seed
        self.loader_threads, self.check_finite = loader_threads, check_finite
        self._val: PackedShardDataset | None = None
        # Where the next iteration of the stream starts: the round, its micro-batches already trained, and the
        # stream's micro-batches before them.
        self._start = {"round": 0, "batches_done": 0, "round_batches": -1, "stream_batches": 0}
        self._spans: list[RoundSpan] = []
        self._yielded = 0
        self.batch_device: torch.device | None = None  # as ShardDataModule's, when no Trainer is attached

    @property
    def directory(self) -> Path:
        return self.folder.directory

    def setup(self, stage: str | None = None) -> None:
        """Wait for the validation shard (when validation is on) and open it; it stays until the run ends."""
        if self._val is not None or not self.schedule.validation:
            return
        manifest = self.folder.shard(0)
        reader = ShardReader(self.directory, shards=[0], manifest=manifest)
        self._val = PackedShardDataset(
            reader,
            self.tokens_per_batch,
            check_finite=self.check_finite,
            pin_memory=torch.cuda.is_available(),
        )
        rank_zero_info(
            f"{self.directory}: validation on shard 0 ({len(reader)} sequences); {self.schedule.train_shards} "
            f"training shards in {self.schedule.rounds} rounds over a window of {self.schedule.window}, each "
            f"sequence read {self.schedule.epochs} time(s)"
        )

    # ---- the train stream ----------------------------------------------------------------------------------

    def train_dataloader(self) -> WindowStream:
        return WindowStream(self)

    def round_batches(self, r: int) -> tuple[PackedShardDataset, PackedBatchSampler] | None:
        """Round `r`'s dataset and this rank's sampler over its sequences (None: it reads none), once
        extraction wrote its newest shard."""
        shards = self.schedule.round_shards(r)
        manifest = self.folder.shard(shards[-1])
        self.folder.check_present(shards)
        reader = ShardReader(self.directory, shards=shards, manifest=manifest)
        starts = np.cumsum([0] + [info.num_sequences for info in reader.shards])
        positions = np.concatenate(
            [
                start + np.flatnonzero(self.schedule.read_in_round(r, shard, info.num_sequences))
                for shard, start, info in zip(shards, starts, reader.shards, strict=False)
            ]
        )
        if len(positions) == 0:
            return None
        rank, world_size = self._placement()
        sampler = PackedBatchSampler(
            reader.lengths,
            positions,
            self.tokens_per_batch,
            seed=self.seed,
            shuffle=True,
            rank=rank,
            world_size=world_size,
        )
        sampler.set_epoch(r)  # the round's own packing and order
        dataset = PackedShardDataset(
            reader,
            self.tokens_per_batch,
            check_finite=self.check_finite,
            pin_memory=torch.cuda.is_available(),
        )
        rank_zero_info(
            f"window: round {r + 1} of {self.schedule.rounds}: shards {shards[0]}..{shards[-1]}, "
            f"{len(positions)} sequences, {len(sampler)} micro-batches per rank"
        )
        return dataset, sampler

    def _placement(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return self.trainer.global_rank, self.trainer.world_size

    def _copier(self) -> DeviceCopier | None:
        strategy = getattr(self.trainer, "strategy", None)
        device = strategy.root_device if strategy is not None else self.batch_device
        return DeviceCopier(device) if device is not None and torch.device(device).type == "cuda" else None

    def _loader(self, dataset: PackedShardDataset, sampler: PackedBatchSampler) -> Any:
        if self.loader_threads > 0:
            return PrefetchLoader(dataset, sampler, self.loader_threads, self._copier())
        return DataLoader(dataset, sampler=sampler, batch_size=None, pin_memory=torch.cuda.is_available())

    # ---- position, resume and retirement ------------------------------------------------------------------

    def _trained(self) -> int:
        """Micro-batches of the stream trained so far (while fitting, the fit loop's count: the stream and its
        threads draw ahead of it)."""
        if self.trainer is not None and self.trainer.state.fn == TrainerFn.FITTING:
            return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return self._yielded

    def position(self, trained: int | None = None) -> dict[str, int]:
        """The stream's position after `trained` micro-batches (default: those trained so far)."""
        trained = self._trained() if trained is None else trained
        for span in reversed(self._spans):
            if span.first <= trained:
                return {
                    "round": span.round,
                    "batches_done": trained - span.first,
                    "round_batches": span.batches,
                    "stream_batches": trained,
                }
        return dict(self._start)

    def rounds_done(self, trained: int | None = None) -> int:
        """Rounds whose every micro-batch the first `trained` ones include."""
        at = self.position(trained)
        return at["round"] + (at["batches_done"] == at["round_batches"])

    def retire_done(self, rounds_done: int, run: str) -> list[int]:
        """Delete the shards no round after the first `rounds_done` reads (call once a checkpoint covering them is
        on disk, on one process); returns those newly retired."""
        retired = retire(self.directory, self.schedule.done_with(rounds_done), run)
        if retired:
            rank_zero_info(f"window: deleted shards {retired} of {self.directory}: trained on, checkpointed")
        return retired

    def state_dict(self) -> dict[str, int]:
        return self.position()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = {"round", "batches_done", "round_batches", "stream_batches"} - set(state_dict)
        if missing:
            raise DataError(
                f"the checkpoint's window position {state_dict!r} lacks {sorted(missing)}: it was not saved by "
                "window training"
            )
        self._start = {
            key: int(state_dict[key]) for key in ("round", "batches_done", "round_batches", "stream_batches")
        }
        self._spans = []

    # ---- validation ----------------------------------------------------------------------------------------

    def val_dataloader(self) -> Any:
        if self._val is None:
            return []
        rank, world_size = self._placement()
        reader = self._val.reader
        sampler = PackedBatchSampler(
            reader.lengths,
            np.arange(len(reader)),
            self.tokens_per_batch,
            seed=self.seed,
            shuffle=False,
            rank=rank,
            world_size=world_size,
        )
        return self._loader(self._val, sampler)


class WindowStream:
    """The train loader: round after round from the data module's start, each round's micro-batches built ahead
    on loader threads; the round's shard maps are released when it ends, so deleted shards free their disk."""

    def __init__(self, data: WindowDataModule) -> None:
        self.data = data
        self.batch_sampler = None  # as on a DataLoader with batch_size=None: Lightning looks for it
        self.sampler = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        data, start = self.data, self.data._start
        done, first_round, trained = start["batches_done"], start["round"], start["stream_batches"]
        if done == start["round_batches"]:  # the checkpoint was taken after that round's last micro-batch
            first_round, done = first_round + 1, 0
        data._yielded = trained
        for r in range(first_round, data.schedule.rounds):
            built = data.round_batches(r)
            if built is None:
                continue
            dataset, sampler = built
            skip = done if r == first_round else 0
            if skip:
                sampler.load_state_dict({"epoch": r, "batches_done": skip})
            data._spans.append(RoundSpan(r, data._yielded - skip, len(sampler)))
            for batch in data._loader(dataset, sampler):
                data._yielded += 1
                yield batch
            dataset.reader.release()
