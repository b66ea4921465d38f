"""Token stores: the token streams of an extraction without its hidden states, for online training.

A token store is a shard folder (manifest.json, token_counts.safetensors) whose shards hold only
  input_ids int32 [T], loss_mask uint8 [T], seq_offsets int64 [N+1], sample_ids int64 [N]
(5 bytes a token), the same tensors, sequences and shard boundaries a hidden-state extraction of the same data
writes beside its features. Its manifest's settings say `"features": "tokens"`. `TokenReader` reads the token
streams of either kind of folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from eaglet.errors import DataError
from eaglet.fsutil import atomic_output, sha256_file
from eaglet.shards.format import ShardInfo, shard_name
from eaglet.shards.manifest import Manifest, read_manifest
from eaglet.shards.reader import (
    _NUMPY,
    MappedSequences,
    _read_header,
    _read_small,
    _TensorEntry,
    require_complete,
)

TOKEN_FEATURES = "tokens"
# The bytes of one token in a token store: int32 id + uint8 loss mask.
TOKEN_BYTES_PER_TOKEN = 5
_RERUN = "re-run the extraction command (it resumes and rewrites damaged shards)"
_METADATA = {"format": "pt"}  # one key: the same bytes on every run (see eaglet.shards.format)


def token_dir(
    data_dir: str | Path, model_name: str, dataset_name: str, output_dir: str | Path | None = None
) -> Path:
    """Where the token store of this model x dataset lives under `data_dir`; an `output_dir` given wins."""
    if output_dir:
        return Path(output_dir)
    return Path(data_dir) / "tokens" / model_name / dataset_name


def is_token_store(manifest: Manifest) -> bool:
    """Whether the folder of `manifest` holds token streams only (no hidden states)."""
    return manifest.settings.get("features") == TOKEN_FEATURES


def write_token_shard(
    directory: Path,
    index: int,
    sample_ids: Sequence[int],
    input_ids: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
) -> ShardInfo:
    """Write the sequences as token shard `index` of `directory`, atomically: tensors encoded exactly as a
    feature shard encodes them (eaglet.shards.format), so both kinds of folder hold the same token streams."""
    if not sample_ids:
        raise DataError("write_token_shard got no sequences; a shard must hold at least one")
    lengths = [len(ids) for ids in input_ids]
    if any(n == 0 for n in lengths) or [len(m) for m in loss_masks] != lengths:
        raise DataError(f"sample_ids {list(sample_ids)}: every sequence needs as many mask values as tokens")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "input_ids": torch.cat([torch.as_tensor(ids).to(torch.int32) for ids in input_ids]),
        "loss_mask": torch.cat([torch.as_tensor(m).to(torch.bool).to(torch.uint8) for m in loss_masks]),
        "seq_offsets": offsets,
        "sample_ids": torch.tensor(list(sample_ids), dtype=torch.int64),
    }
    path = Path(directory) / shard_name(index)
    with atomic_output(path) as tmp:
        save_file(tensors, tmp, metadata=_METADATA)
        digest = sha256_file(tmp)
    return ShardInfo(
        file=path.name,
        num_sequences=len(lengths),
        num_tokens=int(offsets[-1]),
        num_masked=int(tensors["loss_mask"].sum()),
        bytes=path.stat().st_size,
        sha256=digest,
        first_sample=int(sample_ids[0]),
    )


def _token_layout(directory: Path, info: ShardInfo) -> tuple[Path, int, dict[str, _TensorEntry]]:
    """The data offset and token tensors of one shard (of either kind), checked against the manifest."""
    path = directory / info.file
    if not path.is_file():
        raise DataError(f"{path}: shard listed in the manifest is missing; {_RERUN}")
    size = path.stat().st_size
    if size != info.bytes:
        raise DataError(f"{path}: {size} bytes on disk, the manifest says {info.bytes}; {_RERUN}")
    data_start, header = _read_header(path, size)
    expected = {
        "input_ids": ("I32", [info.num_tokens]),
        "loss_mask": ("U8", [info.num_tokens]),
        "seq_offsets": ("I64", [info.num_sequences + 1]),
        "sample_ids": ("I64", [info.num_sequences]),
    }
    tensors = {}
    for name, (dtype, shape) in expected.items():
        raw = header.get(name)
        if not isinstance(raw, dict) or raw.get("dtype") != dtype or raw.get("shape") != shape:
            raise DataError(f"{path}: tensor {name!r} is missing or is not {dtype}{shape}; {_RERUN}")
        begin, end = raw["data_offsets"]
        if end - begin != int(np.prod(shape)) * np.dtype(_NUMPY[dtype]).itemsize or data_start + end > size:
            raise DataError(f"{path}: tensor {name!r} has inconsistent data_offsets; {_RERUN}")
        tensors[name] = _TensorEntry(dtype, shape, begin, end)
    return path, data_start, tensors


class TokenReader(MappedSequences):
    """Random access to the token streams of a complete token store or feature-shard folder, in global order.

    `sequence(i)` returns views into memory maps opened lazily per shard (and again in a forked or spawned
    process): input_ids int32 [T] and loss_mask uint8 [T]. `lengths`, `sample_ids` and `manifest` are those
    a ShardReader of the same folder has.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        require_complete(self.directory, self.manifest)
        self.shards = list(self.manifest.shards)  # the shards read, in order (as ShardReader's)
        self._layouts = [_token_layout(self.directory, info) for info in self.shards]
        offsets = [_read_small(path, start, t["seq_offsets"]) for path, start, t in self._layouts]
        ids = [_read_small(path, start, t["sample_ids"]) for path, start, t in self._layouts]
        for (path, _, _), info, o in zip(self._layouts, self.manifest.shards, offsets, strict=True):
            if o[0] != 0 or o[-1] != info.num_tokens or np.any(np.diff(o) <= 0):
                raise DataError(f"{path}: seq_offsets are not strictly increasing; {_RERUN}")
        self._index_sequences(offsets, ids)

    def _open(self, shard: int) -> dict[str, torch.Tensor]:
        path, data_start, tensors = self._layouts[shard]
        # Copy-on-write, as ShardReader maps: writable arrays, so torch.from_numpy does not warn.
        raw = np.memmap(path, dtype=np.uint8, mode="c", offset=data_start)
        opened = {
            name: torch.from_numpy(
                raw[tensors[name].begin : tensors[name].end].view(_NUMPY[tensors[name].dtype])
            )
            for name in ("input_ids", "loss_mask")
        }
        self._maps[shard] = opened
        return opened
