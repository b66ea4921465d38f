"""The training data path as a LightningDataModule: shards -> split -> packed micro-batches -> DataLoaders."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, get_worker_info

from eaglet.errors import ConfigError, DataError
from eaglet.shards import STORED_DTYPES, Manifest, ShardReader
from eaglet.train.packing import collate_packed, count_truncated, pack_sequences, packing_efficiency
from eaglet.train.prefetch import DeviceCopier, PrefetchLoader
from eaglet.train.sampler import PackedBatchSampler, split_by_sample_id, subset_by_sample_id

# A float is inf or NaN when all its exponent bits are set: its bits without the sign are >= the exponent mask.
# Read as signed integers, such positive values are >= the mask; read as unsigned, such negative ones are
# >= sign | mask. Two integer maxima in numpy: one pass each, on one core, no temporary, no GIL.
_NON_FINITE = {  # dtype: (integer dtype of its width, exponent mask, sign bit)
    torch.bfloat16: (torch.int16, 0x7F80, 0x8000),
    torch.float16: (torch.int16, 0x7C00, 0x8000),
    torch.float32: (torch.int32, 0x7F800000, 0x80000000),
}


def all_finite(x: torch.Tensor) -> bool:
    """Whether a float tensor holds no inf or NaN; fast for contiguous CPU tensors of the stored dtypes."""
    if x.dtype not in _NON_FINITE or not x.is_contiguous() or x.device.type != "cpu":
        return bool(torch.isfinite(x).all())
    if x.numel() == 0:
        return True
    integer, mask, sign = _NON_FINITE[x.dtype]
    bits = x.view(integer).numpy().reshape(-1)
    unsigned = bits.view(f"uint{8 * bits.itemsize}")
    return int(bits.max()) < mask and int(unsigned.max()) < sign | mask


def _resolve_dtype(feature_dtype: torch.dtype | str | None) -> torch.dtype | None:
    if feature_dtype is None or isinstance(feature_dtype, torch.dtype):
        return feature_dtype
    if feature_dtype not in STORED_DTYPES:
        raise ConfigError(f"feature_dtype {feature_dtype!r} is not one of {sorted(STORED_DTYPES)} (or null)")
    return STORED_DTYPES[feature_dtype]


class PackedShardDataset(Dataset):
    """Map-style dataset whose item for a list of sequence indices is one packed micro-batch.

    The batch is one allocation (see packed_buffers): in shared memory inside a DataLoader worker, so that it
    reaches the main process without a copy, else pinned when `pin_memory`, so that it goes to the GPU as is.
    With `check_finite`, a batch is checked for inf and NaN while it holds a sequence this process has not
    found finite yet: shards do not change, so later epochs skip the check.
    """

    def __init__(
        self,
        reader: ShardReader,
        tokens_per_batch: int,
        feature_dtype: torch.dtype | None = None,
        *,
        check_finite: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self.reader = reader
        self.tokens_per_batch = tokens_per_batch
        self.feature_dtype = feature_dtype
        self.check_finite = check_finite
        self.pin_memory = pin_memory
        self._pid = os.getpid()
        shard_sizes = [shard.num_sequences for shard in reader.shards]
        self._shard_ends = np.cumsum(shard_sizes, dtype=np.int64)
        self._finite = np.zeros(len(reader), dtype=bool)  # sequences found finite in this process

    def _local_reader(self) -> ShardReader:
        if self._pid != os.getpid():
            # Maps opened before a fork belong to the parent; a copy of the reader carries none (see
            # ShardReader.__getstate__) and maps the files again in this process on first use.
            self.reader, self._pid = copy.copy(self.reader), os.getpid()
        return self.reader

    def __getitem__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        reader = self._local_reader()
        in_worker = get_worker_info() is not None
        batch = collate_packed(
            [reader.sequence(i) for i in indices],
            self.tokens_per_batch,
            self.feature_dtype,
            pin_memory=self.pin_memory and not in_worker,
            shared=in_worker,
        )
        if self.check_finite and not self._finite[indices].all():
            self._check_finite(batch, indices)
            self._finite[indices] = True
        return batch

    def _check_finite(self, batch: dict[str, torch.Tensor], indices: Sequence[int]) -> None:
        for name in ("aux_hidden_states", "last_hidden_state"):
            if all_finite(batch[name]):
                continue
            bad_rows = torch.nonzero(~torch.isfinite(batch[name]).all(dim=1))
            i = int(indices[int(batch["document_ids"][bad_rows[0, 0]])])
            shard = self.reader.shards[int(np.searchsorted(self._shard_ends, i, side="right"))]
            raise DataError(
                f"{self.reader.directory / shard.file}: sample_id {int(self.reader.sample_ids[i])} has NaN or "
                f"inf in {name} (stored as {self.reader.manifest.dtype}, read as {batch[name].dtype}); "
                "if the read dtype is narrower, keep the stored one, otherwise the shard is damaged: check it "
                "with ShardReader(verify=True) and re-run the extraction command"
            )


class ShardDataModule(LightningDataModule):
    """Packed micro-batches of `tokens_per_batch` tokens from an extraction directory, split into train/val.

    Each rank reads its own bins (see PackedBatchSampler), so the Trainer must not add a distributed
    sampler: build it with `use_distributed_sampler=False`. The train sampler's position is saved in
    checkpoints through `state_dict()`, so a run resumed in the middle of an epoch continues where it stopped.

    Batches are built by `num_workers` DataLoader worker processes when it is positive, else by
    `loader_threads` background threads of this process (PrefetchLoader), else in the training loop itself.
    On a CUDA machine they arrive pinned, ready for a non-blocking copy to the GPU; the threads' loader hands
    them out on the GPU already (the Trainer's device, else `batch_device`), copied while the previous step ran.
    """

    def __init__(
        self,
        shard_dir: str | Path,
        tokens_per_batch: int,
        val_fraction: float,
        seed: int,
        num_workers: int,
        feature_dtype: torch.dtype | str | None = None,
        *,
        check_finite: bool = False,
        loader_threads: int = 2,
        train_fraction: float = 1.0,
        order_seed: int | None = None,
    ) -> None:
        super().__init__()
        if tokens_per_batch < 1:
            raise ConfigError(f"tokens_per_batch must be a positive number of tokens, got {tokens_per_batch}")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        if loader_threads < 0:
            raise ConfigError(f"loader_threads must be >= 0, got {loader_threads}")
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.shard_dir = Path(shard_dir)
        self.tokens_per_batch = tokens_per_batch
        self.val_fraction = val_fraction
        self.train_fraction = train_fraction
        self.seed = seed
        # The training batches' order (trainer.seed); the split and the share stay on `seed`.
        self.order_seed = seed if order_seed is None else order_seed
        self.num_workers = num_workers
        self.loader_threads = loader_threads
        self.feature_dtype = _resolve_dtype(feature_dtype)
        self.check_finite = check_finite
        self._dataset: PackedShardDataset | None = None
        self._train_idx = self._val_idx = np.zeros(0, dtype=np.int64)
        self._train_bins: list[list[int]] = []  # epoch 0 on a single rank: for the statistics
        self._train_sampler: PackedBatchSampler | None = None  # created with the train loader
        self._train_loader: DataLoader | PrefetchLoader | None = None  # the latest one
        self._resume_state: dict[str, int] | None = None  # loaded before the train sampler exists
        # Where the threads' loader hands batches out when no Trainer is attached; None: host memory.
        self.batch_device: torch.device | None = None
        # Applied by the threads' loader to each batch it hands out, on the GPU on its copy stream (online
        # training's target forward with trainer.online_overlap: OnlineTarget.features); None: none.
        self.batch_transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    def setup(self, stage: str | None = None) -> None:
        """Open the shards (once) and split them; no memory map is opened here."""
        if self._dataset is not None:
            return
        dataset = self._open_dataset()
        reader = dataset.reader
        self._train_idx, self._val_idx = split_by_sample_id(reader.sample_ids, self.val_fraction, self.seed)
        # trainer.train_fraction: a fixed share of the training split, so that more epochs repeat fewer sequences
        self._train_idx = subset_by_sample_id(
            reader.sample_ids, self._train_idx, self.train_fraction, self.seed
        )
        self._dataset = dataset
        self._train_bins = pack_sequences(
            reader.lengths, self._train_idx, self.tokens_per_batch, self.order_seed, 0
        )
        truncated = count_truncated(reader.lengths, np.arange(len(reader)), self.tokens_per_batch)
        if truncated:
            rank_zero_warn(
                f"{self.shard_dir}: {truncated} of {len(reader)} sequences are longer than tokens_per_batch="
                f"{self.tokens_per_batch} and lose their tail; raise the tokens per batch or extract with a "
                "shorter maximum length"
            )
        rank_zero_info(
            f"{self.shard_dir}: {self.num_train_sequences} train sequences ({self.train_tokens} tokens, "
            f"packing efficiency {self.packing_efficiency:.1%}), {self.num_val_sequences} validation sequences"
        )

    def _open_dataset(self) -> PackedShardDataset:
        """The packed micro-batches of the folder's sequences; a subclass may read them from another source
        (eaglet.train.online reads token streams only)."""
        return PackedShardDataset(
            ShardReader(self.shard_dir),
            self.tokens_per_batch,
            self.feature_dtype,
            check_finite=self.check_finite,
            pin_memory=torch.cuda.is_available(),
        )

    def _require_setup(self) -> PackedShardDataset:
        if self._dataset is None:
            raise RuntimeError("ShardDataModule.setup() must run before its data is used")
        return self._dataset

    @property
    def manifest(self) -> Manifest:
        return self._require_setup().reader.manifest

    @property
    def num_train_sequences(self) -> int:
        self._require_setup()
        return len(self._train_idx)

    @property
    def num_val_sequences(self) -> int:
        self._require_setup()
        return len(self._val_idx)

    @property
    def train_tokens(self) -> int:
        """Tokens trained on per epoch (over-long sequences counted up to tokens_per_batch)."""
        lengths = self._require_setup().reader.lengths[self._train_idx]
        return int(np.minimum(lengths, self.tokens_per_batch).sum())

    @property
    def packing_efficiency(self) -> float:
        """Share of the training micro-batch tokens that are real tokens, not padding (one rank's packing)."""
        lengths = self._require_setup().reader.lengths
        return packing_efficiency(lengths, self._train_bins, self.tokens_per_batch)

    def train_batches_per_rank(self, world_size: int) -> int:
        """Micro-batches each of `world_size` ranks runs in every epoch (see balance_bins)."""
        self._require_setup()
        return -(-len(self._train_bins) // world_size)

    def _placement(self) -> tuple[int, int]:
        """(rank, world size) of this process: the attached Trainer's, else a single process."""
        if self.trainer is None:
            return 0, 1
        # Lightning has no public accessor for this flag; its default would wrap our rank-aware sampler
        # in a DistributedSamplerWrapper and shard every rank's batches a second time.
        if self.trainer.world_size > 1 and self.trainer._accelerator_connector.use_distributed_sampler:
            raise ConfigError(
                "ShardDataModule shards batches across ranks itself: build the Trainer with "
                "use_distributed_sampler=False"
            )
        return self.trainer.global_rank, self.trainer.world_size

    def _sampler(self, indices: np.ndarray, shuffle: bool) -> PackedBatchSampler:
        rank, world_size = self._placement()
        lengths = self._require_setup().reader.lengths
        return PackedBatchSampler(
            lengths,
            indices,
            self.tokens_per_batch,
            seed=self.order_seed if shuffle else self.seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
        )

    def _train(self) -> PackedBatchSampler:
        """The train sampler for the current placement; kept across loaders so that its position persists."""
        sampler = self._train_sampler
        if sampler is None or (sampler.rank, sampler.world_size) != self._placement():
            sampler = self._sampler(self._train_idx, shuffle=True)
            if self._resume_state is not None:
                sampler.load_state_dict(self._resume_state)
                self._resume_state = None
            self._train_sampler = sampler
        return sampler

    def _copier(self) -> DeviceCopier | None:
        strategy = getattr(self.trainer, "strategy", None)
        device = strategy.root_device if strategy is not None else self.batch_device
        return DeviceCopier(device) if device is not None and torch.device(device).type == "cuda" else None

    def _loader(self, sampler: PackedBatchSampler) -> DataLoader | PrefetchLoader:
        if self.num_workers == 0 and self.loader_threads > 0:
            return PrefetchLoader(
                self._require_setup(), sampler, self.loader_threads, self._copier(), self.batch_transform
            )
        # batch_size=None: the sampler's item is a whole micro-batch's index list, which the dataset
        # turns into one packed row; there is nothing left to collate. Rows built here are pinned already
        # (pin_memory returns them as they are); rows from workers are copied into pinned memory.
        return DataLoader(
            self._require_setup(),
            sampler=sampler,
            batch_size=None,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader | PrefetchLoader:
        self._train_loader = self._loader(self._train())
        return self._train_loader

    def val_dataloader(self) -> DataLoader | PrefetchLoader | list[DataLoader]:
        """The validation loader; an empty list (no validation) when trainer.val_fraction is 0."""
        self._require_setup()
        if len(self._val_idx) == 0:
            return []
        return self._loader(self._sampler(self._val_idx, shuffle=False))

    def state_dict(self) -> dict[str, Any]:
        """The train sampler's {"epoch", "batches_done"}; while fitting, batches_done counts trained batches."""
        if self._train_sampler is None:
            return dict(self._resume_state or {})
        state = self._train_sampler.state_dict()
        if self.trainer is not None and self.trainer.state.fn == TrainerFn.FITTING:
            # DataLoader workers (and Lightning's fetcher) draw batches ahead of the training step, so the
            # sampler's count runs ahead; the fit loop's count is what the restored loop resumes after.
            state["batches_done"] = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        elif isinstance(self._train_loader, PrefetchLoader):
            state["batches_done"] -= self._train_loader.in_flight  # drawn, not handed out yet
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._train_sampler is None:
            self._resume_state = dict(state_dict)
        else:
            self._train_sampler.load_state_dict(state_dict)
