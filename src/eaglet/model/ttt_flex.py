"""TTT attention on the GPU: one block-sparse flex_attention call per step, the diagonal merged by log-sum-exp.

Query row i (at position p_i of a packed row) of TTT step k attends over the step-0 keys s <= p_i of its own
document (the context) and over its own keys of steps 1..k (the diagonal; see `eaglet.model.attention`).

- Context: `flex_attention` with a `BlockMask` built here at block level from the segment ids, so only the
  key blocks a query block may see are visited (a packed 8192-token row of 2048-token documents touches
  about 1/8 of the dense [T, T] scores). Every step uses the same keys (step 0's) and the same mask, so no
  key tensor is concatenated or copied per step. Queries may be any sorted subset of the positions (training
  runs only the positions some loss depends on).
- Diagonal: k extra scores per query, combined with the context output through its log-sum-exp, exactly:
  out = (e^lse * out_ctx + sum_j e^s_j v_j) / (e^lse + sum_j e^s_j). Gradients flow through flex's output and
  its lse (supported by flex_attention since torch 2.5, pytorch/pytorch#133159).

flex_attention runs compiled on CUDA (eager it falls back to dense math); on CPU it has no backward, so CPU
training keeps the tiled SDPA path of `eaglet.model.attention`, and tests compare the two there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from eaglet.errors import ConfigError

try:  # torch >= 2.9 asks for the lse through return_aux; return_lse is deprecated there
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None

KV = tuple[Tensor, Tensor]
BLOCK = 128  # flex_attention's default sparse block, for queries and keys
# flex_attention's Triton kernels (compiled, on CUDA) multiply through tl.dot, which needs an embedding of at
# least 16: inductor refuses smaller heads (pytorch/pytorch#147765, triton-lang/triton#2266). Head sizes that
# are not a power of two are rounded up inside the kernel (QK_HEAD_DIM_ROUNDED; torch 2.6 still refused them,
# torch 2.13 does not), and any sequence length works: queries and keys are padded to whole blocks here.
MIN_CUDA_HEAD_DIM = 16


def flex_unsupported(head_dim: int, device: torch.device) -> str | None:
    """Why the flex path cannot run heads of `head_dim` on `device`; None when it can."""
    if device.type == "cuda" and head_dim < MIN_CUDA_HEAD_DIM:
        return f"flex_attention's CUDA kernels need head_dim >= {MIN_CUDA_HEAD_DIM}, the draft head has {head_dim}"
    return None


@dataclass(frozen=True)
class ContextLayout:
    """Queries `rows` of a packed row over its step-0 keys, padded to whole blocks.

    Padding keys get segment -1 (no query sees them); padding queries repeat the last row (they see what it
    sees, so no row is empty, and their outputs are dropped).
    """

    num_rows: int
    num_keys: int
    key_segments: Tensor  # [Tp]
    query_positions: Tensor  # [Mp]
    query_segments: Tensor  # [Mp]

    @property
    def padded_rows(self) -> int:
        return self.query_positions.shape[0]

    @property
    def padded_keys(self) -> int:
        return self.key_segments.shape[0]


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def context_layout(segments: Tensor, rows: Tensor, block: int = BLOCK) -> ContextLayout:
    """The layout of queries at positions `rows` (sorted, non-empty) over keys with segment ids `segments`.

    segments: int [T], non-decreasing along the row (one value per document, as `ttt_forward` builds them).
    """
    t, m = segments.shape[0], rows.shape[0]
    if m == 0:
        raise ValueError("context_layout needs at least one query row")
    key_segments = F.pad(segments, (0, _round_up(t, block) - t), value=-1)
    query_positions = torch.cat([rows, rows[-1:].expand(_round_up(m, block) - m)])
    return ContextLayout(m, t, key_segments, query_positions, segments[query_positions])


def context_mask_mod(layout: ContextLayout) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """flex mask_mod: query row q may see key kv iff same document and kv <= its position."""
    key_segments, positions, segments = layout.key_segments, layout.query_positions, layout.query_segments

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (key_segments[kv] == segments[q]) & (kv <= positions[q])

    return mask_mod


def _document_starts(segments: Tensor) -> Tensor:
    """int64 [T]: the position where each position's document begins."""
    t = segments.shape[0]
    ramp = torch.arange(t, device=segments.device)
    begins = torch.ones(t, dtype=torch.bool, device=segments.device)
    begins[1:] = segments[1:] != segments[:-1]
    return torch.where(begins, ramp, 0).cummax(0).values


