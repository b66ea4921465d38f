"""ShardDataModule: split, loaders with workers, threads or neither, checks, and resuming inside Lightning."""

from __future__ import annotations

import json
import struct
import time
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
from eaglet.train.datamodule import ShardDataModule, all_finite
from eaglet.train.prefetch import DeviceCopier, PrefetchLoader

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


def test_a_training_share_trains_on_fewer_sequences_and_validates_on_all(shard_dir: Path) -> None:
    whole, half = make_module(shard_dir), make_module(shard_dir, train_fraction=0.5)
    assert np.array_equal(half._val_idx, whole._val_idx)
    assert set(half._train_idx) < set(whole._train_idx) and half.num_train_sequences >= 1
    reader = ShardReader(shard_dir)
    assert half.train_tokens == int(np.minimum(reader.lengths[half._train_idx], BUDGET).sum())
    tokens = Counter()
    for batch in half.train_dataloader():  # an epoch is the share, each sequence once
        tokens.update(batch["input_ids"][: int(batch["num_real_tokens"])].tolist())
    assert tokens == Counter(int(t) for i in half._train_idx for t in reader.sequence(int(i))["input_ids"])


def test_a_training_seed_reorders_the_training_batches_alone(shard_dir: Path) -> None:
    def batches(loader) -> list[list[int]]:
        return [b["input_ids"][: int(b["num_real_tokens"])].tolist() for b in loader]

    default = make_module(shard_dir)
    same, other = make_module(shard_dir, order_seed=3), make_module(shard_dir, order_seed=4)
    # order_seed = seed: as before.
    assert batches(same.train_dataloader()) == batches(default.train_dataloader())
    # Another order seed: the same split and the same training tokens, in other batches; validation unchanged.
    assert np.array_equal(other._val_idx, default._val_idx)
    assert np.array_equal(other._train_idx, default._train_idx)
    ours, theirs = batches(other.train_dataloader()), batches(default.train_dataloader())
    assert ours != theirs and Counter(t for b in ours for t in b) == Counter(t for b in theirs for t in b)
    assert batches(other.val_dataloader()) == batches(default.val_dataloader())
    quarter, quarter_other = (make_module(shard_dir, train_fraction=0.25, order_seed=s) for s in (None, 4))
    assert np.array_equal(quarter_other._train_idx, quarter._train_idx)  # the share stays on the data's seed


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


