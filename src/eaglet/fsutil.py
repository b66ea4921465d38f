"""Crash-safe file writes: a reader sees either the old file or the complete new one, never a partial one;
a write that finds its disk full says so in one message."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eaglet.errors import DataError, DiskFullError

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# atomic_output writes NAME inside a folder `.NAME.tmp-PID` beside it.
_TEMPORARY = ".tmp-"


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` is a full disk (or quota): an OSError, or a library's own error carrying the OS's
    message, as safetensors' SafetensorError "... No space left on device (os error 28)" does."""
    if isinstance(error, DiskFullError):
        return True
    if isinstance(error, OSError):
        return error.errno in _DISK_FULL
    return any(f"(os error {code})" in str(error) for code in _DISK_FULL)


def free_bytes(folder: str | Path) -> int:
    return shutil.disk_usage(folder).free


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

    The temporary file sits in a hidden folder of its own beside `path`: the rename stays on one filesystem
    (atomic), and whatever the writer puts beside the file (safetensors writes a temporary of its own there)
    goes with the folder. On any error the folder is removed and `path` is left untouched; a full disk is
    raised as DiskFullError. The file gets the mode of any new file (0o666 less the umask), whoever writes it.
    """
    path = Path(path)
    folder = path.with_name(f".{path.name}{_TEMPORARY}{os.getpid()}")
    tmp = folder / path.name
    try:
        folder.mkdir(exist_ok=True)
        # Created here for its mode: safetensors' save_file puts a private (0o600) file of its own in its place.
        with open(tmp, "wb"):
            pass
        mode = tmp.stat().st_mode & 0o777
        yield tmp
        os.chmod(tmp, mode)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as error:
        shutil.rmtree(folder, ignore_errors=True)
        if is_disk_full(error) and not isinstance(error, DiskFullError):
            raise DiskFullError(
                f"no space left on device writing {path} ({human_bytes(free_bytes(path.parent))} free in "
                f"{path.parent}); free space there or choose a folder on a larger disk, then run the command again",
                path,
            ) from error
        raise
    shutil.rmtree(folder, ignore_errors=True)
    fsync_dir(path.parent)


def remove_temporaries(folder: str | Path) -> None:
    """Delete what `atomic_output` left in `folder` when its process was killed mid-write, never a final name
    (the writer's process id ends the name; a live writer's temporary is left alone)."""
    for tmp in Path(folder).glob(f".*{_TEMPORARY}*"):
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _running(int(pid)):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:  # a temporary file of an earlier version
                tmp.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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


def append_jsonl(sink: Any, records: list[dict[str, Any]]) -> None:
    """Append `records` to the binary file `sink` as JSON lines and fsync: once this returns they survive a kill."""
    sink.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))
    sink.flush()
    os.fsync(sink.fileno())


def read_appended_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file written by append_jsonl, [] if it does not exist. A last line cut by a kill is
    dropped and truncated away, so the next append starts on a line of its own.

    Lines are split on b"\\n" only: JSON escapes newlines inside strings, but text may hold other characters that
    str.splitlines() takes for line ends (U+2028, U+0085, form feed), which ensure_ascii=False writes as they are."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if len(complete) < len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(len(complete))
    records = []
    for number, line in enumerate(complete.split(b"\n"), 1):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            raise DataError(
                f"{path}, line {number}: not a JSON record ({exc}); the file was changed by hand or is damaged: "
                "delete it to write it again, or remove that line to keep the rest"
            ) from None
    return records
