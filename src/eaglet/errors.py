"""Errors a user can act on: each says what was wrong, where, and what to do."""

from __future__ import annotations

from pathlib import Path


class EagletError(Exception):
    """Base class of every error eaglet reports to a user (printed without a traceback)."""


class ConfigError(EagletError):
    """A config value is invalid or inconsistent with the data or the machine."""


class DataError(EagletError):
    """Input data (JSONL, shards, manifests) is malformed or inconsistent."""


class DiskFullError(EagletError):
    """A write found no space left on its disk; nothing was written under the final name. `path` is the file
    it was writing, where known."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path
