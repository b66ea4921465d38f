"""Bin packing, the train/val split, the rank-aware resumable sampler and the packed-row collate."""

from __future__ import annotations

from collections import Counter
from itertools import islice, pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglet.errors import ConfigError, DataError
from eaglet.shards import (
    MANIFEST_VERSION,
    Manifest,
    SequenceFeatures,
    ShardReader,
    write_manifest,
    write_shard,
)
from eaglet.train.packing import (
    collate_packed,
    count_truncated,
    pack_sequences,
    packed_buffers,
    packing_efficiency,
)
from eaglet.train.sampler import PackedBatchSampler, balance_bins, split_by_sample_id, subset_by_sample_id

N_AUX, H = 3, 8
BUDGET = 64


def random_lengths(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 51, n).tolist()


def write_dataset(
    directory: Path, lengths: list[int], *, num_shards: int = 2, dtype: torch.dtype = torch.bfloat16
) -> list[SequenceFeatures]:
    """Write sequences of `lengths` over `num_shards` shards (sample ids 1000, 1007, ...); return them."""
    gen = torch.Generator().manual_seed(len(lengths))
    sequences = [
        SequenceFeatures(
            sample_id=1000 + 7 * i,
            input_ids=torch.randint(1, 500, (n,), generator=gen),  # never 0, the padding id
            loss_mask=torch.rand(n, generator=gen) > 0.3,
            aux_hidden_states=torch.randn(n, N_AUX, H, generator=gen),
            last_hidden_state=torch.randn(n, H, generator=gen),
        )
        for i, n in enumerate(lengths)
    ]
    bounds = np.linspace(0, len(sequences), num_shards + 1).astype(int)
    infos = [write_shard(directory, k, sequences[a:b], dtype) for k, (a, b) in enumerate(pairwise(bounds))]
    manifest = Manifest(
        version=MANIFEST_VERSION,
        status="complete",
        target={"name": "tiny", "num_layers": 6, "hidden_size": H, "vocab_size": 500},
        aux_layer_ids=[2, 3, 4],
        last_layer_id=6,
        last_hidden_pre_norm=True,
        hidden_size=H,
        vocab_size=500,
        dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
        inputs_fingerprint="test",
        shards=infos,
    )
    write_manifest(directory, manifest)
    return sequences


def sizes(lengths: list[int], bins: list[list[int]]) -> list[int]:
    return [sum(min(lengths[i], BUDGET) for i in b) for b in bins]


# --- packing -------------------------------------------------------------------------------------------


def test_best_fit_decreasing_on_a_hand_made_case() -> None:
    # 6 opens bin 0, 5 opens bin 1, 4 fills bin 0 exactly, then 3 and 2 fill bin 1.
    lengths = np.array([4, 6, 2, 5, 3])
    assert pack_sequences(lengths, [0, 1, 2, 3, 4], 10, seed=0, epoch=0, shuffle=False) == [[1, 0], [3, 4, 2]]