def context_block_mask(layout: ContextLayout, segments: Tensor, block: int = BLOCK) -> BlockMask:
    """The BlockMask of `context_mask_mod`, built from block-level bounds (no [rows, keys] tensor).

    A query block may see key blocks from the start of its first row's document up to its last row: those
    are visited (conservatively: mask_mod decides inside them). A key block is full (mask_mod skipped) when
    every row of the query block lies in one document that contains the whole key block, at or before the
    block's first row.
    """
    starts = _document_starts(segments)
    first = layout.query_positions[::block]  # rows are sorted: the smallest position of each query block
    last = layout.query_positions[block - 1 :: block]
    key_blocks = torch.arange(layout.padded_keys // block, device=segments.device)[None, :]
    lo = (starts[first] // block)[:, None]
    visible = (key_blocks >= lo) & (key_blocks <= (last // block)[:, None])
    one_document = (layout.query_segments[::block] == layout.query_segments[block - 1 :: block])[:, None]
    full_lo = (-(-starts[first] // block))[:, None]
    full_hi = ((first + 1) // block - 1)[:, None]
    full = one_document & (key_blocks >= full_lo) & (key_blocks <= full_hi)
    partial = visible & ~full

    def ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
        # The selected block indices first in each query block's row, as BlockMask expects.
        indices = torch.sort(blocks.to(torch.int32), dim=1, descending=True, stable=True).indices
        return blocks.sum(1).to(torch.int32)[None, None], indices.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=block, mask_mod=context_mask_mod(layout)
    )


class _MergeDiagonal(torch.autograd.Function):
    """out_final = a_0 out + sum_j a_j v_j, a = softmax over [lse, s_1..s_k], s_j = scale q.k_j (per row, head).

    Written out (forward and backward) so that only references to its inputs and the weights a [k+1, M, heads]
    are kept for the backward: traced by autograd, the float32 copies of q, k_j, v_j and out would be.
    """

    @staticmethod
    def forward(ctx: Any, scale: float, out: Tensor, lse: Tensor, q: Tensor, *diagonal: Tensor) -> Tensor:
        m, heads, d = q.shape
        kv_heads = diagonal[0].shape[1]
        acc = torch.promote_types(out.dtype, torch.float32)
        # Autocast would run the score einsums in bf16; the backward (outside autocast) is float32 too.
        with torch.autocast(q.device.type, enabled=False):
            grouped = q.to(acc).view(m, kv_heads, heads // kv_heads, d)
            scores = [
                torch.einsum("mkgd,mkd->mkg", grouped, k.to(acc)).reshape(m, heads) * scale
                for k in diagonal[::2]
            ]
            weights = torch.softmax(torch.stack([lse.to(acc), *scores]), dim=0)  # [k+1, M, heads]
            merged = weights[0, ..., None] * out.to(acc)
            for a, v in zip(weights[1:], diagonal[1::2], strict=True):
                merged += (a.view(m, kv_heads, -1, 1) * v.to(acc)[:, :, None, :]).reshape(m, heads, d)
        ctx.scale, ctx.lse_dtype = scale, lse.dtype
        ctx.save_for_backward(out, q, weights, *diagonal)
        return merged.to(out.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out, q, weights, *diagonal = ctx.saved_tensors
        m, heads, d = q.shape
        kv_heads = diagonal[0].shape[1]
        acc = weights.dtype
        g = grad.to(acc)
        grouped_g = g.view(m, kv_heads, heads // kv_heads, d)
        # d loss / d a_i = <g, x_i> (x_0 = out, x_j = v_j); softmax: d z_i = a_i (d a_i - sum_l a_l d a_l).
        d_weights = [(g * out.to(acc)).sum(-1)]
        d_weights += [
            torch.einsum("mkgd,mkd->mkg", grouped_g, v.to(acc)).reshape(m, heads) for v in diagonal[1::2]
        ]
        d_weights = torch.stack(d_weights)
        d_scores = weights * (d_weights - (weights * d_weights).sum(0, keepdim=True))
        grad_q = torch.zeros(m, kv_heads, heads // kv_heads, d, dtype=acc, device=q.device)
        grouped_q = q.to(acc).view(m, kv_heads, heads // kv_heads, d)
        grad_diagonal = []
        for j, (k, v) in enumerate(zip(diagonal[::2], diagonal[1::2], strict=True)):
            a = weights[j + 1].view(m, kv_heads, -1)
            dz = d_scores[j + 1].view(m, kv_heads, -1) * ctx.scale
            grad_q += dz[..., None] * k.to(acc)[:, :, None, :]
            grad_diagonal.append(torch.einsum("mkg,mkgd->mkd", dz, grouped_q).to(k.dtype))
            grad_diagonal.append(torch.einsum("mkg,mkgd->mkd", a, grouped_g).to(v.dtype))
        grad_out = (weights[0, ..., None] * g).to(out.dtype)
        return (
            None,
            grad_out,
            d_scores[0].to(ctx.lse_dtype),
            grad_q.view(m, heads, d).to(q.dtype),
            *grad_diagonal,
        )


def merge_diagonal(out: Tensor, lse: Tensor, q: Tensor, diagonal_kv: Sequence[KV], scale: float) -> Tensor:
    """Add the diagonal keys to a context attention result, as if all were in one softmax.

    out [M, heads, d] and lse [M, heads] (natural log) are the context attention of q [M, heads, d];
    diagonal_kv: per step j, (k_j, v_j) [M, kv_heads, d], key j of row i at [i]. Computed in float32 (or wider).
    """
    if not diagonal_kv:
        return out
    if out.requires_grad and not lse.requires_grad:
        raise RuntimeError(
            "the context attention returned an lse without gradient: this torch's flex_attention cannot "
            "differentiate through its lse; train with attention=sdpa"
        )
    return _MergeDiagonal.apply(scale, out, lse, q, *(x for kv in diagonal_kv for x in kv))


@cache
def _compiled_flex() -> Callable[..., tuple[Tensor, Tensor]]:
    # Compiled once per process; shapes vary per row (number of query rows): automatic dynamic shapes.
    return torch.compile(flex_attention)


def _flex_with_lse(
    q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float, compiled: bool
) -> tuple[Tensor, Tensor]:
    """flex_attention's output [1, heads, M, d] and its lse [1, heads, M] (natural log)."""
    if not q.is_cuda and torch.is_grad_enabled() and q.requires_grad:
        raise ConfigError(
            "attention=flex has no backward on CPU (flex_attention); train with attention=auto or sdpa there"
        )
    fn = _compiled_flex() if compiled else flex_attention
    gqa = q.shape[1] != k.shape[1]
    if AuxRequest is None:
        return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)
    out, aux = fn(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    return out, aux.lse


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))


class FlexTTTAttention:
    """TTT attention of query rows `rows` of one packed row; built once per row, called once per step."""

    def __init__(self, segments: Tensor, rows: Tensor, *, compiled: bool | None = None) -> None:
        self.layout = context_layout(segments, rows)
        self.block_mask = context_block_mask(self.layout, segments)
        self.compiled = segments.is_cuda if compiled is None else compiled
        self._context: tuple[Tensor, Tensor, Tensor] | None = None  # (step-0 keys, keys and values for flex)

    def _flex_context(self, context_kv: KV) -> tuple[Tensor, Tensor]:
        """The step-0 keys and values as flex takes them ([1, kv_heads, Tp, d]), prepared once per row."""
        if self._context is None or self._context[0] is not context_kv[0]:
            k, v = (_pad_rows(x, self.layout.padded_keys).transpose(0, 1)[None] for x in context_kv)
            self._context = (context_kv[0], k, v)
        return self._context[1], self._context[2]

    def __call__(self, q: Tensor, context_kv: KV, diagonal_kv: Sequence[KV], scale: float) -> Tensor:
        """q [M, heads, d] of the rows; context_kv [T, kv_heads, d] of step 0; returns [M, heads, d]."""
        m = self.layout.num_rows
        padded = _pad_rows(q, self.layout.padded_rows)
        out, lse = _flex_with_lse(padded.transpose(0, 1)[None], *self._flex_context(context_kv), self.block_mask,
                                  scale, self.compiled)  # fmt: skip
        # Views into the padded tensors: the backward keeps one copy of each.
        return merge_diagonal(
            out[0].transpose(0, 1)[:m], lse[0].transpose(0, 1)[:m], padded[:m], diagonal_kv, scale
        )
