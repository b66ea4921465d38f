"""Memory-mapped random access to the sequences of an extraction directory."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglet.errors import DataError
from eaglet.fsutil import sha256_file
from eaglet.shards.format import ShardInfo
from eaglet.shards.manifest import Manifest, read_manifest

_RERUN = "re-run the extraction command (it resumes and rewrites damaged shards)"
# safetensors dtype -> numpy dtype of the mapped bytes; bfloat16 has no numpy type and is viewed from uint16.
_NUMPY = {
    "I32": np.int32,
    "U8": np.uint8,
    "I64": np.int64,
    "BF16": np.uint16,
    "F16": np.float16,
    "F32": np.float32,
}
_SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_FEATURES = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")


@dataclass
class _TensorEntry:
    dtype: str
    shape: list[int]
    begin: int  # byte offsets inside the data region
    end: int


@dataclass
class _ShardLayout:
    path: Path
    data_start: int  # byte offset of the data region in the file
    tensors: dict[str, _TensorEntry]
    seq_offsets: np.ndarray  # int64 [N+1]
    sample_ids: np.ndarray  # int64 [N]


def _read_header(path: Path, size: int) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (size,)
        if 8 + header_len > size:
            raise DataError(f"{path}: not a safetensors file (header runs past the end); {_RERUN}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: unreadable safetensors header ({e}); {_RERUN}") from e
    header.pop("__metadata__", None)
    return 8 + header_len, header


def _expected_tensors(manifest: Manifest, info: ShardInfo) -> dict[str, tuple[str, list[int]]]:
    t, n, h = info.num_tokens, info.num_sequences, manifest.hidden_size
    feature = _SAFETENSORS[manifest.dtype]
    return {
        "input_ids": ("I32", [t]),
        "loss_mask": ("U8", [t]),
        "aux_hidden_states": (feature, [t, len(manifest.aux_layer_ids), h]),
        "last_hidden_state": (feature, [t, h]),
        "seq_offsets": ("I64", [n + 1]),
        "sample_ids": ("I64", [n]),
    }


def _read_small(path: Path, start: int, entry: _TensorEntry) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(start + entry.begin)
        return np.frombuffer(f.read(entry.end - entry.begin), dtype=_NUMPY[entry.dtype]).copy()


def _load_layout(directory: Path, manifest: Manifest, info: ShardInfo, verify: bool) -> _ShardLayout:
    """Check one shard against the manifest and read its index (header, seq_offsets, sample_ids only)."""
    path = directory / info.file
    if not path.is_file():
        raise DataError(f"{path}: shard listed in the manifest is missing; {_RERUN}")
    size = path.stat().st_size
    if size != info.bytes:
        raise DataError(f"{path}: {size} bytes on disk, the manifest says {info.bytes}; {_RERUN}")
    if verify and sha256_file(path) != info.sha256:
        raise DataError(f"{path}: sha256 differs from the manifest (the file is corrupted); {_RERUN}")
    data_start, header = _read_header(path, size)
    tensors = {}
    for name, (dtype, shape) in _expected_tensors(manifest, info).items():
        raw = header.get(name)
        if not isinstance(raw, dict) or {"dtype", "shape", "data_offsets"} - raw.keys():
            raise DataError(f"{path}: tensor {name!r} is missing or malformed in the header; {_RERUN}")
        if raw["dtype"] != dtype or raw["shape"] != shape:
            raise DataError(
                f"{path}: tensor {name!r} is {raw['dtype']}{raw['shape']} but the manifest implies {dtype}{shape} "
                f"(dtype={manifest.dtype}, hidden_size={manifest.hidden_size}, "
                f"n_aux={len(manifest.aux_layer_ids)}); the shard belongs to another extraction; {_RERUN}"
            )
        begin, end = raw["data_offsets"]
        if end - begin != math.prod(shape) * np.dtype(_NUMPY[dtype]).itemsize or data_start + end > size:
            raise DataError(
                f"{path}: tensor {name!r} has inconsistent data_offsets {raw['data_offsets']}; {_RERUN}"
            )
        tensors[name] = _TensorEntry(dtype, shape, begin, end)
    offsets = _read_small(path, data_start, tensors["seq_offsets"])
    sample_ids = _read_small(path, data_start, tensors["sample_ids"])
    if offsets[0] != 0 or offsets[-1] != info.num_tokens or np.any(np.diff(offsets) <= 0):
        raise DataError(
            f"{path}: seq_offsets are not strictly increasing from 0 to {info.num_tokens}; {_RERUN}"
        )
    if info.num_sequences and sample_ids[0] != info.first_sample:
        raise DataError(
            f"{path}: first sample id {sample_ids[0]}, the manifest says {info.first_sample}; {_RERUN}"
        )
    return _ShardLayout(path, data_start, tensors, offsets, sample_ids)


class SequenceIndex:
    """Where the sequences of a list of shards lie: sequence i (counted across the shards, in order) is tokens
    [begin, end) of one shard. Built from each shard's seq_offsets [N+1] and sample_ids [N]."""

    def __init__(self, directory: Path, offsets: Sequence[np.ndarray], sample_ids: Sequence[np.ndarray]):
        self._offsets = list(offsets)
        counts = [len(ids) for ids in sample_ids]
        self._shard_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self.num_sequences = int(self._shard_starts[-1])
        self.lengths = np.concatenate([np.diff(o) for o in self._offsets] or [np.zeros(0, np.int64)])
        self.sample_ids = np.concatenate(list(sample_ids) or [np.zeros(0, np.int64)])
        if len(np.unique(self.sample_ids)) != self.num_sequences:
            raise DataError(f"{directory}: a sample id appears in more than one sequence; {_RERUN}")

    def locate(self, i: int) -> tuple[int, int, int]:
        """(shard, begin, end): the position of sequence i in the list of shards and its tokens there."""
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"sequence index {i} out of range [0, {self.num_sequences})")
        shard = int(np.searchsorted(self._shard_starts, i, side="right")) - 1
        j = i - int(self._shard_starts[shard])
        offsets = self._offsets[shard]
        return shard, int(offsets[j]), int(offsets[j + 1])


