"""Crash-safe file writes: a reader sees either the old file or the complete new one, never a partial one."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry to disk so a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success fsync it, rename it over `path`, fsync the directory.

    The temporary name lives in the same directory so the rename is atomic (same filesystem). On any error
    the temporary file is removed and `path` is left untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON with sorted keys (stable diffs, deterministic bytes) and a trailing newline."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sha256_file(path: str | Path, chunk_size: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
