"""ShardDataModule: split, loaders with and without workers, checks, and resuming inside Lightning."""

from __future__ import annotations

import json
import struct
from collections import Counter
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_packing import BUDGET, N_AUX, H, random_lengths, write_dataset

from eaglet.errors import ConfigError, DataError
from eaglet.shards import ShardReader
from eaglet.train.datamodule import ShardDataModule

NUM_SEQUENCES = 36


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("shards")
    write_dataset(directory, random_lengths(NUM_SEQUENCES, seed=1))
    return directory


def make_module(directory: Path, num_workers: int = 0, **kwargs: object) -> ShardDataModule:
    module = ShardDataModule(directory, BUDGET, val_fraction=0.15, seed=3, num_workers=num_workers, **kwargs)
    module.setup("fit")
    return module


def fake_trainer(rank: int, world_size: int, use_distributed_sampler: bool = False) -> SimpleNamespace:
    connector = SimpleNamespace(use_distributed_sampler=use_distributed_sampler)
    return SimpleNamespace(global_rank=rank, world_size=world_size, _accelerator_connector=connector)


def shard_maps(directory: Path) -> list[str]:
    """Memory maps of this process onto files of `directory`."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(directory) in line]


def test_setup_splits_and_reports_statistics(shard_dir: Path) -> None:
    module = make_module(shard_dir)
    reader = ShardReader(shard_dir)
    assert module.manifest.hidden_size == H and module.manifest.aux_layer_ids == [2, 3, 4]
    assert module.num_train_sequences + module.num_val_sequences == NUM_SEQUENCES
    assert module.num_val_sequences >= 1
    assert module.train_tokens + int(reader.lengths[module._val_idx].sum()) == int(reader.lengths.sum())
    batches = list(module.train_dataloader())
    real = sum(int(b["num_real_tokens"]) for b in batches)
    assert real == module.train_tokens
    assert module.packing_efficiency == pytest.approx(real / (len(batches) * BUDGET))
    again = make_module(shard_dir)
    assert np.array_equal(again._val_idx, module._val_idx)
    assert not set(module._val_idx) & set(module._train_idx)
    with pytest.raises(RuntimeError, match="setup"):
        _ = ShardDataModule(shard_dir, BUDGET, 0.1, 0, 0).train_tokens


def test_loaders_yield_static_packed_rows_covering_each_split_once(shard_dir: Path) -> None:
    module = make_module(shard_dir, feature_dtype="float32")
    reader = ShardReader(shard_dir)
    for loader, indices in (
        (module.train_dataloader(), module._train_idx),
        (module.val_dataloader(), module._val_idx),
    ):
        tokens = Counter()
        for batch in loader:
            assert batch["input_ids"].shape == (BUDGET,)
            assert batch["aux_hidden_states"].shape == (BUDGET, N_AUX * H)
            assert batch["aux_hidden_states"].dtype == torch.float32
            real = int(batch["num_real_tokens"])
            tokens.update(batch["input_ids"][:real].tolist())
        expected = Counter(int(t) for i in indices for t in reader.sequence(int(i))["input_ids"])
        assert tokens == expected


def test_workers_yield_the_same_batches_and_map_shards_themselves(tmp_path: Path) -> None:
    write_dataset(tmp_path, random_lengths(NUM_SEQUENCES, seed=2))  # mapped by no earlier test
    module = make_module(tmp_path, num_workers=2)
    loader = module.train_dataloader()
    assert loader.persistent_workers and loader.num_workers == 2
    with_workers = list(loader)
    assert shard_maps(tmp_path) == []  # only the workers mapped the shards
    plain = list(make_module(tmp_path).train_dataloader())
    assert len(with_workers) == len(plain)
    for a, b in zip(plain, with_workers, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_forked_dataset_drops_the_maps_of_its_parent(
    shard_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = make_module(shard_dir).train_dataloader().dataset
    dataset[[0]]
    parent_reader = dataset.reader
    monkeypatch.setattr("os.getpid", lambda: -1)  # as seen from a forked worker
    batch = dataset[[0]]
    assert dataset.reader is not parent_reader and int(batch["num_real_tokens"]) > 0


def test_ranks_come_from_the_attached_trainer(shard_dir: Path) -> None:
    ranks = []
    for rank in range(2):
        module = make_module(shard_dir)
        module.trainer = fake_trainer(rank, 2)
        ranks.append(list(module.train_dataloader().sampler))
    assert (
        len(ranks[0]) == len(ranks[1]) == module.train_batches_per_rank(2) == len(module.train_dataloader())
    )
    assert module.train_batches_per_rank(1) == len(make_module(shard_dir).train_dataloader())
    seen = [i for batches in ranks for batch in batches for i in batch]
    assert sorted(seen) == module._train_idx.tolist()  # disjoint ranks, every sequence once
    module.trainer = fake_trainer(0, 2, use_distributed_sampler=True)
    with pytest.raises(ConfigError, match="use_distributed_sampler=False"):
        module.train_dataloader()


def test_state_dict_resumes_the_train_loader(shard_dir: Path) -> None:
    module = make_module(shard_dir)
    assert module.state_dict() == {}
    expected = [b["input_ids"] for b in module.train_dataloader()]
    consumed = [b["input_ids"] for b in islice(module.train_dataloader(), 3)]
    state = module.state_dict()
    assert state == {"epoch": 0, "batches_done": 3}

    resumed = ShardDataModule(shard_dir, BUDGET, val_fraction=0.15, seed=3, num_workers=0)
    resumed.load_state_dict(state)  # Lightning restores the state before the loaders exist
    assert resumed.state_dict() == state
    resumed.setup("fit")
    rest = [b["input_ids"] for b in resumed.train_dataloader()]
    assert all(torch.equal(a, b) for a, b in zip(consumed + rest, expected, strict=True))


def test_over_long_sequences_are_reported_once(tmp_path: Path) -> None:
    write_dataset(tmp_path, [BUDGET + 10, 5, 6, BUDGET + 1, 9])
    with pytest.warns(UserWarning, match=f"2 of 5 sequences are longer than tokens_per_batch={BUDGET}"):
        module = make_module(tmp_path)
    assert max(int(b["num_real_tokens"]) for b in module.train_dataloader()) == BUDGET


def test_empty_split_and_bad_settings_are_reported(tmp_path: Path) -> None:
    write_dataset(tmp_path, [12], num_shards=1)
    with pytest.raises(DataError, match=r"1 sequence.*trainer\.val_fraction"):
        make_module(tmp_path)
    module = ShardDataModule(tmp_path, BUDGET, val_fraction=0.0, seed=0, num_workers=0)
    module.setup()
    assert module.val_dataloader() == [] and len(module.train_dataloader()) == 1
    with pytest.raises(ConfigError, match="feature_dtype"):
        ShardDataModule(tmp_path, BUDGET, 0.1, 0, 0, feature_dtype="float64")
    with pytest.raises(ConfigError, match="num_workers"):
        ShardDataModule(tmp_path, BUDGET, 0.1, 0, num_workers=-1)


def poison_token(shard: Path, token: int) -> None:
    """Overwrite one aux feature of `token` (within the shard) with a bfloat16 NaN, keeping the file's size."""
    with open(shard, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        begin = json.loads(f.read(header_len))["aux_hidden_states"]["data_offsets"][0]
        f.seek(8 + header_len + begin + (token * N_AUX * H + H + 2) * 2)
        f.write(struct.pack("<H", 0x7FC0))


def test_non_finite_features_name_the_shard_and_sample(tmp_path: Path) -> None:
    lengths = [5, 6, 7, 8, 9, 10]
    written = write_dataset(tmp_path, lengths)
    poison_token(tmp_path / "shard-00001.safetensors", lengths[3] + 2)  # third token of sequence 4
    quiet = make_module(tmp_path)
    assert sum(1 for _ in quiet.train_dataloader()) >= 1
    module = make_module(tmp_path, check_finite=True)
    loaders = [module.train_dataloader(), module.val_dataloader()]
    with pytest.raises(DataError, match=rf"shard-00001\.safetensors: sample_id {written[4].sample_id} .*NaN"):
        for loader in loaders:
            for _ in loader:
                pass


class RecordingModule(L.LightningModule):
    """Records the first tokens of each training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["input_ids"][:4].tolist())
        return self.weight * batch["aux_hidden_states"].float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    shard_dir: Path, root: Path, ckpt_path: Path | None = None, **trainer_kwargs: object
) -> list[list[int]]:
    """Two epochs through workers that prefetch; the first tokens of every batch trained on."""
    model = RecordingModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=root,
        **trainer_kwargs,
    )
    data = ShardDataModule(shard_dir, BUDGET, val_fraction=0.0, seed=3, num_workers=2)
    data.setup()  # as the training entry point does, to size the schedule
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_resumes_mid_epoch_and_at_epoch_end(shard_dir: Path, tmp_path: Path) -> None:
    full = fit(shard_dir, tmp_path)
    per_epoch = len(full) // 2
    for steps in (3, per_epoch):
        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=steps, filename=f"{steps}")
        first = fit(shard_dir, tmp_path, max_steps=steps, callbacks=[checkpoint])
        saved = torch.load(tmp_path / f"{steps}.ckpt", weights_only=True)["ShardDataModule"]
        # The batches trained on, not the larger count the prefetching workers drew from the sampler.
        assert saved == {"epoch": 0, "batches_done": steps}
        assert first + fit(shard_dir, tmp_path, ckpt_path=tmp_path / f"{steps}.ckpt") == full
