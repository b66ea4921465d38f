"""Attention of one training-time-test (TTT) step over a packed row of documents.

Query t of step k sees two key sets: the step-0 keys of positions s <= t of its own document (causal,
document-masked context) and the keys of steps 1..k at its own position t (the diagonal). Both go through
fused `scaled_dot_product_attention` calls (flash attention on CPU, with a backward) under a bool mask built
once per row by `document_causal_mask`.

The diagonal keys differ per query, which a shared key axis cannot hold without k dense [T, T] identity
blocks (k times the cost of the context). Instead each diagonal key j becomes one extra "selector" key
shared by all queries: the queries gain k channels holding their own diagonal scores q_t . k_j[t], the
context keys gain k zero channels, and selector j is the unit vector of channel j, as key and as value.
The selector's score is then exactly the diagonal score, the softmax runs over context and diagonal
together, and the value channels of the output return the diagonal weights, by which the diagonal values
are added. A step costs k more keys than step 0, and autograd goes through SDPA's own backward.

`context_attention` is the backend: a function with its signature (flex attention on CUDA, say) can
replace it. Its CPU version cuts the row into query tiles, each over the keys it may see, since the fused
CPU kernels compute masked scores too and a packed row masks most of them (other documents).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def document_causal_mask(document_ids: Tensor) -> Tensor:
    """bool [T, T]: True where query t may attend to key s (same document and s <= t)."""
    t = document_ids.shape[0]
    same_document = document_ids[:, None] == document_ids[None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    return same_document & causal


QUERY_TILE = 256  # rows per SDPA call: small enough to skip most masked keys, large enough for the kernel


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    # SDPA takes [batch, heads, T, d]; only 4-d inputs reach the fused CPU kernels (3-d ones fall back to math).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def context_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Masked attention of q [T, heads, d] over k, v [S, kv, d] with mask bool [T, S]; returns [T, heads, d].

    Head i reads kv head i // (heads / kv), as in Llama's repeat_kv. Every row must allow at least one key.
    Each tile of QUERY_TILE queries attends over the keys that some query of the tile may see, only.
    """
    if q.is_cuda:
        return _cuda_attention(q, k, v, mask, scale)
    outs = []
    for q_tile, rows in zip(q.split(QUERY_TILE), mask.split(QUERY_TILE), strict=True):
        keys = rows.any(0).nonzero().squeeze(1)
        outs.append(_sdpa(q_tile, k[keys], v[keys], rows[:, keys], scale))
    return torch.cat(outs)


def _cuda_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """One SDPA call on the GPU: the masked fused kernel (memory-efficient attention) takes a bool mask.

    Tiling would sync the host at every tile. Its kernels want head sizes in multiples of 8 (zero channels
    change no score and no output), and GQA is expanded by hand, since `enable_gqa` sends a masked call to
    the math kernel, which materialises [heads, T, S] scores.
    """
    d = q.shape[-1]
    pad = -d % 8
    if pad:
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
    )
    return out[0].transpose(0, 1)[..., :d]


def ttt_attention(
    q: Tensor,
    context_k: Tensor,
    context_v: Tensor,
    diagonal_k: Tensor | None,
    diagonal_v: Tensor | None,
    mask: Tensor,
    scale: float,
) -> Tensor:
    """Attention of TTT step k: q [T, heads, d] over the step-0 context and the diagonal of steps 1..k.

    context_k/v: [T, kv, d], masked by `mask` (from `document_causal_mask`); diagonal_k/v: [k, T, kv, d]
    (None at step 0), key j of query t is diagonal_k[j, t]. Returns [T, heads, d].
    """
    if diagonal_k is None or diagonal_v is None:
        return context_attention(q, context_k, context_v, mask, scale)
    t, heads, d = q.shape
    steps, kv_heads = diagonal_k.shape[0], context_k.shape[1]
    grouped = q.view(t, kv_heads, heads // kv_heads, d)
    # Raw diagonal scores: SDPA applies `scale` to the selector channels like to every other product.
    diagonal_scores = torch.einsum("tkgd,jtkd->tkgj", grouped, diagonal_k).reshape(t, heads, steps)
    # Selector j: the unit vector of channel d + j, for every kv head.
    selectors = F.pad(torch.eye(steps, dtype=q.dtype, device=q.device), (d, 0))
    selectors = selectors[:, None, :].expand(steps, kv_heads, d + steps)
    keys = torch.cat([F.pad(context_k, (0, steps)), selectors])
    values = torch.cat([F.pad(context_v, (0, steps)), selectors])
    with_selectors = F.pad(mask, (0, steps), value=True)
    out = context_attention(torch.cat([q, diagonal_scores], -1), keys, values, with_selectors, scale)
    diagonal_weights = out[..., d:].reshape(t, kv_heads, heads // kv_heads, steps)
    diagonal = torch.einsum("tkgj,jtkd->tkgd", diagonal_weights, diagonal_v).reshape(t, heads, d)
    return out[..., :d] + diagonal


class SdpaTTTAttention:
    """`ttt_attention` for query rows `rows` (sorted positions) of one packed row, with segment ids `segments`.

    The interface of `eaglet.model.ttt_flex.FlexTTTAttention`: built once per row, called once per step.
    """

    def __init__(self, segments: Tensor, rows: Tensor) -> None:
        positions = torch.arange(segments.shape[0], device=segments.device)
        same_document = segments[rows][:, None] == segments[None, :]
        self.mask = same_document & (positions[None, :] <= rows[:, None])  # [rows, T]

    def __call__(
        self,
        q: Tensor,
        context_kv: tuple[Tensor, Tensor],
        diagonal_kv: list[tuple[Tensor, Tensor]],
        scale: float,
    ) -> Tensor:
        if not diagonal_kv:
            return ttt_attention(q, *context_kv, None, None, self.mask, scale)
        diagonal_k = torch.stack([k for k, _ in diagonal_kv])
        diagonal_v = torch.stack([v for _, v in diagonal_kv])
        return ttt_attention(q, *context_kv, diagonal_k, diagonal_v, self.mask, scale)
