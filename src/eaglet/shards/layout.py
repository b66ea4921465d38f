"""The shard folder of a model x dataset: where it lives, the target head file beside the shards, and what a
token costs on disk (eaglet.shards.format writes the shards themselves)."""

from __future__ import annotations

from pathlib import Path

# The target's embedding, final norm and lm_head: training needs them, not the whole target.
TARGET_HEAD_FILE = "target_head.safetensors"


def shard_dir(
    data_dir: str | Path, model_name: str, dataset_name: str, output_dir: str | Path | None = None
) -> Path:
    """Where the shards of this model x dataset live under `data_dir`; an `output_dir` given wins."""
    if output_dir:
        return Path(output_dir)
    return Path(data_dir) / "shards" / model_name / dataset_name


def bytes_per_token(num_aux: int, hidden_size: int, itemsize: int) -> int:
    """Stored bytes of one token: aux + last hidden states, plus int32 id and uint8 mask."""
    return (num_aux + 1) * hidden_size * itemsize + 5
