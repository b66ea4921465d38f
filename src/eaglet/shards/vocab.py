"""Target-token frequencies inside the loss mask, and the draft vocabulary built from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from eaglet.errors import ConfigError, DataError
from eaglet.fsutil import atomic_write_bytes

TOKEN_COUNTS_FILE = "token_counts.safetensors"


def count_tokens(
    input_ids: np.ndarray | torch.Tensor, loss_mask: np.ndarray | torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Occurrences of each target id at loss-masked positions: int64 [vocab_size]."""
    ids = torch.as_tensor(input_ids).reshape(-1)
    mask = torch.as_tensor(loss_mask).reshape(-1)
    if ids.shape != mask.shape:
        raise DataError(f"input_ids has {ids.numel()} elements but loss_mask has {mask.numel()}")
    kept = ids[mask.to(torch.bool)].to(torch.int64)
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab_size):
        raise DataError(
            f"token ids must lie in [0, {vocab_size}), got range [{int(kept.min())}, {int(kept.max())}]; "
            "the features and the target's vocab_size disagree"
        )
    return torch.bincount(kept, minlength=vocab_size)


def save_token_counts(directory: str | Path, counts: torch.Tensor) -> None:
    atomic_write_bytes(
        Path(directory) / TOKEN_COUNTS_FILE,
        save({"counts": counts.to(torch.int64).contiguous()}, {"format": "pt"}),
    )


def load_token_counts(directory: str | Path) -> torch.Tensor:
    path = Path(directory) / TOKEN_COUNTS_FILE
    if not path.is_file():
        raise DataError(f"{path} not found; re-run the extraction command, which writes it when it completes")
    try:
        counts = load(path.read_bytes()).get("counts")
    except SafetensorError as e:
        raise DataError(f"{path}: unreadable ({e}); re-run the extraction command") from e
    if counts is None or counts.dtype != torch.int64 or counts.ndim != 1:
        raise DataError(f"{path}: expected one int64 [vocab_size] tensor named 'counts'; re-run extraction")
    return counts


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent target ids (ties: lower id first), sorted by id.

    Returns d2t int64 [V_d] with target_id = draft_id + d2t[draft_id], and t2d bool [V] marking the used ids.
    """
    vocab_size = counts.numel()
    distinct = int((counts > 0).sum())
    if draft_vocab_size < 1:
        raise ConfigError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    if draft_vocab_size > vocab_size:
        raise ConfigError(
            f"draft_vocab_size={draft_vocab_size} exceeds the target vocab size {vocab_size}; lower it"
        )
    if draft_vocab_size > distinct:
        raise ConfigError(
            f"draft_vocab_size={draft_vocab_size} but only {distinct} distinct token ids were counted in "
            "the loss mask of the training data; set a smaller `draft.vocab_size` or extract more data"
        )
    # A stable descending sort keeps equal counts in id order, so ties go to the lower id.
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    used = torch.sort(order[:draft_vocab_size]).values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d
