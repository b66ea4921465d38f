"""Training-time test (TTT): the draft head unrolled over K steps on one packed row, with its KD loss.

A row holds several documents back to back. In a document x_0..x_{n-1}, with fused target features
f_t = fc(aux_t) and the target's next-token distribution P_p = softmax(lm_head(final_norm(last_p))):

- Step 0 at position t: input (embed(x_{t+1}), f_t), RoPE position t; predicts x_{t+2}; teacher P_{t+1}
  restricted to the draft vocab and renormalised; weight loss_mask[t+2] (0 when t+2 >= n).
- Step k (0 < k < K): input (embed(x_{t+1+k}), g^{k-1}_t), g^{k-1}_t the midlayer output of step k-1 at t
  (before `norm`); RoPE position t+k; predicts x_{t+2+k}; teacher P_{t+1+k}; weight loss_mask[t+2+k]
  (0 when t+2+k >= n).
- Attention of step k at t: step-0 keys/values of positions s <= t of the same document, plus those of
  steps 1..k at t itself (the diagonal). Nothing crosses documents.
- With `mask_outside_draft_vocab`, the weight is also 0 where argmax P_{t+1+k} is not in the draft vocab.
- loss = sum_k decay**k * (sum_t w_k(t) * CE_k(t)) / (sum_t w_k(t)), CE the soft cross-entropy
  -sum_v P(v) log q(v) over the draft vocab (KL minus the teacher entropy, a constant); a step with no
  weight adds 0.
- acc_k: among positions t with w_k(t) > 0 whose steps 0..k-1 all carried weight and were correct at t
  (draft argmax, mapped to a target id by d2t, equals argmax P over the full vocab), the fraction correct at
  step k. A step without weight breaks the chain: in serving, every drafted token lies in the generated
  (loss-masked) text. tau_sim = 1 + sum_k prod_{i<=k} acc_i.

Work is skipped where it cannot matter: the teacher runs once per row, only at positions some step reads,
and lm_head / the loss run only at positions of non-zero weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eaglet.errors import ConfigError, DataError
from eaglet.model.attention import document_causal_mask
from eaglet.model.draft_head import Eagle3DraftHead
from eaglet.train.kd_loss import soft_cross_entropy, teacher_targets

BATCH_KEYS = (
    "input_ids",
    "loss_mask",
    "document_ids",
    "position_ids",
    "aux_hidden_states",
    "last_hidden_state",
)


@dataclass
class TTTOutput:
    """The loss of one row, and per-step sums to aggregate metrics across rows and batches."""

    loss: Tensor  # scalar, differentiable
    step_losses: Tensor  # [K] per-step mean soft cross-entropy (detached)
    step_weight_sums: Tensor  # [K] positions carrying weight: average losses weighted by these
    step_correct: Tensor  # [K] conditional-accuracy numerators
    step_counts: Tensor  # [K] conditional-accuracy denominators


def tau_sim(step_correct: Tensor, step_counts: Tensor) -> float:
    """Simulated acceptance length 1 + sum_k prod_{i<=k} acc_i; a step never evaluated counts as acc 0."""
    tau, survive = 1.0, 1.0
    for correct, count in zip(step_correct.tolist(), step_counts.tolist(), strict=True):
        survive *= correct / count if count else 0.0
        tau += survive
    return tau


def _check_batch(batch: dict[str, Tensor]) -> int:
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        raise DataError(f"batch lacks {missing}; a TTT batch needs {list(BATCH_KEYS)}")
    t = batch["input_ids"].shape[0]
    if t == 0:
        raise DataError("batch['input_ids'] is an empty row; the packer must emit at least one token per row")
    for key in BATCH_KEYS:
        shape = tuple(batch[key].shape)
        if shape[:1] != (t,) or (key not in ("aux_hidden_states", "last_hidden_state") and len(shape) != 1):
            raise DataError(
                f"batch[{key!r}] has shape {shape}; expected one packed row of {t} tokens "
                "([T] for ids and masks, [T, ...] for hidden states)"
            )
    return t


def _shift(x: Tensor, offset: int, fill: float | bool) -> Tensor:
    """y[t] = x[t + offset], `fill` past the end."""
    pad = torch.full((min(offset, x.shape[0]), *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[offset:], pad])


def _same_document(segments: Tensor, offset: int) -> Tensor:
    """bool [T]: position t + offset exists and lies in t's document."""
    return _shift(segments, offset, -1) == segments