def require_complete(directory: Path, manifest: Manifest) -> None:
    """A reader of the whole folder needs a finished extraction: say so, and how to finish it."""
    if not manifest.complete:
        raise DataError(
            f"{directory}: extraction is incomplete (status {manifest.status!r}, "
            f"{len(manifest.shards)} shards written so far); re-run the same `python extract.py ...` "
            "command to finish it"
        )


class MappedSequences:
    """Random access to sequences spread over memory-mapped shards: the index over them, and maps opened lazily
    per shard (`_open`, by the subclass) so that a forked or spawned DataLoader worker maps the files itself."""

    def _index_sequences(self, offsets: Sequence[np.ndarray], sample_ids: Sequence[np.ndarray]) -> None:
        self.index = SequenceIndex(self.directory, offsets, sample_ids)
        self.num_sequences, self.lengths, self.sample_ids = (
            self.index.num_sequences, self.index.lengths, self.index.sample_ids,
        )  # fmt: skip
        self._maps: list[dict[str, torch.Tensor] | None] = [None] * len(offsets)

    def __len__(self) -> int:
        return self.num_sequences

    def __getstate__(self) -> dict[str, Any]:
        # Maps are process-local: a pickled reader (spawned DataLoader worker) reopens them on first use.
        return {**self.__dict__, "_maps": [None] * len(self._maps)}

    def release(self) -> None:
        """Drop this process's memory maps (a later read maps the file again): a deleted shard's disk is freed
        only once no map holds it."""
        self._maps = [None] * len(self._maps)

    def _open(self, shard: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def sequence(self, i: int) -> dict[str, torch.Tensor]:
        shard, begin, end = self.index.locate(i)
        tensors = self._maps[shard] or self._open(shard)
        return {name: tensor[begin:end] for name, tensor in tensors.items()}


class ShardReader(MappedSequences):
    """Random access to the sequences of a complete extraction, in global order; or, given `shards`, to those of
    the listed shards (in that order) of a folder still being written (`manifest`: a snapshot of its manifest
    recording them; read from the folder when not given).

    Shards are memory-mapped lazily, on the first read of one of their sequences, so DataLoader workers
    forked after construction map the files themselves. `sequence(i)` returns views into the map:
    input_ids int32 [T], loss_mask uint8 [T] (0/1), aux_hidden_states [T, n_aux, H] and
    last_hidden_state [T, H] in the stored dtype.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        verify: bool = False,
        shards: Sequence[int] | None = None,
        manifest: Manifest | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.manifest = manifest or read_manifest(self.directory)
        if shards is None:
            require_complete(self.directory, self.manifest)
        recorded = self.manifest.shards
        unrecorded = [index for index in shards or () if not 0 <= index < len(recorded)]
        if unrecorded:
            raise DataError(
                f"{self.directory}: shards {unrecorded} are not recorded in its manifest (it records "
                f"{len(recorded)}); extraction has not written them yet"
            )
        # The shards read, in order.
        self.shards = list(recorded) if shards is None else [recorded[index] for index in shards]
        self._layouts = [_load_layout(self.directory, self.manifest, s, verify) for s in self.shards]
        self._index_sequences([x.seq_offsets for x in self._layouts], [x.sample_ids for x in self._layouts])

    def _open(self, shard: int) -> dict[str, torch.Tensor]:
        layout = self._layouts[shard]
        # Copy-on-write mapping: pages are shared with the page cache until written, and the arrays are
        # writable, so torch.from_numpy does not warn about read-only memory.
        raw = np.memmap(layout.path, dtype=np.uint8, mode="c", offset=layout.data_start)
        tensors = {}
        for name in _FEATURES:
            entry = layout.tensors[name]
            array = raw[entry.begin : entry.end].view(_NUMPY[entry.dtype]).reshape(entry.shape)
            tensor = torch.from_numpy(array)
            tensors[name] = tensor.view(torch.bfloat16) if entry.dtype == "BF16" else tensor
        self._maps[shard] = tensors
        return tensors
