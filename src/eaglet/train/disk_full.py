"""What a training run says when a write finds its disk full: where, that nothing was lost, how to go on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eaglet.errors import DiskFullError
from eaglet.fsutil import is_disk_full


def disk_full(folder: Path, doing: str, last_checkpoint: Path) -> DiskFullError:
    """The message of a write that found no space (checkpoints, head and report are replaced atomically)."""
    then = (
        "run the same train.py command with ckpt_path=last added (it continues in this run's folder)"
        if last_checkpoint.is_file()
        else "run again"
    )
    return DiskFullError(
        f"no space left on the disk of {folder} while {doing}; the files already there are unchanged. "
        f"Free space on that disk, then {then}"
    )


@contextmanager
def said_if_disk_full(folder: Path, doing: str, last_checkpoint: Path) -> Iterator[None]:
    """A full disk met inside becomes `disk_full`'s message (other errors pass unchanged)."""
    try:
        yield
    except (OSError, DiskFullError) as exc:  # the atomic writer reports a full disk as DiskFullError
        if not is_disk_full(exc):
            raise
        raise disk_full(folder, doing, last_checkpoint) from None
