"""manifest.json: what an extraction directory holds, how it was made and whether it is complete."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglet.errors import DataError
from eaglet.fsutil import atomic_write_json
from eaglet.shards.format import STORED_DTYPES, ShardInfo

MANIFEST_VERSION = 1
MANIFEST_FILE = "manifest.json"
STATUSES = ("in_progress", "complete")
_EXTRACT_HINT = "run `python extract.py ...` first"


@dataclass
class Manifest:
    version: int
    status: str  # "in_progress" | "complete"
    # {name, architecture, config_hash, tokenizer_hash, chat_template_hash, num_layers, hidden_size, vocab_size}
    target: dict[str, Any]
    aux_layer_ids: list[int]  # residual stream entering each of these layers, in this order
    last_layer_id: int  # = num_layers
    last_hidden_pre_norm: bool  # last_hidden_state is the last layer's output before the final norm
    hidden_size: int
    vocab_size: int
    dtype: str  # a key of STORED_DTYPES
    inputs_fingerprint: str  # hash of everything that determines the shard contents
    settings: dict[str, Any] = field(default_factory=dict)
    shards: list[ShardInfo] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)
    token_counts_file: str | None = None

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any], path: str | Path) -> Manifest:
        """Build a manifest from its JSON form; DataError naming `path` when it is malformed."""
        if not isinstance(d, dict):
            raise DataError(f"{path}: expected a JSON object, got {type(d).__name__}")
        if d.get("version") != MANIFEST_VERSION:
            raise DataError(
                f"{path}: manifest version {d.get('version')!r} is not supported (this eaglet reads version "
                f"{MANIFEST_VERSION}); re-run extraction into a new directory"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise DataError(
                f"{path}: missing keys {missing}; the file is damaged or was not written by eaglet"
            )
        if d["status"] not in STATUSES:
            raise DataError(f"{path}: status {d['status']!r} is not one of {list(STATUSES)}")
        if d["dtype"] not in STORED_DTYPES:
            raise DataError(f"{path}: dtype {d['dtype']!r} is not one of {sorted(STORED_DTYPES)}")
        shard_keys = [f.name for f in dataclasses.fields(ShardInfo)]
        shards = []
        for i, entry in enumerate(d["shards"]):
            if not isinstance(entry, dict) or sorted(entry) != sorted(shard_keys):
                raise DataError(f"{path}: shards[{i}] must have exactly the keys {shard_keys}, got {entry!r}")
            shards.append(ShardInfo(**entry))
        return cls(**{**{n: d[n] for n in names}, "shards": shards})


def read_manifest(directory: str | Path) -> Manifest:
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"feature directory {directory} does not exist; {_EXTRACT_HINT}")
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise DataError(f"{path} not found: {directory} holds no extracted features; {_EXTRACT_HINT}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg}); re-run extraction") from e
    return Manifest.from_json(data, path)


def write_manifest(directory: str | Path, manifest: Manifest) -> None:
    atomic_write_json(Path(directory) / MANIFEST_FILE, manifest.to_json())
