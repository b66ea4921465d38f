"""A small volume that fills up: tests of what every writer does when the disk is full.

A tmpfs mount of a chosen size (root only, as on CI). Where mounting is not permitted the test is skipped
with the reason, never passed.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_volume(where: Path, size_bytes: int) -> Iterator[Path]:
    """A fresh tmpfs of `size_bytes` mounted at `where` (created), unmounted on exit."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size_bytes}-byte tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def files_under(root: Path) -> dict[str, int]:
    """Every file below `root` with its size: what a failed write left behind."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