def test_packing_keeps_every_sequence_once_within_the_budget() -> None:
    lengths = random_lengths(40)
    indices = np.arange(0, 40, 2)  # a subset, as for a train split
    bins = pack_sequences(np.array(lengths), indices, BUDGET, seed=3, epoch=1)
    assert sorted(i for b in bins for i in b) == indices.tolist()
    assert max(sizes(lengths, bins)) <= BUDGET
    real = sum(lengths[i] for i in indices)
    assert len(bins) <= -(-real // BUDGET) + 1  # near the lower bound
    assert packing_efficiency(np.array(lengths), bins, BUDGET) == pytest.approx(real / (len(bins) * BUDGET))


def test_bin_order_follows_seed_and_epoch() -> None:
    lengths = np.array(random_lengths(40))
    indices = np.arange(40)
    first = pack_sequences(lengths, indices, BUDGET, seed=1, epoch=0)
    assert pack_sequences(lengths, indices, BUDGET, seed=1, epoch=0) == first
    for other in (
        pack_sequences(lengths, indices, BUDGET, 1, 1),
        pack_sequences(lengths, indices, BUDGET, 2, 0),
    ):
        assert other != first and len(other) == len(first)
    unshuffled = pack_sequences(lengths, indices, BUDGET, 1, 0, shuffle=False)
    assert pack_sequences(lengths, indices, BUDGET, 7, 5, shuffle=False) == unshuffled


def test_epochs_shuffle_the_bin_order_and_regroup_equal_lengths() -> None:
    distinct = np.random.default_rng(0).permutation(np.arange(3, 43))  # no ties: the same bins every epoch
    epochs = [pack_sequences(distinct, np.arange(40), BUDGET, seed=1, epoch=e) for e in (0, 1)]
    assert epochs[0] != epochs[1]
    assert sorted(map(sorted, epochs[0])) == sorted(map(sorted, epochs[1]))

    tied = np.random.default_rng(0).choice([10, 20, 30], 40)  # equal lengths are drawn anew each epoch
    groups = [pack_sequences(tied, np.arange(40), BUDGET, seed=1, epoch=e) for e in (0, 1)]
    assert len(groups[0]) == len(groups[1])
    assert {frozenset(b) for b in groups[0]} != {frozenset(b) for b in groups[1]}


def test_over_long_sequences_are_counted_and_fill_a_bin_alone() -> None:
    lengths = np.array([100, 3, 64, 5, 65])
    assert count_truncated(lengths, np.arange(5), BUDGET) == 2
    assert count_truncated(lengths, [1, 2, 3], BUDGET) == 0
    bins = pack_sequences(lengths, np.arange(5), BUDGET, seed=0, epoch=0, shuffle=False)
    assert sorted(map(sorted, bins)) == [[0], [1, 3], [2], [4]]
    assert packing_efficiency(lengths, bins, BUDGET) == pytest.approx((3 * 64 + 8) / (4 * 64))
    with pytest.raises(ConfigError, match="tokens_per_batch"):
        pack_sequences(lengths, np.arange(5), 0, seed=0, epoch=0)


# --- split ---------------------------------------------------------------------------------------------


def test_split_is_deterministic_disjoint_and_stable_when_data_is_appended() -> None:
    ids = np.arange(500, 5500, 5, dtype=np.int64)  # 1000 sequences
    train, val = split_by_sample_id(ids, 0.1, seed=0)
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(len(ids)))
    assert 70 <= len(val) <= 130
    again_train, again_val = split_by_sample_id(ids, 0.1, seed=0)
    assert np.array_equal(train, again_train) and np.array_equal(val, again_val)
    # Appending sequences leaves the side of every existing one unchanged.
    more = np.concatenate([ids, np.arange(9000, 9400, dtype=np.int64)])
    _, val_more = split_by_sample_id(more, 0.1, seed=0)
    assert np.array_equal(val_more[val_more < len(ids)], val)
    _, other_seed = split_by_sample_id(ids, 0.1, seed=1)
    assert not np.array_equal(other_seed, val)


def test_a_training_share_is_a_fixed_random_subset_nested_and_stable_when_data_is_appended() -> None:
    ids = np.arange(500, 10500, 5, dtype=np.int64)  # 2000 sequences
    train, val = split_by_sample_id(ids, 0.1, seed=0)
    quarter = subset_by_sample_id(ids, train, 0.25, seed=0)
    assert set(quarter) <= set(train) and np.all(np.diff(quarter) > 0)
    assert 0.20 * len(train) <= len(quarter) <= 0.30 * len(train)
    # Another draw than the split's: the share is no slice of the ids, and the held-out side plays no part.
    assert not np.array_equal(quarter, train[: len(quarter)])
    whole = subset_by_sample_id(ids, np.arange(len(ids)), 0.25, seed=0)
    assert np.array_equal(np.intersect1d(whole, train), quarter)
    # A smaller share lies inside a larger one; the same seed gives the same share; another seed, another.
    assert set(subset_by_sample_id(ids, train, 0.1, seed=0)) <= set(quarter)
    assert np.array_equal(subset_by_sample_id(ids, train, 0.25, seed=0), quarter)
    assert not np.array_equal(subset_by_sample_id(ids, train, 0.25, seed=1), quarter)
    # Appending sequences keeps every existing one on its side.
    more = np.concatenate([ids, np.arange(20000, 20400, dtype=np.int64)])
    more_quarter = subset_by_sample_id(more, np.arange(len(more)), 0.25, seed=0)
    assert np.array_equal(more_quarter[more_quarter < len(ids)], whole)
    # All of it, at least one sequence, and a share out of range named.
    assert np.array_equal(subset_by_sample_id(ids, train, 1.0, seed=0), train)
    assert len(subset_by_sample_id(ids, train, 1e-9, seed=0)) == 1
    with pytest.raises(ConfigError, match=r"train_fraction must be in \(0, 1\], got 0"):
        subset_by_sample_id(ids, train, 0.0, seed=0)


