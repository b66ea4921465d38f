"""A KV cache for a running batch whose rows come and go (continuous batching).

Every row is right-aligned: its tokens fill the columns just before `width`, so one decode step writes one
column for all rows, and the attention mask hides each row's unused columns on the left. The buffers are
allocated with room for a window of decode steps and written in place; transformers' DynamicCache instead
concatenates, copying the whole cache at every step. The cache is rebuilt (rows dropped, new rows added,
unused left columns trimmed) only when the batch changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from eaglet.generation.gqa_attention import NAME as GQA_DECODE


class _BufferLayer(CacheLayerMixin):
    """One layer's keys and values [rows, kv_heads, capacity, head_dim]; columns [0, width) hold tokens."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        super().__init__()
        self.keys, self.values, self.width = keys, values, width
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never needed: the buffers exist from the start."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.width + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            raise RuntimeError(f"row cache overflow: {end} columns needed, {self.keys.shape[-2]} reserved")
        self.keys[:, :, self.width : end] = key_states
        self.values[:, :, self.width : end] = value_states
        self.width = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width + query_length, 0

    def get_seq_length(self) -> int:
        return self.width

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


@dataclass
class CachedRows:
    """Some rows' keys and values per layer [rows, kv_heads, columns, head_dim] and their mask [rows, columns].

    Each row's tokens are right-aligned; `rows` selects a subset (None = all).
    """

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    rows: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.mask.shape[0] if self.rows is None else self.rows.shape[0]

    @property
    def width(self) -> int:
        return self.mask.shape[1]


class RowCache:
    """The running batch's cache: a transformers `Cache` (`.hf`) over preallocated buffers, and its mask (bool)."""

    def __init__(self, layers: list[_BufferLayer], mask: torch.Tensor) -> None:
        self.layers = layers
        # True where a row has a token; columns at and after `width` are True already: every row writes one
        # there at each decode step.
        self.mask = mask
        self.hf = Cache(layers=list(layers))

    @property
    def width(self) -> int:
        return self.layers[0].width

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    def step_mask(self, attn_implementation: str | None, dtype: torch.dtype) -> torch.Tensor:
        """The attention mask of the next one-token step.

        For sdpa and eager attention it is the 4D mask [rows, 1, 1, width + 1] transformers would build from
        the 2D one; building it here skips transformers' check whether the 2D mask has padding, a device
        sync at every step that would stall the launch queue. Other attention kernels get the 2D mask.
        """
        mask = self.mask[:, : self.width + 1]
        if attn_implementation in ("sdpa", GQA_DECODE):
            return mask[:, None, None, :]
        if attn_implementation == "eager":
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            return additive.masked_fill_(~mask, torch.finfo(dtype).min)[:, None, None, :]
        return mask

    def rows(self, keep: torch.Tensor | None, width: int) -> CachedRows:
        """The last `width` columns of the rows `keep` (None = all), as a part of a new cache."""
        start, end = self.width - width, self.width
        kv = [(layer.keys[:, :, start:end], layer.values[:, :, start:end]) for layer in self.layers]
        return CachedRows(kv, self.mask[:, start:end], keep)

    @classmethod
    def assemble(cls, parts: Sequence[CachedRows], reserve: int) -> RowCache:
        """A cache of the parts' rows in order, right-aligned, with room for `reserve` more columns.

        Columns a row does not use are zeroed: a padded prompt position can hold a non-finite key or value
        (attention over nothing), and a masked-out NaN would still spread through the softmax's weighted sum.
        """
        width = max(part.width for part in parts)
        total = sum(part.count for part in parts)
        device = parts[0].mask.device
        mask = torch.zeros((total, width + reserve), dtype=torch.bool, device=device)
        mask[:, width:] = True
        layers = []
        for index in range(len(parts[0].kv)):
            keys, values = parts[0].kv[index]
            shape_k = (total, keys.shape[1], width + reserve, keys.shape[3])
            shape_v = (total, values.shape[1], width + reserve, values.shape[3])
            new_k = torch.zeros(shape_k, dtype=keys.dtype, device=device)
            new_v = torch.zeros(shape_v, dtype=values.dtype, device=device)
            first = 0
            for part in parts:
                k, v = part.kv[index]
                part_mask = part.mask
                if part.rows is not None:
                    k, v, part_mask = k[part.rows], v[part.rows], part_mask[part.rows]
                valid = part_mask.bool()[:, None, :, None]
                rows = slice(first, first + part.count)
                new_k[rows, :, width - part.width : width] = torch.where(valid, k, 0)
                new_v[rows, :, width - part.width : width] = torch.where(valid, v, 0)
                if index == 0:
                    mask[rows, width - part.width : width] = valid[:, 0, :, 0]
                first += part.count
            layers.append(_BufferLayer(new_k, new_v, width))
        return cls(layers, mask)
