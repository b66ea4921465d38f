"""On-disk feature shards: the folder layout, writing, the manifest, memory-mapped reading, and the draft-vocab
mapping."""

from eaglet.shards.format import (
    STORED_DTYPES,
    SequenceFeatures,
    ShardInfo,
    dtype_name,
    shard_name,
    write_shard,
)
from eaglet.shards.layout import TARGET_HEAD_FILE, bytes_per_token, shard_dir
from eaglet.shards.manifest import MANIFEST_FILE, MANIFEST_VERSION, Manifest, read_manifest, write_manifest
from eaglet.shards.reader import ShardReader
from eaglet.shards.vocab import (
    TOKEN_COUNTS_FILE,
    build_vocab_mapping,
    count_tokens,
    load_token_counts,
    save_token_counts,
)

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_VERSION",
    "STORED_DTYPES",
    "TARGET_HEAD_FILE",
    "TOKEN_COUNTS_FILE",
    "Manifest",
    "SequenceFeatures",
    "ShardInfo",
    "ShardReader",
    "build_vocab_mapping",
    "bytes_per_token",
    "count_tokens",
    "dtype_name",
    "load_token_counts",
    "read_manifest",
    "save_token_counts",
    "shard_dir",
    "shard_name",
    "write_manifest",
    "write_shard",
]
