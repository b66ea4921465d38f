"""One-token decode attention for grouped-query models, reading each cached key and value once.

With an attention mask (continuous batching always has one: rows start at different columns), transformers'
SDPA path on CUDA copies every key and value `num_key_value_groups` times per step (`repeat_kv`) before the
kernel, moving several times the whole cache through memory at every step. Here the query heads of a
group become query positions of their key/value head instead, so SDPA reads the cache as it is. Prompts
(queries longer than one token) go to transformers' SDPA function unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "eaglet_gqa_decode"


def gqa_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query [B, H, 1, D], key/value [B, KV, W, D], attention_mask [B, 1, 1, W] (bool or additive)."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or heads % kv_heads or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # The query heads sharing a key/value head become that head's query positions: one SDPA call attends
    # over the cache as stored, with the row's mask broadcast over heads and positions.
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)  # [B, KV, G, D]
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


AttentionInterface.register(NAME, gqa_decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # prompts get the masks SDPA gets


@contextmanager
def gqa_decode(model: torch.nn.Module) -> Iterator[str | None]:
    """Within the block, a model that runs SDPA decodes with `gqa_decode_attention`; yields the name in use."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    current = getattr(config, "_attn_implementation", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if current != "sdpa" or not heads or heads == kv_heads:
        yield current
        return
    config._attn_implementation = NAME
    try:
        yield NAME
    finally:
        config._attn_implementation = current
