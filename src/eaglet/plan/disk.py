"""Disk for the shards: bytes per token of the stored features, times tokens, per stored dtype.

Per token a shard holds the aux hidden states and the last hidden state (n_aux + 1 vectors of H in the
stored dtype), an int32 input id and a uint8 loss-mask flag (eaglet.shards.format); per sequence an int64
offset and an int64 sample id. Beside the shards, target_head.safetensors keeps the target's embedding,
final norm and lm_head in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.config.schema import HardwareConfig, ModelConfig
from eaglet.errors import ConfigError
from eaglet.shards import bytes_per_token

# Bytes per element of the dtypes eaglet.shards.format.STORED_DTYPES accepts.
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
DEFAULT_NUM_AUX = 3  # aux_layer_ids null = (2, L//2, L-3)
PER_SEQUENCE_BYTES = 16
HEAD_BYTES_PER_PARAM = 2


@dataclass(frozen=True)
class DiskEstimate:
    dtype: str
    bytes_per_token: int
    shard_bytes: float
    target_head_bytes: float
    disk_bytes: float  # the hardware's disk; 0 = unknown

    @property
    def total_bytes(self) -> float:
        return self.shard_bytes + self.target_head_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.disk_bytes <= 0 else self.total_bytes <= self.disk_bytes


def num_aux(model: ModelConfig) -> int:
    return len(model.aux_layer_ids) if model.aux_layer_ids is not None else DEFAULT_NUM_AUX


def shard_bytes_per_token(model: ModelConfig, dtype: str) -> int:
    if dtype not in ITEMSIZE:
        raise ConfigError(f"unknown shard dtype '{dtype}'; choose from {sorted(ITEMSIZE)}")
    return bytes_per_token(num_aux(model), model.hidden_size, ITEMSIZE[dtype])


def target_head_bytes(model: ModelConfig) -> float:
    embeddings = 1 if model.tie_word_embeddings else 2
    return HEAD_BYTES_PER_PARAM * (embeddings * model.vocab_size + 1) * model.hidden_size


def estimate_disk(
    model: ModelConfig, hardware: HardwareConfig, dtype: str, tokens: float, conversations: int
) -> DiskEstimate:
    per_token = shard_bytes_per_token(model, dtype)
    return DiskEstimate(
        dtype=dtype,
        bytes_per_token=per_token,
        shard_bytes=per_token * tokens + PER_SEQUENCE_BYTES * conversations,
        target_head_bytes=target_head_bytes(model),
        disk_bytes=hardware.disk_tb * 1e12,
    )
