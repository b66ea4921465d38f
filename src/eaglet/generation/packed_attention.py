"""Causal attention over prompts packed end to end into one sequence, each prompt attending to itself only.

A prefill of right-padded prompts computes every padding column of every row; packed, the forward runs on the
real tokens alone. On CUDA with half-precision states torch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`) does the attention; `reference_packed_attention` computes the same
function prompt by prompt with scaled_dot_product_attention (CPU, float32, tests).
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
import torch.nn.functional as F

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch version
    varlen_attn = None


def reference_packed_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [T, H, D], keys/values [T, KV, D], `starts` [n + 1] (prompt i is tokens starts[i]..starts[i+1]-1):
    each prompt's causal attention to itself, [T, H, D]."""
    out = torch.empty_like(query)
    bounds = starts.tolist()
    gqa = keys.shape[1] != query.shape[1]
    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > begin:
            q, k, v = (t[begin:end].transpose(0, 1) for t in (query, keys, values))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            out[begin:end] = attended.transpose(0, 1)
    return out


def varlen_applies(query: torch.Tensor) -> bool:
    """Whether `packed_attention` runs torch's flash kernel for states like `query` (else the reference)."""
    return varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def packed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    longest: int,
    scale: float,
) -> torch.Tensor:
    """`reference_packed_attention`'s function; `longest` bounds every prompt's length (the kernel's grid).

    The kernel path reads nothing on the host, so a CUDA graph can capture it; `starts` is int32 there.
    """
    if not varlen_applies(query):
        return reference_packed_attention(query, keys, values, starts, scale)
    starts = starts.to(torch.int32)
    kwargs = dict(_causal_kwargs())
    if keys.shape[1] != query.shape[1]:
        if _takes_gqa():
            kwargs["enable_gqa"] = True
        else:  # grouped heads spelled out: a few MB at prefill sizes
            group = query.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    return varlen_attn(query, keys, values, starts, starts, longest, longest, scale=scale, **kwargs)


@cache
def _causal_kwargs() -> dict:
    """Causal masking as this torch's varlen_attn takes it: window_size from 2.11, is_causal in 2.10."""
    if "window_size" in inspect.signature(varlen_attn).parameters:
        return {"window_size": (-1, 0)}
    return {"is_causal": True}


@cache
def _takes_gqa() -> bool:
    return "enable_gqa" in inspect.signature(varlen_attn).parameters
