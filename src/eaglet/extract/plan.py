"""Deterministic assignment of sequences to shards and of shard sequences to forward batches.

The plan depends only on sequence lengths and the configured budgets, so a resumed run recomputes
exactly the same shards and batches as the run it continues (byte-identical shards).
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[range]:
    """Consecutive sample ranges of at most `shard_tokens` tokens each (one long sequence may exceed it)."""
    shards: list[range] = []
    start, tokens = 0, 0
    for i, n in enumerate(lengths):
        if tokens and tokens + n > shard_tokens:
            shards.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        shards.append(range(start, len(lengths)))
    return shards


def plan_batches(lengths: Sequence[int], indices: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Length-bucketed batches whose padded size (rows x longest) stays within `batch_tokens`."""
    order = sorted(indices, key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so the newest sequence is the longest of the batch.
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def shard_batches(
    lengths: Sequence[int], shards: Sequence[range], todo: Sequence[int], batch_tokens: int
) -> list[tuple[int, list[int]]]:
    """Every forward batch of the shards `todo` names, in that order, each beside its shard's index: one run
    of batches, so the extraction loop overlaps the last batch of a shard with the first of the next."""
    return [(index, batch) for index in todo for batch in plan_batches(lengths, shards[index], batch_tokens)]
