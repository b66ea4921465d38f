"""Packing variable-length sequences into micro-batches of a fixed token budget, and building one packed row.

A micro-batch is one row of exactly `tokens_per_batch` tokens holding whole documents back to back, then
padding; static shapes let the draft head compile once. Attention stays inside a document through
`document_ids`, and `position_ids` restart at 0 in each document.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from eaglet.errors import ConfigError


def _epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The random stream of one (seed, epoch); any integer seed is accepted, negative ones included."""
    return np.random.default_rng([seed % 2**64, epoch])


def _check_budget(tokens_per_batch: int) -> None:
    if tokens_per_batch < 1:
        raise ConfigError(f"tokens_per_batch must be a positive number of tokens, got {tokens_per_batch}")


def pack_sequences(
    lengths: np.ndarray,
    indices: np.ndarray | Sequence[int],
    tokens_per_batch: int,
    seed: int,
    epoch: int,
    *,
    shuffle: bool = True,
) -> list[list[int]]:
    """Pack the sequences `indices` (into `lengths`) into bins of at most `tokens_per_batch` tokens.

    Best-fit decreasing: longest sequence first, each into the open bin it fills most tightly. A sequence
    longer than the budget counts as `tokens_per_batch` tokens (it is truncated when collated) and fills a
    bin alone. With `shuffle`, ties between equal lengths are broken and the order of the bins is drawn from
    (seed, epoch): the bin contents vary between epochs while their number stays the same (equal-length
    sequences are interchangeable). Without it (validation) the result depends on the lengths only.
    """
    _check_budget(tokens_per_batch)
    indices = np.asarray(indices, dtype=np.int64)
    sizes = np.minimum(np.asarray(lengths, dtype=np.int64)[indices], tokens_per_batch)
    rng = _epoch_rng(seed, epoch)
    tie_break = rng.random(len(indices)) if shuffle else np.arange(len(indices))
    order = np.lexsort((tie_break, -sizes))

    bins: list[list[int]] = []
    open_caps: list[int] = []  # sorted distinct remaining capacities that some open bin has
    bins_by_cap: dict[int, list[int]] = {}
    for index, size in zip(indices[order].tolist(), sizes[order].tolist(), strict=True):
        k = bisect_left(open_caps, size)
        if k == len(open_caps):
            target, left = len(bins), tokens_per_batch - size
            bins.append([index])
        else:
            cap = open_caps[k]
            target, left = bins_by_cap[cap].pop(), cap - size
            if not bins_by_cap[cap]:
                del open_caps[k], bins_by_cap[cap]
            bins[target].append(index)
        if left > 0:
            if left not in bins_by_cap:
                bins_by_cap[left] = []
                insort(open_caps, left)
            bins_by_cap[left].append(target)

    if shuffle:
        bins = [bins[i] for i in rng.permutation(len(bins))]
    return bins


def count_truncated(lengths: np.ndarray, indices: np.ndarray | Sequence[int], tokens_per_batch: int) -> int:
    """How many of the sequences `indices` are longer than `tokens_per_batch` (and lose their tail)."""
    return int(np.count_nonzero(np.asarray(lengths)[np.asarray(indices, dtype=np.int64)] > tokens_per_batch))


def packing_efficiency(lengths: np.ndarray, bins: Sequence[Sequence[int]], tokens_per_batch: int) -> float:
    """Real tokens / (bins * budget): the share of the micro-batch tokens that are not padding."""
    if not bins:
        return 0.0
    members = np.fromiter((i for b in bins for i in b), dtype=np.int64)
    real = int(np.minimum(np.asarray(lengths)[members], tokens_per_batch).sum())
    return real / (len(bins) * tokens_per_batch)


# Byte alignment of each tensor inside a packed row's single allocation (a cache line; int64 needs 8).
_ALIGN = 64
# Integer views of the stored float dtypes: rows are copied as raw bits.
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _allocate(nbytes: int, *, pin_memory: bool, shared: bool) -> torch.Tensor:
    if shared:
        # The storage DataLoader's own collate allocates in workers: created shared, nothing to move later.
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)