def test_split_holds_out_at_least_one_sequence_and_reports_empty_sides() -> None:
    ids = np.array([3, 9, 27], dtype=np.int64)
    train, val = split_by_sample_id(ids, 1e-9, seed=0)
    assert len(val) == 1 and len(train) == 2
    train, val = split_by_sample_id(ids, 0.0, seed=0)
    assert train.tolist() == [0, 1, 2] and len(val) == 0
    with pytest.raises(DataError, match=r"1 sequence.*trainer\.val_fraction=0"):
        split_by_sample_id(np.array([3]), 0.2, seed=0)
    with pytest.raises(DataError, match=r"all 3 sequences went to validation.*trainer\.val_fraction"):
        split_by_sample_id(ids, 0.999999, seed=0)
    with pytest.raises(ConfigError, match="val_fraction"):
        split_by_sample_id(ids, 1.0, seed=0)


# --- sampler -------------------------------------------------------------------------------------------


def epoch_batches(
    lengths: np.ndarray, indices: np.ndarray, world_size: int, epoch: int
) -> list[list[list[int]]]:
    ranks = []
    for rank in range(world_size):
        sampler = PackedBatchSampler(lengths, indices, BUDGET, seed=5, rank=rank, world_size=world_size)
        sampler.set_epoch(epoch)
        ranks.append(list(sampler))
        assert len(ranks[-1]) == len(sampler)
    return ranks


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_sequence_once_per_epoch_across_equal_length_ranks(world_size: int) -> None:
    lengths = np.array(random_lengths(37, seed=4))
    indices = np.arange(1, 37)  # position 0 is "validation"
    for epoch in (0, 1):
        ranks = epoch_batches(lengths, indices, world_size, epoch)
        assert len({len(batches) for batches in ranks}) == 1
        seen = Counter(i for batches in ranks for batch in batches for i in batch)
        assert seen == Counter(indices.tolist())
        assert max(sizes(lengths.tolist(), [b for batches in ranks for b in batches])) <= BUDGET


def test_the_data_needs_balancing_for_some_world_size() -> None:
    # Guards the test above: with these lengths, 2 or 3 ranks need bins split to run equal steps.
    lengths = np.array(random_lengths(37, seed=4))
    raw = len(pack_sequences(lengths, np.arange(1, 37), BUDGET, seed=5, epoch=0))
    assert raw % 2 or raw % 3


def test_epoch_order_changes_and_repeats_for_the_same_seed_and_epoch() -> None:
    lengths = np.array(random_lengths(30))
    indices = np.arange(30)
    epoch0, epoch1 = epoch_batches(lengths, indices, 2, 0), epoch_batches(lengths, indices, 2, 1)
    assert epoch0 != epoch1
    assert epoch_batches(lengths, indices, 2, 1) == epoch1
    sampler = PackedBatchSampler(lengths, indices, BUDGET, seed=5, rank=1, world_size=2)
    sampler.set_epoch(1)
    assert list(sampler) == epoch1[1]
    assert list(sampler) == epoch1[1]  # iterating again replays the epoch


def test_validation_sampler_does_not_shuffle() -> None:
    lengths = np.array(random_lengths(30))
    sampler = PackedBatchSampler(lengths, np.arange(30), BUDGET, seed=5, shuffle=False)
    first = list(sampler)
    sampler.set_epoch(3)
    assert list(sampler) == first


def test_balancing_repeats_bins_only_when_none_can_be_split() -> None:
    assert balance_bins([[0, 1, 2], [3]], 3) == [[0, 1], [3], [2]]
    # Five bins of one sequence each, three ranks: the first bin runs again to give every rank 2 steps.
    lengths = np.full(5, BUDGET)
    ranks = epoch_batches(lengths, np.arange(5), 3, 0)
    assert [len(batches) for batches in ranks] == [2, 2, 2]
    seen = Counter(i for batches in ranks for batch in batches for i in batch)
    assert set(seen) == set(range(5)) and sorted(seen.values()) == [1, 1, 1, 1, 2]


