"""Writing one feature shard: a safetensors file of token-packed sequences (no padding).

Tensors of a shard holding N sequences of T tokens in total:
  input_ids int32 [T], loss_mask uint8 [T], aux_hidden_states [T, n_aux, H], last_hidden_state [T, H]
  (both in the stored dtype), seq_offsets int64 [N+1], sample_ids int64 [N].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eaglet.errors import ConfigError, DataError
from eaglet.fsutil import atomic_output
from eaglet.shards.streamed import write_safetensors

STORED_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# The file's metadata map.
_METADATA = {"format": "pt"}


@dataclass
class SequenceFeatures:
    """One sequence to write; tensors on CPU."""

    sample_id: int
    input_ids: torch.Tensor  # [T] integer
    loss_mask: torch.Tensor  # [T] bool or 0/1
    aux_hidden_states: torch.Tensor  # [T, n_aux, H] any float dtype, cast to the shard dtype on write
    last_hidden_state: torch.Tensor  # [T, H]


@dataclass
class ShardInfo:
    file: str
    num_sequences: int
    num_tokens: int
    num_masked: int
    bytes: int
    sha256: str
    first_sample: int


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in STORED_DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"cannot store features as {dtype}; use one of {sorted(STORED_DTYPES)}")


def _check_sequence(seq: SequenceFeatures, n_aux: int, hidden: int) -> int:
    """Validate the shapes and dtypes of one sequence; return its length."""
    where = f"sample_id {seq.sample_id}"
    if seq.input_ids.ndim != 1 or seq.input_ids.numel() == 0:
        raise DataError(
            f"{where}: input_ids must be a non-empty 1-D tensor, got shape {list(seq.input_ids.shape)}"
        )
    if seq.input_ids.dtype.is_floating_point or seq.input_ids.dtype == torch.bool:
        raise DataError(f"{where}: input_ids must be integers, got {seq.input_ids.dtype}")
    t = seq.input_ids.numel()
    if int(seq.input_ids.min()) < 0 or int(seq.input_ids.max()) > torch.iinfo(torch.int32).max:
        raise DataError(f"{where}: input_ids must lie in [0, 2**31), got a value outside it")
    expected = {
        "loss_mask": (seq.loss_mask, [t]),
        "aux_hidden_states": (seq.aux_hidden_states, [t, n_aux, hidden]),
        "last_hidden_state": (seq.last_hidden_state, [t, hidden]),
    }
    for name, (tensor, shape) in expected.items():
        if list(tensor.shape) != shape:
            raise DataError(
                f"{where}: {name} has shape {list(tensor.shape)}, expected {shape} "
                f"(T={t} tokens, n_aux={n_aux}, H={hidden} taken from the first sequence of the shard)"
            )
    for name in ("aux_hidden_states", "last_hidden_state"):
        if not getattr(seq, name).dtype.is_floating_point:
            raise DataError(f"{where}: {name} must be a float tensor, got {getattr(seq, name).dtype}")
    return t


# A float of these bits, its sign bit cleared, is inf or NaN when it is at least the threshold (all exponent bits set).
_NOT_FINITE = {
    torch.bfloat16: (np.uint16, 0x7FFF, 0x7F80),
    torch.float16: (np.uint16, 0x7FFF, 0x7C00),
    torch.float32: (np.uint32, 0x7FFFFFFF, 0x7F800000),
}


def all_finite(tensor: torch.Tensor) -> bool:
    """torch.isfinite(tensor).all() for the stored dtypes, from the bits: ~20x faster on a CPU (one integer
    max over the data where isfinite converts every element), which matters at 2 GB a shard."""
    bits, magnitude, threshold = _NOT_FINITE[tensor.dtype]
    words = tensor.contiguous().view(-1).view(torch.uint8).numpy().view(bits)
    step = 1 << 24
    return all(int((words[i : i + step] & magnitude).max()) < threshold for i in range(0, words.size, step))


def _check_finite(stored: torch.Tensor, original: torch.Tensor, sample_id: int, name: str) -> None:
    if all_finite(stored):
        return
    if bool(torch.isfinite(original).all()):
        raise DataError(
            f"sample_id {sample_id}: {name} overflows {stored.dtype} (max |x| = {original.abs().max().item():.4g}); "
            "store the features as bfloat16 or float32"
        )
    raise DataError(
        f"sample_id {sample_id}: {name} contains NaN or inf; check the target model's forward pass"
    )


def _pack(sequences: Sequence[SequenceFeatures], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if not sequences:
        raise DataError("write_shard got no sequences; a shard must hold at least one")
    first = sequences[0].aux_hidden_states
    if first.ndim != 3:
        raise DataError(
            f"sample_id {sequences[0].sample_id}: aux_hidden_states must be [T, n_aux, H], "
            f"got shape {list(first.shape)}"
        )
    n_aux, hidden = first.shape[1], first.shape[2]
    lengths = [_check_sequence(seq, n_aux, hidden) for seq in sequences]
    aux, last = [], []
    for seq in sequences:
        aux.append(seq.aux_hidden_states.to(dtype))
        last.append(seq.last_hidden_state.to(dtype))
        _check_finite(aux[-1], seq.aux_hidden_states, seq.sample_id, "aux_hidden_states")
        _check_finite(last[-1], seq.last_hidden_state, seq.sample_id, "last_hidden_state")
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return {
        "input_ids": torch.cat([seq.input_ids.to(torch.int32) for seq in sequences]),
        "loss_mask": torch.cat([seq.loss_mask.to(torch.bool).to(torch.uint8) for seq in sequences]),
        "aux_hidden_states": torch.cat(aux).contiguous(),
        "last_hidden_state": torch.cat(last).contiguous(),
        "seq_offsets": offsets,
        "sample_ids": torch.tensor([seq.sample_id for seq in sequences], dtype=torch.int64),
    }


def write_shard(
    directory: Path, index: int, sequences: Sequence[SequenceFeatures], dtype: torch.dtype
) -> ShardInfo:
    """Write `sequences` as shard `index` of `directory`, atomically; the same inputs give the same bytes."""
    dtype_name(dtype)  # rejects unsupported dtypes before any work
    tensors = _pack(sequences, dtype)
    path = Path(directory) / shard_name(index)
    with atomic_output(path) as tmp:
        digest = write_safetensors(tmp, tensors, _METADATA)
    return ShardInfo(
        file=path.name,
        num_sequences=len(sequences),
        num_tokens=int(tensors["input_ids"].numel()),
        num_masked=int(tensors["loss_mask"].sum()),
        bytes=path.stat().st_size,
        sha256=digest,
        first_sample=int(sequences[0].sample_id),
    )
