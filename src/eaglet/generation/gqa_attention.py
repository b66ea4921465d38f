"""One-token decode attention for grouped-query models, reading each cached key and value once.

With an attention mask (continuous batching always has one: rows start at different columns), transformers'
SDPA path on CUDA copies every key and value `num_key_value_groups` times per step (`repeat_kv`) before the
kernel: for a 512-row batch that copy, not the model, was most of each decode step. Here the query heads of a
group are laid side by side instead, so one batched matmul per layer reads the cache as it is. Prompts
(queries longer than one token) go to transformers' SDPA function unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
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
    scale = dim**-0.5 if scaling is None else scaling
    # Head h uses key head h // groups, as repeat_kv lays them out.
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2))  # [B, KV, G, W]
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale  # softmax in fp32 at least
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, KV, G, D]
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
