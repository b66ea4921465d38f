"""The KD teacher over the draft vocab, and the draft's soft cross-entropy against it.

Softmax over the draft-vocab columns of the target logits equals the full-vocab distribution restricted to
the draft vocab and renormalised, so the teacher needs only those columns: `teacher_targets` multiplies by
the V_d draft rows of the target's lm_head (not all V rows: 5x less work at Kimi's V = 163,840). The
full-vocab argmax (for `mask_outside_draft_vocab`, and exact accuracies) needs every column: on request the
logits are built one chunk of tokens at a time, so no [T, V] tensor exists, and the draft columns are
gathered from the same chunk. The teacher keeps its logits in the lm_head's dtype (what the target computes)
with their log-sum-exp: half the memory of float32 log-probabilities, the same values.

The loss is soft cross-entropy -sum_v p_teacher(v) log q_draft(v). It differs from the forward
KL(p_teacher || q_draft) by the teacher's entropy, a constant of the data, so both have the same gradients.
`linear_soft_cross_entropy` fuses the draft's lm_head with it, chunk by chunk: the [N, V_d] logits live one
chunk at a time and their gradient is folded into the hidden states' gradient during the forward, so only
[N, H] is kept for the backward (plus the logit gradient in the compute dtype when lm_head trains).
With `compiled`, each chunk's softmax, loss, argmax and logit gradient run as one torch.compile graph: a few
fused passes over the [chunk, V_d] logits instead of a dozen eager element-wise kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor

from eaglet.errors import ConfigError
from eaglet.model.draft_head import rms_norm


@dataclass
class Teacher:
    """The teacher at N positions: logits over the draft vocab, their log-sum-exp, the argmax (a target id)."""

    logits: Tensor  # [N, V_d], lm_head's dtype
    logsumexp: Tensor  # [N], float32 or wider
    argmax: Tensor  # [N] int64 target ids: over the full vocab, or over the draft vocab (see teacher_targets)

    def to(self, device: torch.device) -> Teacher:
        return Teacher(self.logits.to(device), self.logsumexp.to(device), self.argmax.to(device))

    def log_probs(self, rows: Tensor) -> Tensor:
        """log p_teacher [len(rows), V_d] at teacher rows `rows`, float32 or wider."""
        return self.logits[rows].to(self.logsumexp.dtype) - self.logsumexp[rows, None]


@torch.no_grad()
def teacher_targets(
    last_hidden_state: Tensor,
    norm_weight: Tensor,
    eps: float,
    lm_head_weight: Tensor,
    d2t: Tensor,
    *,
    chunk_tokens: int,
    full_vocab_argmax: bool = True,
) -> Teacher:
    """The teacher of last_hidden_state [N, H_t], the target's last layer output before its final norm.

    The target's final RMSNorm (norm_weight, eps) is applied here, once. Logits are computed in lm_head's
    dtype (as the target serves them), their log-sum-exp in float32 or wider. `argmax` is over the full vocab
    with `full_vocab_argmax` (costs the [chunk, V] matmul), else over the draft vocab (the best draft token,
    mapped to its target id; equal to the full argmax wherever that lies in the draft vocab).
    """
    if chunk_tokens < 1:
        raise ConfigError(f"loss_chunk_tokens must be >= 1, got {chunk_tokens}")
    device, lm_dtype = lm_head_weight.device, lm_head_weight.dtype
    acc = torch.promote_types(lm_dtype, torch.float32)
    draft_ids = torch.arange(d2t.numel(), device=device) + d2t.to(device)
    draft_rows = None if full_vocab_argmax else lm_head_weight.index_select(0, draft_ids)
    n = last_hidden_state.shape[0]
    logits = torch.empty(n, d2t.numel(), dtype=lm_dtype, device=device)
    logsumexp = torch.empty(n, dtype=acc, device=device)
    argmax = torch.empty(n, dtype=torch.int64, device=device)
    for start in range(0, n, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        normed = rms_norm(last_hidden_state[rows].to(device), norm_weight.to(device), eps).to(lm_dtype)
        if draft_rows is None:
            full = normed @ lm_head_weight.T  # [chunk, V]
            # max(...).indices is argmax (first maximum too) at half its cost on CPU; index_select beats [:, ids].
            argmax[rows] = full.max(dim=-1).indices
            logits[rows] = full.index_select(1, draft_ids)
        else:
            logits[rows] = normed @ draft_rows.T
            argmax[rows] = draft_ids[logits[rows].max(dim=-1).indices]
        logsumexp[rows] = torch.logsumexp(logits[rows].to(acc), dim=-1)
    return Teacher(logits, logsumexp, argmax)


def soft_cross_entropy(teacher_log_probs: Tensor, draft_logits: Tensor) -> Tensor:
    """Per-row -sum p_teacher * log_softmax(draft_logits) [N], computed in float32 or wider."""
    log_q = torch.log_softmax(draft_logits.to(torch.promote_types(draft_logits.dtype, torch.float32)), dim=-1)
    return -(teacher_log_probs.exp() * log_q).sum(dim=-1)


def _chunk_terms(
    logits: Tensor, teacher_logits: Tensor, teacher_lse: Tensor, rows: Tensor, grad_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk, eager: (sum of soft CE, draft argmax, d CE / d logits in grad_dtype), in one float buffer."""
    grad = logits.to(teacher_lse.dtype)  # logits, then log q, then q, then d CE / d logits: one buffer
    argmax = grad.max(dim=-1).indices
    grad -= torch.logsumexp(grad, dim=-1, keepdim=True)
    p = (teacher_logits[rows].to(teacher_lse.dtype) - teacher_lse[rows, None]).exp_()
    loss = -torch.linalg.vecdot(p, grad).sum()
    # d/dz of -sum_v p_v log softmax(z)_v = softmax(z) * sum_v p_v - p (sum_v p_v = 1 up to rounding).
    grad = grad.exp_().mul_(p.sum(-1, keepdim=True)).sub_(p).to(grad_dtype)
    return loss, argmax, grad


