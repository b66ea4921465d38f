"""A safetensors file written straight from the tensors' memory, hashed as it is written.

safetensors' own `save_file` copies every tensor into a bytes object before it writes, and the shard's checksum
then read the file back: for a 2.1 GB shard of an 8B target, two extra passes over the features on a writer
thread, which decide how long extraction's last shards take after the last forward. Here each tensor's bytes go
to the file and the digest from one view of its memory, chunk by chunk (file writes and hashing release the GIL).
The layout is the format's (an 8-byte little-endian header size, a JSON header padded with spaces to 8 bytes,
the tensors' bytes back to back): the same bytes as `save_file` writes for the same tensors (tested).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

# Name in the header, in safetensors' order of storage (its dtype enum, descending): wider elements first.
_DTYPES = {
    torch.int64: "I64",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint8: "U8",
}
_RANK = {dtype: rank for rank, dtype in enumerate(_DTYPES)}
_CHUNK = 64 << 20


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write `tensors` (CPU, contiguous) to `path`; the file's sha256 (hex). Stored in safetensors' order (by
    dtype, wider elements first, then by name): every tensor starts at a multiple of its element size."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    names = sorted(tensors, key=lambda name: (_RANK.get(tensors[name].dtype, -1), name))
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in _DTYPES or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous CPU tensor of {list(_DTYPES)}, got {tensor.dtype}"
            )
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (len(encoded).to_bytes(8, "little"), encoded):
            f.write(part)
            digest.update(part)
        for name in names:
            data = memoryview(tensors[name].view(-1).view(torch.uint8).numpy())
            for start in range(0, len(data), _CHUNK):
                chunk = data[start : start + _CHUNK]
                f.write(chunk)
                digest.update(chunk)
    return digest.hexdigest()
