"""Token counting and the draft-vocab mapping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from eaglet.errors import ConfigError, DataError
from eaglet.shards import build_vocab_mapping, count_tokens, load_token_counts, save_token_counts

# id:            0  1  2  3  4  5  6  7
COUNTS = torch.tensor([5, 0, 3, 3, 7, 1, 3, 0])


def test_mapping_on_hand_made_counts() -> None:
    d2t, t2d = build_vocab_mapping(COUNTS, 3)  # 7 (id 4), 5 (id 0), then the tie of 3s goes to id 2
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [0, 1, 2]
    assert t2d.tolist() == [True, False, True, False, True, False, False, False]

    d2t, t2d = build_vocab_mapping(COUNTS, 4)  # the tie now admits id 3, not id 6
    assert d2t.tolist() == [0, 1, 1, 1]
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 3, 4]
    assert int(t2d.sum()) == 4 and t2d.nonzero().flatten().tolist() == [0, 2, 3, 4]


def test_mapping_matches_a_reference_on_many_ties() -> None:
    counts = torch.randint(0, 6, (2000,), generator=torch.Generator().manual_seed(0))
    ranked = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    expected = sorted(ranked[:300])
    d2t, t2d = build_vocab_mapping(counts, 300)
    assert (torch.arange(300) + d2t).tolist() == expected
    assert t2d.nonzero().flatten().tolist() == expected


def test_mapping_errors() -> None:
    with pytest.raises(ConfigError, match=r"draft_vocab_size must be >= 1"):
        build_vocab_mapping(COUNTS, 0)
    with pytest.raises(ConfigError, match=r"draft_vocab_size=9 exceeds the target vocab size 8"):
        build_vocab_mapping(COUNTS, 9)
    build_vocab_mapping(COUNTS, 6)  # exactly the six ids that were seen
    with pytest.raises(ConfigError, match=r"only 6 distinct token ids.*smaller `draft.vocab_size`"):
        build_vocab_mapping(COUNTS, 7)


def test_count_tokens_only_counts_masked_positions() -> None:
    ids = np.array([[1, 2, 2], [3, 2, 0]])
    mask = np.array([[1, 1, 0], [0, 1, 1]], dtype=np.uint8)
    counts = count_tokens(ids, mask, 5)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [1, 1, 2, 0, 0]
    assert torch.equal(count_tokens(torch.from_numpy(ids), torch.from_numpy(mask).bool(), 5), counts)
    # an out-of-range id is fine where the mask is off, an error where it is on
    assert count_tokens(np.array([9, 1]), np.array([0, 1]), 5).tolist() == [0, 1, 0, 0, 0]
    with pytest.raises(DataError, match=r"\[0, 5\), got range \[1, 9\]"):
        count_tokens(np.array([9, 1]), np.array([1, 1]), 5)
    with pytest.raises(DataError, match=r"6 elements but loss_mask has 5"):
        count_tokens(ids, mask.reshape(-1)[:5], 5)


def test_token_counts_file_round_trip(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"token_counts\.safetensors not found"):
        load_token_counts(tmp_path)
    save_token_counts(tmp_path, COUNTS)
    loaded = load_token_counts(tmp_path)
    assert loaded.dtype == torch.int64 and torch.equal(loaded, COUNTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token_counts.safetensors"]