def ttt_forward(
    head: Eagle3DraftHead,
    batch: dict[str, Tensor],
    *,
    target_norm_weight: Tensor,
    target_norm_eps: float,
    target_lm_head: Tensor,
    ttt_steps: int,
    step_loss_decay: float,
    mask_outside_draft_vocab: bool = False,
    chunk_tokens: int = 2048,
) -> TTTOutput:
    """Unroll `ttt_steps` steps of `head` over one packed row (keys in BATCH_KEYS, each [T, ...])."""
    if ttt_steps < 1:
        raise ConfigError(f"trainer.ttt_steps must be >= 1, got {ttt_steps}")
    if step_loss_decay <= 0:
        raise ConfigError(f"trainer.step_loss_decay must be > 0, got {step_loss_decay}")
    t = _check_batch(batch)
    device = head.fc.weight.device
    input_ids = batch["input_ids"].to(device, torch.int64)
    loss_mask = batch["loss_mask"].to(device, torch.bool)
    document_ids = batch["document_ids"].to(device)
    # Segment index per token: robust to a document id reused by a later, non-adjacent document.
    starts = (document_ids[1:] != document_ids[:-1]).long()
    segments = torch.cat([starts.new_zeros(1), starts]).cumsum(0)

    # The teacher at p serves every step predicting x_{p+1}: needed iff x_{p+1} is a weighted token of p's document.
    teacher_pos = (_shift(loss_mask, 1, False) & _same_document(segments, 1)).nonzero().squeeze(1)
    teacher_log_probs, teacher_argmax = teacher_targets(
        batch["last_hidden_state"][teacher_pos.to(batch["last_hidden_state"].device)],
        target_norm_weight,
        target_norm_eps,
        target_lm_head,
        head.d2t,
        chunk_tokens=chunk_tokens,
    )
    teacher_log_probs, teacher_argmax = teacher_log_probs.to(device), teacher_argmax.to(device)
    teacher_row = torch.full((t,), -1, dtype=torch.int64, device=device)
    teacher_row[teacher_pos] = torch.arange(teacher_pos.numel(), device=device)
    teacher_ok = teacher_row >= 0
    if mask_outside_draft_vocab:
        teacher_ok[teacher_pos] = head.t2d[teacher_argmax]

    mask = document_causal_mask(segments)
    embeds = head.embed_tokens(input_ids)
    position_ids = batch["position_ids"].to(device, torch.int64)
    hidden = head.fuse(batch["aux_hidden_states"].to(device))
    context_kv, diagonal_kv = None, []
    chain_ok = torch.ones(t, dtype=torch.bool, device=device)
    step_losses, weight_sums, correct_sums, counts = [], [], [], []
    for k in range(ttt_steps):
        hidden, kv = head.decoder_step(
            _shift(embeds, k + 1, 0.0), hidden, position_ids + k, mask, context_kv, diagonal_kv
        )
        if context_kv is None:
            context_kv = kv
        else:
            diagonal_kv.append(kv)

        # Step k at t reads the teacher at t+1+k, inside t's document.
        weighted = (_shift(teacher_ok, k + 1, False) & _same_document(segments, k + 1)).nonzero().squeeze(1)
        rows = teacher_row[weighted + k + 1]
        logits = head.logits(hidden[weighted])
        step_loss = soft_cross_entropy(teacher_log_probs[rows], logits).sum() / max(weighted.numel(), 1)

        with torch.no_grad():
            correct = head.draft_target_ids[logits.argmax(dim=-1)] == teacher_argmax[rows]
            counted = chain_ok[weighted]
            chain_ok = torch.zeros_like(chain_ok)
            chain_ok[weighted] = counted & correct
        step_losses.append(step_loss)
        weight_sums.append(weighted.numel())
        correct_sums.append((counted & correct).sum())
        counts.append(counted.sum())

    losses = torch.stack(step_losses)
    decays = step_loss_decay ** torch.arange(ttt_steps, dtype=losses.dtype, device=device)
    return TTTOutput(
        loss=(decays * losses).sum(),
        step_losses=losses.detach(),
        step_weight_sums=torch.tensor(weight_sums, dtype=losses.dtype, device=device),
        step_correct=torch.stack(correct_sums),
        step_counts=torch.stack(counts),
    )
