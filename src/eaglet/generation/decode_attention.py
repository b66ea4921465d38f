"""One-token decode attention over a static per-slot cache, reading each slot's keys and values up to its length.

The cache holds `capacity` columns per slot, but a slot's context is only as long as its own row: a padded
kernel (SDPA with a mask) would read the whole capacity of every slot at every step, several times the bytes
that matter when rows of very different lengths decode together. On CUDA a Triton kernel walks each
(slot, key/value head) pair's columns up to that slot's length, with the query heads of its group as the rows
of one small matrix product (grouped-query attention without repeating keys); elsewhere
`reference_decode_attention` computes the same function with plain tensor operations.
"""

from __future__ import annotations

import math

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds run the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None


def reference_decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [S, H, D], keys/values [S, KV, C, D], lengths [S] (columns 0..length-1 attended): [S, H, D]."""
    slots, heads, dim = query.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    precise = torch.promote_types(query.dtype, torch.float32)
    grouped = query.view(slots, kv_heads, heads // kv_heads, dim).to(precise)
    scores = torch.einsum("skgd,skcd->skgc", grouped, keys.to(precise)) * scale
    visible = torch.arange(capacity, device=query.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("skgc,skcd->skgd", scores.softmax(dim=-1), values.to(precise))
    return out.reshape(slots, heads, dim).to(query.dtype)


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """`reference_decode_attention`'s function; on CUDA (with Triton, a power-of-two head size) the kernel."""
    if not kernel_applies(query, keys):
        return reference_decode_attention(query, keys, values, lengths, scale)
    slots, heads, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(query)
    _decode_kernel[(slots, kv_heads)](
        query, keys, values, lengths, out,
        scale * _LOG2_E,
        query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK=_BLOCK,
        # float32 stays float32 (Triton would take its products in tf32).
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def kernel_applies(query: torch.Tensor, keys: torch.Tensor) -> bool:
    dim = query.shape[-1]
    return (
        triton is not None
        and query.is_cuda
        and dim >= 16
        and dim & (dim - 1) == 0
        and query.stride(-1) == 1
        and keys.stride(-1) == 1
    )


_LOG2_E = 1.0 / math.log(2.0)
# Columns per iteration: 64 keeps a [16, 64] score tile and two [64, D] tiles in registers for D up to 128.
_BLOCK = 64

if triton is not None:

    @triton.jit
    def _decode_kernel(
        Q, K, V, LENGTHS, OUT,
        scale_log2,
        stride_qs, stride_qh,
        stride_ks, stride_kh, stride_kc,
        stride_vs, stride_vh, stride_vc,
        stride_os, stride_oh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One (slot, key/value head): online softmax over the slot's columns, in blocks of BLOCK."""
        slot = tl.program_id(0)
        kv_head = tl.program_id(1)
        length = tl.load(LENGTHS + slot)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM)
        in_group = rows < GROUP
        heads = kv_head * GROUP + rows
        q = tl.load(
            Q + slot * stride_qs + heads[:, None] * stride_qh + dims[None, :],
            mask=in_group[:, None],
            other=0.0,
        )
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        k_base = K + slot * stride_ks + kv_head * stride_kh
        v_base = V + slot * stride_vs + kv_head * stride_vh
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            visible = cols < length
            k = tl.load(k_base + cols[:, None] * stride_kc + dims[None, :], mask=visible[:, None], other=0.0)
            scores = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2).to(tl.float32)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.exp2(scores - new_best[:, None])
            rescale = tl.exp2(best - new_best)
            v = tl.load(v_base + cols[:, None] * stride_vc + dims[None, :], mask=visible[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            total = total * rescale + tl.sum(weights, 1)
            best = new_best
        out = acc / total[:, None]
        tl.store(
            OUT + slot * stride_os + heads[:, None] * stride_oh + dims[None, :],
            out.to(OUT.dtype.element_ty),
            mask=in_group[:, None],
        )
