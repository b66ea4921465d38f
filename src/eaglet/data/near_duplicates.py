"""Exact and near-duplicate texts: MinHash signatures of word 2-gram shingles, banded for lookup (LSH).

Two texts are near-duplicates when the Jaccard similarity of their shingle sets reaches `threshold`. The
signature bands only propose candidates (texts sharing one band of 4 hashes); each candidate is then checked
against the exact Jaccard similarity, so a pair below the threshold is never called a duplicate, and a pair
above it is missed only with small probability (below ~2% at 0.7 with 16 bands of 4).
"""

from __future__ import annotations

import re
import zlib

import numpy as np

_HASHES = 64
_BANDS = 16
_PRIME = (1 << 31) - 1
_rng = np.random.default_rng(20240601)
_A = _rng.integers(1, _PRIME, _HASHES, dtype=np.uint64)
_B = _rng.integers(0, _PRIME, _HASHES, dtype=np.uint64)


def shingles(text: str, n: int = 2) -> frozenset[str]:
    """Word n-grams of `text` (the whole text when it has fewer than n words)."""
    words = re.findall(r"\w+", text.lower())
    if len(words) < n:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))


def signature(parts: frozenset[str]) -> np.ndarray:
    """MinHash signature [_HASHES] of a shingle set: per hash function, the least (a·x + b) mod p."""
    x = np.fromiter((zlib.crc32(s.encode()) >> 1 for s in parts), dtype=np.uint64, count=len(parts))
    return ((x[None, :] * _A[:, None] + _B[:, None]) % _PRIME).min(axis=1)


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDuplicates:
    """Texts seen so far; `check` says whether a new one repeats one of them exactly or nearly."""

    def __init__(self, threshold: float) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self._exact: set[str] = set()
        self._shingles: list[frozenset[str]] = []
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(_BANDS)]
        # The shingles and band keys of the last text looked at: `add` after `check` of one text reuses them.
        self._last: tuple[str, frozenset[str], list[bytes]] | None = None

    def __len__(self) -> int:
        return len(self._exact)

    def check(self, text: str) -> str | None:
        """ "exact", "near", or None for a new text."""
        if text in self._exact:
            return "exact"
        parts, keys = self._keys(text)
        candidates = set()
        for band, key in zip(self._buckets, keys, strict=True):
            candidates.update(band.get(key, ()))
        if any(jaccard(parts, self._shingles[i]) >= self.threshold for i in candidates):
            return "near"
        return None

    def add(self, text: str) -> None:
        if text in self._exact:
            return
        self._exact.add(text)
        parts, keys = self._keys(text)
        index = len(self._shingles)
        self._shingles.append(parts)
        for band, key in zip(self._buckets, keys, strict=True):
            band.setdefault(key, []).append(index)

    def _keys(self, text: str) -> tuple[frozenset[str], list[bytes]]:
        if self._last is None or self._last[0] != text:
            parts = shingles(text)
            self._last = (text, parts, _bands(signature(parts)))
        return self._last[1], self._last[2]


def _bands(sig: np.ndarray) -> list[bytes]:
    """The signature's _BANDS consecutive slices, as bytes (dictionary keys)."""
    raw, width = sig.tobytes(), sig.nbytes // _BANDS
    return [raw[i : i + width] for i in range(0, sig.nbytes, width)]