def test_resume_yields_exactly_the_remaining_batches() -> None:
    lengths = np.array(random_lengths(40))
    indices = np.arange(40)
    sampler = PackedBatchSampler(lengths, indices, BUDGET, seed=2, rank=1, world_size=2)
    sampler.set_epoch(1)
    expected = list(sampler)
    consumed = list(islice(iter(sampler), 3))
    state = sampler.state_dict()
    assert state == {"epoch": 1, "batches_done": 3} and consumed == expected[:3]

    resumed = PackedBatchSampler(lengths, indices, BUDGET, seed=2, rank=1, world_size=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # what Lightning does before iterating: the resume point survives it
    assert list(resumed) == expected[3:]
    assert len(resumed) == len(expected)
    assert list(resumed) == expected  # later passes over the epoch are whole again
    resumed.set_epoch(2)
    assert len(list(resumed)) == len(expected)


def test_resume_after_a_finished_epoch_starts_the_next_one() -> None:
    lengths = np.array(random_lengths(40))
    sampler = PackedBatchSampler(lengths, np.arange(40), BUDGET, seed=2)
    next_epoch = PackedBatchSampler(lengths, np.arange(40), BUDGET, seed=2)
    next_epoch.set_epoch(1)
    list(sampler)
    resumed = PackedBatchSampler(lengths, np.arange(40), BUDGET, seed=2)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.epoch == 1 and list(resumed) == list(next_epoch)


def test_resume_state_from_other_settings_is_rejected() -> None:
    sampler = PackedBatchSampler(np.array(random_lengths(40)), np.arange(40), BUDGET)
    with pytest.raises(ConfigError, match="same settings"):
        sampler.load_state_dict({"epoch": 0, "batches_done": len(sampler) + 1})
    with pytest.raises(DataError, match="batches_done"):
        sampler.load_state_dict({"epoch": 0})


# --- collate -------------------------------------------------------------------------------------------


def test_collate_concatenates_the_mapped_sequences(tmp_path: Path) -> None:
    lengths = [7, 12, 5, 9]
    written = write_dataset(tmp_path, lengths)
    reader = ShardReader(tmp_path)
    chosen = [3, 0, 2]  # across both shards, out of order
    real = sum(lengths[i] for i in chosen)
    row = collate_packed([reader.sequence(i) for i in chosen], BUDGET)

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(written[i], name) for i in chosen])

    assert {name: t.shape[0] for name, t in row.items() if t.ndim} == dict.fromkeys(
        ["input_ids", "loss_mask", "document_ids", "position_ids", "aux_hidden_states", "last_hidden_state"],
        BUDGET,
    )
    assert row["input_ids"].dtype == torch.long and row["loss_mask"].dtype == torch.bool
    assert torch.equal(row["input_ids"][:real], cat("input_ids"))
    assert torch.equal(row["loss_mask"][:real], cat("loss_mask"))
    # aux [T, n_aux, H] laid side by side: columns k*H..(k+1)*H hold aux layer k.
    assert row["aux_hidden_states"].shape == (BUDGET, N_AUX * H)
    assert torch.equal(row["aux_hidden_states"][:real, H : 2 * H], cat("aux_hidden_states")[:, 1].bfloat16())
    assert torch.equal(
        row["aux_hidden_states"][:real].view(real, N_AUX, H), cat("aux_hidden_states").bfloat16()
    )
    assert torch.equal(row["last_hidden_state"][:real], cat("last_hidden_state").bfloat16())
    pad = BUDGET - real
    expected_docs = [0] * 9 + [1] * 7 + [2] * 5 + [3] * pad
    assert row["document_ids"].tolist() == expected_docs
    assert row["position_ids"].tolist() == [*range(9), *range(7), *range(5), *range(pad)]
    assert int(row["num_real_tokens"]) == real
    assert not row["input_ids"][real:].any() and not row["loss_mask"][real:].any()
    assert not row["aux_hidden_states"][real:].any() and not row["last_hidden_state"][real:].any()


def test_collate_converts_features_truncates_and_refuses_overflow(tmp_path: Path) -> None:
    written = write_dataset(tmp_path, [80, 30, 40], num_shards=1)
    reader = ShardReader(tmp_path)
    row = collate_packed([reader.sequence(0)], BUDGET, torch.float32)
    assert row["last_hidden_state"].dtype == torch.float32
    assert torch.equal(row["last_hidden_state"], written[0].last_hidden_state[:BUDGET].bfloat16().float())
    assert torch.equal(row["input_ids"], written[0].input_ids[:BUDGET])
    assert row["document_ids"].unique().tolist() == [0] and int(row["num_real_tokens"]) == BUDGET
    with pytest.raises(ValueError, match="do not fit"):
        collate_packed([reader.sequence(1), reader.sequence(2)], BUDGET)


def test_packed_buffers_are_aligned_disjoint_views_of_one_shared_allocation() -> None:
    row = packed_buffers(10, N_AUX, H, torch.bfloat16, shared=True)
    assert {name: (tuple(t.shape), t.dtype) for name, t in row.items()} == {
        "input_ids": ((10,), torch.long),
        "loss_mask": ((10,), torch.bool),
        "document_ids": ((10,), torch.long),
        "position_ids": ((10,), torch.long),
        "aux_hidden_states": ((10, N_AUX * H), torch.bfloat16),
        "last_hidden_state": ((10, H), torch.bfloat16),
        "num_real_tokens": ((), torch.long),
    }
    assert len({t.untyped_storage().data_ptr() for t in row.values()}) == 1
    assert all(t.is_shared() and t.is_contiguous() for t in row.values())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in row.values())
    assert all(begin % 64 == 0 for begin, _ in spans)
    assert all(end <= next_begin for (_, end), (next_begin, _) in pairwise(spans))