def _chunk_terms_for_compile(
    logits: Tensor, teacher_logits: Tensor, teacher_lse: Tensor, rows: Tensor, grad_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """_chunk_terms written out of place, for torch.compile to fuse into a few passes."""
    acc = teacher_lse.dtype
    z = logits.to(acc)
    log_q = z - torch.logsumexp(z, dim=-1, keepdim=True)
    p = (teacher_logits[rows].to(acc) - teacher_lse[rows, None]).exp()
    grad = log_q.exp() * p.sum(-1, keepdim=True) - p
    return -(p * log_q).sum(), z.max(dim=-1).indices, grad.to(grad_dtype)


@cache
def _compiled_chunk_terms() -> Any:
    # Chunks and row sets change size from batch to batch: dynamic shapes, one graph.
    return torch.compile(_chunk_terms_for_compile, dynamic=True)


class _LinearSoftCrossEntropy(torch.autograd.Function):
    """sum_i CE(teacher row rows[i], hidden[i] @ weight.T) and the draft argmax per row; see the module doc."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, teacher: Teacher, rows: Tensor, chunk: int, compiled: bool
    ) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        total = torch.zeros((), dtype=acc, device=hidden.device)
        argmax = torch.empty(n, dtype=torch.int64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        keep_logit_grads = ctx.needs_input_grad[1]
        logit_grads = []
        chunk_terms = _compiled_chunk_terms() if compiled else _chunk_terms
        for start in range(0, n, chunk):
            h, r = hidden[start : start + chunk], rows[start : start + chunk]
            loss, argmax[start : start + chunk], grad = chunk_terms(
                h @ weight.T, teacher.logits, teacher.logsumexp, r, hidden.dtype
            )
            total += loss
            grad_hidden[start : start + chunk] = grad @ weight
            if keep_logit_grads:
                logit_grads.append(grad)
        ctx.mark_non_differentiable(argmax)
        if keep_logit_grads:
            # No rows (a TTT step past the end of every document): an empty gradient, a zero weight gradient.
            grads = torch.cat(logit_grads) if logit_grads else hidden.new_zeros(0, weight.shape[0])
            ctx.save_for_backward(grad_hidden, grads, hidden)
        else:
            ctx.save_for_backward(grad_hidden)
        return total, argmax

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, grad_argmax: Tensor | None) -> tuple[Tensor | None, ...]:
        grad_hidden, *logit_grads = ctx.saved_tensors
        scale = grad_total.to(grad_hidden.dtype)
        grad_weight = None
        if logit_grads:
            grad_logits, hidden = logit_grads
            grad_weight = (grad_logits.T @ hidden) * scale
        return grad_hidden * scale, grad_weight, None, None, None, None


def linear_soft_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    teacher: Teacher,
    rows: Tensor,
    *,
    chunk_tokens: int,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """(sum over i of the soft CE of logits hidden[i] @ weight.T against teacher row rows[i], argmax [N]).

    hidden [N, H] and weight [V_d, H] must share a dtype (the compute dtype: cast them first under autocast);
    the logits' softmax runs in float32 or wider. Equals soft_cross_entropy(teacher.log_probs(rows),
    hidden @ weight.T).sum() in value and gradients, without holding [N, V_d] logits. `compiled`: each chunk's
    element-wise work through torch.compile (same values up to float rounding).
    """
    if chunk_tokens < 1:
        raise ConfigError(f"loss_chunk_tokens must be >= 1, got {chunk_tokens}")
    return _LinearSoftCrossEntropy.apply(hidden, weight, teacher, rows, chunk_tokens, compiled)