def _token_layout(t: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {
        "input_ids": ((t,), torch.long),
        "loss_mask": ((t,), torch.bool),
        "document_ids": ((t,), torch.long),
        "position_ids": ((t,), torch.long),
    }


def _allocate_layout(
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]], *, pin_memory: bool, shared: bool
) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of `layout` ({name: (shape, dtype)}), all views of one allocation."""
    begins, size = [], 0
    for shape, dtype in layout.values():
        begins.append(size)
        size += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    flat = _allocate(size, pin_memory=pin_memory, shared=shared)
    return {
        name: flat[begin : begin + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for (name, (shape, dtype)), begin in zip(layout.items(), begins, strict=True)
    }


def packed_buffers(
    tokens_per_batch: int,
    n_aux: int,
    hidden: int,
    feature_dtype: torch.dtype,
    *,
    pin_memory: bool = False,
    shared: bool = False,
) -> dict[str, torch.Tensor]:
    """Uninitialised outputs of one packed row (see `collate_packed`), all views of one allocation.

    One allocation is pinned, or placed in shared memory, in one go: a worker process hands a shared row to
    the main process without copying it, and torch's caching host allocator reuses a freed pinned row whole.
    """
    t = tokens_per_batch
    layout = {
        **_token_layout(t),
        "aux_hidden_states": ((t, n_aux * hidden), feature_dtype),
        "last_hidden_state": ((t, hidden), feature_dtype),
        "num_real_tokens": ((), torch.long),
    }
    return _allocate_layout(layout, pin_memory=pin_memory, shared=shared)


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.view(_BITS[x.dtype]).numpy()


# Features are copied and zeroed as raw bits by numpy: on one core and without the GIL, so that loader threads
# neither hold up the training thread nor start a team of intra-op threads each.
def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dtype == src.dtype and dst.dtype in _BITS:
        np.copyto(_bits(dst), _bits(src))
    else:
        dst.copy_(src)  # converts dtype while copying: each mapped byte is read once, nothing is staged


def _zero_rows(x: torch.Tensor) -> None:
    if x.dtype in _BITS:
        _bits(x).fill(0)
    else:
        x.zero_()


def collate_packed(
    sequences: Sequence[Mapping[str, torch.Tensor]],
    tokens_per_batch: int,
    feature_dtype: torch.dtype | None = None,
    *,
    pin_memory: bool = False,
    shared: bool = False,
) -> dict[str, torch.Tensor]:
    """Concatenate `sequences` (as returned by `ShardReader.sequence`) into one row of `tokens_per_batch` tokens.

    Returns input_ids long [T], loss_mask bool [T], document_ids long [T] (0, 1, ... per sequence; the
    padding is one more document after the last), position_ids long [T] (restarting at 0 per document),
    aux_hidden_states [T, n_aux*H] (the n_aux states side by side, in manifest order), last_hidden_state
    [T, H], num_real_tokens long []. Features are read from the memory maps once, straight into the output
    (converted to `feature_dtype`, default the stored dtype); padding is zero everywhere. The output is one
    allocation (see `packed_buffers`), pinned or in shared memory on request.
    """
    _check_budget(tokens_per_batch)
    if not sequences:
        raise ValueError("collate_packed needs at least one sequence")
    sizes = [min(len(seq["input_ids"]), tokens_per_batch) for seq in sequences]
    if sum(sizes) > tokens_per_batch:
        raise ValueError(f"sequences of {sizes} tokens do not fit in tokens_per_batch={tokens_per_batch}")
    t = tokens_per_batch
    _, n_aux, hidden = sequences[0]["aux_hidden_states"].shape
    dtype = feature_dtype or sequences[0]["aux_hidden_states"].dtype
    out = packed_buffers(t, n_aux, hidden, dtype, pin_memory=pin_memory, shared=shared)
    aux = out["aux_hidden_states"].view(t, n_aux, hidden)
    begin = 0
    for seq, size in zip(sequences, sizes, strict=True):
        _copy_rows(aux[begin : begin + size], seq["aux_hidden_states"][:size])
        _copy_rows(out["last_hidden_state"][begin : begin + size], seq["last_hidden_state"][:size])
        begin += size
    _zero_rows(out["aux_hidden_states"][begin:])
    _zero_rows(out["last_hidden_state"][begin:])
    _fill_tokens(out, sequences, sizes)
    return out


def _fill_tokens(
    out: dict[str, torch.Tensor], sequences: Sequence[Mapping[str, torch.Tensor]], sizes: Sequence[int]
) -> int:
    """Fill a packed row's input_ids, loss_mask, document_ids, position_ids and num_real_tokens (the layout
    `collate_packed` documents); returns the real tokens."""
    t = out["input_ids"].shape[0]
    ramp = torch.arange(t)
    begin = 0
    for doc, (seq, size) in enumerate(zip(sequences, sizes, strict=True)):
        end = begin + size
        out["input_ids"][begin:end].copy_(seq["input_ids"][:size])
        out["loss_mask"][begin:end].copy_(seq["loss_mask"][:size])
        out["document_ids"][begin:end] = doc
        out["position_ids"][begin:end] = ramp[:size]
        begin = end
    out["input_ids"][begin:] = 0
    out["loss_mask"][begin:] = False
    out["document_ids"][begin:] = len(sequences)
    out["position_ids"][begin:] = ramp[: t - begin]
    out["num_real_tokens"].fill_(begin)
    return begin


def collate_tokens(
    sequences: Sequence[Mapping[str, torch.Tensor]],
    tokens_per_batch: int,
    *,
    pin_memory: bool = False,
    shared: bool = False,
) -> dict[str, torch.Tensor]:
    """One packed row of token streams only (as returned by `TokenReader.sequence`): the token fields of
    `collate_packed`, plus cu_seqlens int32 [D+1], the documents' boundaries (the padding, when any, is the
    last document), for the target's packed forward (eaglet.target_model.packed_attention)."""
    _check_budget(tokens_per_batch)
    if not sequences:
        raise ValueError("collate_tokens needs at least one sequence")
    sizes = [min(len(seq["input_ids"]), tokens_per_batch) for seq in sequences]
    if sum(sizes) > tokens_per_batch:
        raise ValueError(f"sequences of {sizes} tokens do not fit in tokens_per_batch={tokens_per_batch}")
    documents = len(sizes) + (sum(sizes) < tokens_per_batch)
    layout = {
        **_token_layout(tokens_per_batch),
        "cu_seqlens": ((documents + 1,), torch.int32),
        "num_real_tokens": ((), torch.long),
    }
    out = _allocate_layout(layout, pin_memory=pin_memory, shared=shared)
    _fill_tokens(out, sequences, sizes)
    out["cu_seqlens"][0] = 0
    out["cu_seqlens"][1 : len(sizes) + 1] = torch.tensor(sizes).cumsum(0)
    out["cu_seqlens"][-1] = tokens_per_batch
    return out
