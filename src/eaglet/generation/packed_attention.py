"""Causal attention over prompts packed end to end into one sequence, each prompt attending to itself only.

A prefill of right-padded prompts computes every padding column of every row; packed, the forward runs on the
real tokens alone. The kernels are those of online training's packed rows (eaglet.target_model.packed_attention):
on CUDA with half-precision states torch's variable-length flash attention, which reads the boundaries on the
device (a CUDA graph can capture it); elsewhere scaled_dot_product_attention prompt by prompt
(`reference_packed_attention`: CPU, float32, tests).
"""

from __future__ import annotations

import torch

from eaglet.target_model.packed_attention import causal_varlen, per_document_attention, varlen_applies


def reference_packed_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [T, H, D], keys/values [T, KV, D], `starts` [n + 1] (prompt i is tokens starts[i]..starts[i+1]-1):
    each prompt's causal attention to itself, [T, H, D]."""
    heads_first = (t.transpose(0, 1)[None] for t in (query, keys, values))
    return per_document_attention(*heads_first, starts.tolist(), scale)[0]


def kernel_applies(query: torch.Tensor) -> bool:
    """Whether `packed_attention` runs the variable-length kernel for queries like `query` [T, H, D]."""
    return varlen_applies(query.device, query.dtype, query.shape[-1])


def packed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    longest: int,
    scale: float,
) -> torch.Tensor:
    """`reference_packed_attention`'s function; `longest` bounds every prompt's length (the kernel's grid)."""
    if not kernel_applies(query):
        return reference_packed_attention(query, keys, values, starts, scale)
    return causal_varlen(query, keys, values, starts.to(torch.int32), longest, scale)