def reference_row(
    reader: ShardReader, indices: list[int], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """One packed row built the plain way: whole sequences concatenated, truncated to the budget, zero-padded."""
    seqs = [reader.sequence(i) for i in indices]
    sizes = [min(len(seq["input_ids"]), BUDGET) for seq in seqs]
    pad = BUDGET - sum(sizes)

    def cat(name: str) -> torch.Tensor:
        parts = [seq[name][:n].reshape(n, -1) for seq, n in zip(seqs, sizes, strict=True)]
        return torch.cat([*parts, torch.zeros(pad, parts[0].shape[1], dtype=parts[0].dtype)])

    features = {name: cat(name) for name in ("aux_hidden_states", "last_hidden_state")}
    return {
        "input_ids": cat("input_ids").squeeze(1).long(),
        "loss_mask": cat("loss_mask").squeeze(1).bool(),
        "document_ids": torch.cat([torch.full((n,), d) for d, n in enumerate([*sizes, pad])]),
        "position_ids": torch.cat([torch.arange(n) for n in [*sizes, pad]]),
        **{name: x.to(dtype or x.dtype) for name, x in features.items()},
        "num_real_tokens": torch.tensor(sum(sizes)),
    }


@pytest.mark.parametrize("feature_dtype", [None, "float32"])
@pytest.mark.parametrize(
    "loader",
    [
        {"num_workers": 0, "loader_threads": 0},
        {"loader_threads": 1},
        {"loader_threads": 3},
        {"num_workers": 2},
    ],
    ids=["in-loop", "1-thread", "3-threads", "2-workers"],
)
def test_every_loader_yields_the_rows_of_the_plain_concatenation(
    tmp_path: Path, loader: dict, feature_dtype: str | None
) -> None:
    lengths = [*random_lengths(NUM_SEQUENCES, seed=4), BUDGET + 9, BUDGET]  # two fill a row, one is cut
    write_dataset(tmp_path, lengths, num_shards=3)
    reader = ShardReader(tmp_path)
    module = make_module(tmp_path, feature_dtype=feature_dtype, check_finite=True, **loader)
    dtype = torch.float32 if feature_dtype else None
    for dataloader in (module.train_dataloader(), module.val_dataloader()):
        rows = list(dataloader)
        assert len(rows) == len(dataloader) > 0
        for indices, row in zip(dataloader.sampler, rows, strict=True):
            expected = reference_row(reader, indices, dtype)
            assert list(row) == list(expected)
            for name, value in expected.items():
                assert row[name].dtype == value.dtype and torch.equal(row[name], value), name


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
    with pytest.raises(ConfigError, match="loader_threads"):
        ShardDataModule(tmp_path, BUDGET, 0.1, 0, 0, loader_threads=-1)


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


@pytest.mark.parametrize(
    ("dtype", "bits", "exponent"),
    [(torch.bfloat16, torch.int16, 0x7F80), (torch.float16, torch.int16, 0x7C00)],
)
def test_all_finite_agrees_with_isfinite_on_every_16_bit_pattern(
    dtype: torch.dtype, bits: torch.dtype, exponent: int
) -> None:
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(bits).view(dtype)
    finite = torch.isfinite(patterns)
    assert int((~finite).sum()) == 2 * (0x8000 - exponent)  # all exponent bits set: either sign, any mantissa
    assert all_finite(patterns[finite]) and all_finite(patterns[:0])
    amid = patterns[finite][:64]
    for value in patterns[~finite]:  # inf and NaN of either sign, every payload, amid finite values
        row = amid.clone()
        row[37] = value
        assert not all_finite(row), hex(int(value.view(bits)) & 0xFFFF)


def test_all_finite_on_float32_edges_and_random_bits() -> None:
    edges = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0, -0.0, 1e-45])
    assert all_finite(edges)
    for bad in (float("inf"), float("-inf"), float("nan"), -float("nan")):
        assert not all_finite(torch.cat([edges, torch.tensor([bad])]))
    words = torch.randint(
        -(2**31), 2**31 - 1, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.int32
    )
    for chunk in words.view(torch.float32).split(64):
        assert all_finite(chunk) == bool(torch.isfinite(chunk).all())


class FakeCopier:
    """Records when batches are sent to the "device" and handed to the training stream."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def start(self, batch: dict[str, torch.Tensor], transform=None) -> tuple[dict[str, torch.Tensor], None]:
        self.log.append(("start", int(batch["input_ids"][0])))
        return batch, None

    def ready(self, batch: dict[str, torch.Tensor], _: None) -> dict[str, torch.Tensor]:
        self.log.append(("ready", int(batch["input_ids"][0])))
        return batch


class InstantDataset(torch.utils.data.Dataset):
    def __getitem__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(indices)}


def test_the_next_batch_is_sent_to_the_device_while_the_current_one_trains() -> None:
    copier = FakeCopier()
    sampler = [[i] for i in range(6)]
    loader = PrefetchLoader(InstantDataset(), sampler, threads=2, copier=copier)
    seen = []
    for batch in loader:
        time.sleep(0.05)  # a training step: the threads finish the next batches meanwhile
        seen.append(int(batch["input_ids"][0]))
        copier.log.append(("step", seen[-1]))
    assert seen == list(range(6))
    # Batch k reaches the training stream before its step; once the threads are ahead (from the second
    # step on), batch k is on its way before step k - 1 runs.
    for k in range(6):
        assert copier.log.index(("start", k)) < copier.log.index(("ready", k)) < copier.log.index(("step", k))
    for k in range(2, 6):
        assert copier.log.index(("start", k)) < copier.log.index(("step", k - 1))
    assert sorted(copier.log) == sorted([(e, k) for k in range(6) for e in ("start", "ready", "step")])


def _with_features(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stand-in for online training's target forward: a new tensor computed from the batch."""
    return {**batch, "aux_hidden_states": batch["input_ids"].float() * 2 + 1}


