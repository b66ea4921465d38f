"""The KD teacher: the target's next-token distribution over the draft vocab, and its full-vocab argmax.

Softmax over the draft-vocab columns of the target logits equals the full-vocab distribution restricted to
the draft vocab and renormalised, so the teacher never needs the other columns' probabilities. The full
argmax (for metrics and `mask_outside_draft_vocab`) does need every column: logits are built one chunk of
tokens at a time, so no [T, V] tensor exists (V = 163,840 for Kimi). The draft columns are gathered from
the same chunk of logits, which costs no second matmul.

The loss is soft cross-entropy -sum_v p_teacher(v) log q_draft(v). It differs from the forward
KL(p_teacher || q_draft) by the teacher's entropy, a constant of the data, so both have the same gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eaglet.errors import ConfigError
from eaglet.model.draft_head import rms_norm


@torch.no_grad()
def teacher_targets(
    last_hidden_state: Tensor,
    norm_weight: Tensor,
    eps: float,
    lm_head_weight: Tensor,
    d2t: Tensor,
    *,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Teacher log-probs over the draft vocab [N, V_d] and the full-vocab argmax [N] (target ids).

    last_hidden_state [N, H_t] is the target's last layer output before its final norm; the target's final
    RMSNorm (norm_weight, eps) is applied here, once. Logits are computed in lm_head's dtype (as the target
    serves them), their softmax in float32 or wider.
    """
    if chunk_tokens < 1:
        raise ConfigError(f"trainer.loss_chunk_tokens must be >= 1, got {chunk_tokens}")
    device, lm_dtype = lm_head_weight.device, lm_head_weight.dtype
    out_dtype = torch.promote_types(lm_dtype, torch.float32)
    draft_ids = torch.arange(d2t.numel(), device=device) + d2t.to(device)
    log_probs, argmax = [], []
    for chunk in last_hidden_state.split(chunk_tokens):
        normed = rms_norm(chunk.to(device), norm_weight.to(device), eps)
        logits = normed.to(lm_dtype) @ lm_head_weight.T  # [chunk, V]
        # max(...).indices is argmax (first maximum too) at half its cost on CPU; index_select beats [:, ids].
        argmax.append(logits.max(dim=-1).indices)
        draft_logits = logits.index_select(1, draft_ids)
        log_probs.append(torch.log_softmax(draft_logits.to(out_dtype), dim=-1))
    if not log_probs:
        return torch.empty(0, d2t.numel(), dtype=out_dtype, device=device), torch.empty(
            0, dtype=torch.int64, device=device
        )
    return torch.cat(log_probs), torch.cat(argmax)


def soft_cross_entropy(teacher_log_probs: Tensor, draft_logits: Tensor) -> Tensor:
    """Per-row -sum p_teacher * log_softmax(draft_logits) [N], computed in float32 or wider."""
    log_q = torch.log_softmax(draft_logits.to(torch.promote_types(draft_logits.dtype, torch.float32)), dim=-1)
    return -(teacher_log_probs.exp() * log_q).sum(dim=-1)