def test_the_loader_applies_a_transform_to_every_batch_in_order() -> None:
    sampler = [[i, i + 100] for i in range(5)]
    batches = list(PrefetchLoader(InstantDataset(), sampler, threads=2, transform=_with_features))
    assert [b["input_ids"].tolist() for b in batches] == sampler
    for batch in batches:
        assert torch.equal(batch["aux_hidden_states"], batch["input_ids"].float() * 2 + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream needs a CUDA device")
def test_the_transform_runs_on_the_copy_stream_and_its_output_is_ready_on_the_training_stream() -> None:
    copier = DeviceCopier("cuda")
    sampler = [[i] * 4096 for i in range(6)]
    for k, batch in enumerate(
        PrefetchLoader(InstantDataset(), sampler, threads=2, copier=copier, transform=_with_features)
    ):
        assert batch["aux_hidden_states"].device.type == "cuda"
        torch.cuda._sleep(1_000_000)  # a step on the training stream, while the next batch is transformed
        expected = torch.full((4096,), 2.0 * k + 1, device="cuda")
        assert torch.equal(batch["aux_hidden_states"], expected)


def test_an_abandoned_thread_loader_counts_only_the_batches_handed_out(shard_dir: Path) -> None:
    module = make_module(shard_dir, loader_threads=3)
    loader = module.train_dataloader()
    assert isinstance(loader, PrefetchLoader)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(2)]
    assert loader.in_flight == 4 and module.state_dict()["batches_done"] == 2
    del iterator  # stops the threads
    assert module.state_dict() == {"epoch": 0, "batches_done": 2} and len(first) == 2


def test_each_sequence_is_checked_once(shard_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = []
    monkeypatch.setattr("eaglet.train.datamodule.all_finite", lambda x: checks.append(x) or True)
    loader = make_module(shard_dir, check_finite=True).train_dataloader()
    first = len(list(loader))
    assert len(checks) == 2 * first  # the aux and the last hidden states of every batch
    loader.sampler.set_epoch(1)
    assert len(list(loader)) == first and len(checks) == 2 * first


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
    shard_dir: Path, root: Path, loader: dict, ckpt_path: Path | None = None, **trainer_kwargs: object
) -> list[list[int]]:
    """Two epochs through a loader that prefetches; the first tokens of every batch trained on."""
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
    data = ShardDataModule(shard_dir, BUDGET, val_fraction=0.0, seed=3, **loader)
    data.setup()  # as the training entry point does, to size the schedule
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model.seen


class ValidatingModule(RecordingModule):
    def __init__(self) -> None:
        super().__init__()
        self.val_tokens = 0

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_tokens += int(batch["num_real_tokens"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_trains_and_validates_through_the_thread_loader(shard_dir: Path, tmp_path: Path) -> None:
    model = ValidatingModule()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
        default_root_dir=tmp_path, num_sanity_val_steps=0,
    )  # fmt: skip
    data = make_module(shard_dir, loader_threads=2)
    trainer.fit(model, data)
    assert isinstance(data.val_dataloader(), PrefetchLoader)
    assert len(model.seen) == data.train_batches_per_rank(1)
    assert model.val_tokens == int(ShardReader(shard_dir).lengths[data._val_idx].sum())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "loader", [{"num_workers": 2}, {"num_workers": 0, "loader_threads": 2}], ids=["workers", "threads"]
)
def test_lightning_resumes_mid_epoch_and_at_epoch_end(shard_dir: Path, tmp_path: Path, loader: dict) -> None:
    full = fit(shard_dir, tmp_path, loader)
    per_epoch = len(full) // 2
    for steps in (3, per_epoch):
        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=steps, filename=f"{steps}")
        first = fit(shard_dir, tmp_path, loader, max_steps=steps, callbacks=[checkpoint])
        saved = torch.load(tmp_path / f"{steps}.ckpt", weights_only=True)["ShardDataModule"]
        # The batches trained on, not the larger count the prefetching loader drew from the sampler.
        assert saved == {"epoch": 0, "batches_done": steps}
        assert first + fit(shard_dir, tmp_path, loader, ckpt_path=tmp_path / f"{steps}.ckpt") == full
