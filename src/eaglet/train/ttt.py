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
  (draft argmax, mapped to a target id by d2t, equals argmax P over the full vocab; with full_vocab_argmax
  off, the best draft-vocab token of P), the fraction correct at step k. A step without weight breaks the chain: in serving, every drafted token lies in the generated
  (loss-masked) text. tau_sim = 1 + sum_k prod_{i<=k} acc_i.

Work is skipped where it cannot matter, with the same values and gradients:
- the teacher runs once per row, only at positions some step reads, over the draft-vocab columns (the full
  vocab only for `full_vocab_argmax` or `mask_outside_draft_vocab`);
- a position whose every step has weight 0 (a prompt token, say) needs only its step-0 key and value (the
  context of later positions): its query, attention output, o_proj, MLP and later steps are skipped. A
  position runs all steps once any step carries weight there: its step-k output feeds step k+1. ("rows")
- lm_head and the loss run only at positions of non-zero weight, chunked (`fused_loss`): no [T, V_d] logits.

Attention (`attention`): "flex" (block-sparse flex_attention, `eaglet.model.ttt_flex`; CUDA), "sdpa" (masked
SDPA with selector keys, `eaglet.model.attention`; CPU), "auto" picks by device and head size
(`select_attention`). `compile` runs the layer's pieces (norms + projections + RoPE, o_proj + MLP) through
torch.compile, and each loss chunk's softmax, loss and logit gradient too: fused element-wise work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from eaglet.config.choices import Attention
from eaglet.errors import ConfigError, DataError
from eaglet.model.attention import SdpaTTTAttention
from eaglet.model.draft_head import Eagle3DecoderLayer, Eagle3DraftHead, rope_cos_sin
from eaglet.model.ttt_flex import FlexTTTAttention, flex_unsupported
from eaglet.train.kd_loss import linear_soft_cross_entropy, soft_cross_entropy, teacher_targets

ATTENTION_BACKENDS = tuple(Attention)
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


def select_attention(attention: str, device: torch.device, head_dim: int) -> str:
    """The TTT attention backend: "auto" is flex on CUDA where its kernels take the head size, else sdpa."""
    if attention not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention={attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    unsupported = flex_unsupported(head_dim, device)
    if attention == "auto":
        return "flex" if device.type == "cuda" and unsupported is None else "sdpa"
    if attention == "flex" and unsupported is not None:
        raise ConfigError(f"trainer.attention=flex: {unsupported}; use trainer.attention=auto or sdpa")
    return attention


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


def _context_projections(
    layer: Eagle3DecoderLayer, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Step 0 at every position: the row's normalised embeddings (kept for the later steps), the layer input,
    residual, keys and values; all in cos's dtype (the compute dtype) but the residual."""
    normed_embeds = layer.input_layernorm(embeds).to(cos.dtype)
    x, residual = layer.attention_input(_shift(normed_embeds, 1, 0.0), hidden)
    x = x.to(cos.dtype)
    return (normed_embeds, x, residual, *layer.self_attn.project_kv(x, cos, sin))


def _step_projections(
    layer: Eagle3DecoderLayer, normed_embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Step k > 0 at the rows: queries, keys, values and the residual."""
    x, residual = layer.attention_input(normed_embeds, hidden)
    x = x.to(cos.dtype)
    return (layer.self_attn.project_q(x, cos, sin), *layer.self_attn.project_kv(x, cos, sin), residual)


def _query_projection(layer: Eagle3DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return layer.self_attn.project_q(x, cos, sin)


def _finish(layer: Eagle3DecoderLayer, residual: Tensor, attention: Tensor) -> Tensor:
    return layer.finish(residual, attention)


# Each piece runs its body with the layer's parameters replaced by `weights` (cast once per row). Under autocast,
# eager linears share one cached bf16 copy of each weight; compiled graphs cast inside the graph and would keep a
# copy per call (per step) for the backward. Casting once, outside, keeps one.
# Four functions, not one closure: torch.compile keys its cache (and its recompile limit of 8) by code object, and
# one shared closure made the four pieces share it; at K=5 the limit was hit and later shapes ran eagerly.
def _context_piece(layer: Eagle3DecoderLayer, weights: dict[str, Tensor], *args: Tensor) -> Any:
    return functional_call(layer, weights, args, {"run": _context_projections})


def _step_piece(layer: Eagle3DecoderLayer, weights: dict[str, Tensor], *args: Tensor) -> Any:
    return functional_call(layer, weights, args, {"run": _step_projections})


def _query_piece(layer: Eagle3DecoderLayer, weights: dict[str, Tensor], *args: Tensor) -> Any:
    return functional_call(layer, weights, args, {"run": _query_projection})


def _finish_piece(layer: Eagle3DecoderLayer, weights: dict[str, Tensor], *args: Tensor) -> Any:
    return functional_call(layer, weights, args, {"run": _finish})


@dataclass(frozen=True)
class _LayerPieces:
    context: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]
    step: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]
    query: Callable[..., Tensor]
    finish: Callable[..., Tensor]


_PIECES = (_context_piece, _step_piece, _query_piece, _finish_piece)
_EAGER = _LayerPieces(*_PIECES)


@cache
def _compiled() -> _LayerPieces:
    # Each piece keeps its shapes across the steps of a row (step 0's at every position, the others at the
    # rows), so one graph each; the row count varies per batch: automatic dynamic shapes after one recompile.
    return _LayerPieces(*(torch.compile(piece) for piece in _PIECES))


def _compute_dtype(device: torch.device, default: torch.dtype) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return default


KV = tuple[Tensor, Tensor]


def _row_weights(
    layer: Eagle3DecoderLayer, dtype: torch.dtype, cache: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The layer's matrices in the compute dtype (norm weights stay as they are, as under autocast), cast on the
    row's first step, inside the layer's forward (under FSDP the parameters are whole there only); the gradients
    flow back through the casts."""
    if not cache:
        cache.update({name: p.to(dtype) if p.dim() > 1 else p for name, p in layer.named_parameters()})
    return cache


def _first_step(
    layer: Eagle3DecoderLayer,
    embeds: Tensor,
    hidden: Tensor,
    cos: Tensor,
    sin: Tensor,
    rows: Tensor,
    attend: Callable[..., Tensor],
    *,
    pieces: _LayerPieces,
    weights: dict[str, Tensor],
) -> tuple[Tensor, Tensor, KV]:
    """Step 0 (run inside the layer's forward): outputs at the rows, normalised embeddings, context keys/values."""
    w = _row_weights(layer, cos.dtype, weights)
    normed_embeds, x, residual, k, v = pieces.context(layer, w, embeds, hidden, cos, sin)
    q = pieces.query(layer, w, x[rows], cos[rows], sin[rows])
    out = pieces.finish(layer, w, residual[rows], attend(q, (k, v), [], layer.self_attn.scale))
    return out, normed_embeds, (k, v)


def _next_step(
    layer: Eagle3DecoderLayer,
    normed_embeds: Tensor,
    hidden: Tensor,
    cos: Tensor,
    sin: Tensor,
    attend: Callable[..., Tensor],
    context_kv: KV,
    diagonal_kv: list[KV],
    *,
    pieces: _LayerPieces,
    weights: dict[str, Tensor],
) -> tuple[Tensor, KV]:
    """Step k > 0 (run inside the layer's forward) at the rows: outputs and this step's keys/values."""
    w = _row_weights(layer, cos.dtype, weights)
    q, k, v, residual = pieces.step(layer, w, normed_embeds, hidden, cos, sin)
    out = pieces.finish(
        layer, w, residual, attend(q, context_kv, [*diagonal_kv, (k, v)], layer.self_attn.scale)
    )
    return out, (k, v)


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
    full_vocab_argmax: bool = True,
    attention: str = "auto",
    fused_loss: bool | None = None,
    compile: bool = False,
) -> TTTOutput:
    """Unroll `ttt_steps` steps of `head` over one packed row (keys in BATCH_KEYS, each [T, ...]).

    full_vocab_argmax: accuracies against the teacher's argmax over the full vocab (else over the draft
    vocab; forced on by mask_outside_draft_vocab). fused_loss: lm_head + loss chunked in one autograd
    function (None: on CUDA); otherwise through `head.logits`.
    """
    if ttt_steps < 1:
        raise ConfigError(f"ttt_steps must be >= 1, got {ttt_steps}")
    if step_loss_decay <= 0:
        raise ConfigError(f"step_loss_decay must be > 0, got {step_loss_decay}")
    device = head.fc.weight.device
    backend = select_attention(attention, device, head.head_dim)
    t = _check_batch(batch)
    input_ids = batch["input_ids"].to(device, torch.int64)
    loss_mask = batch["loss_mask"].to(device, torch.bool)
    document_ids = batch["document_ids"].to(device)
    # Segment index per token: robust to a document id reused by a later, non-adjacent document.
    starts = (document_ids[1:] != document_ids[:-1]).long()
    segments = torch.cat([starts.new_zeros(1), starts]).cumsum(0)

    # The teacher at p serves every step predicting x_{p+1}: needed iff x_{p+1} is a weighted token of p's document.
    teacher_pos = (_shift(loss_mask, 1, False) & _same_document(segments, 1)).nonzero().squeeze(1)
    teacher = teacher_targets(
        batch["last_hidden_state"][teacher_pos.to(batch["last_hidden_state"].device)],
        target_norm_weight,
        target_norm_eps,
        target_lm_head,
        head.d2t,
        chunk_tokens=chunk_tokens,
        full_vocab_argmax=full_vocab_argmax or mask_outside_draft_vocab,
    ).to(device)
    teacher_row = torch.full((t,), -1, dtype=torch.int64, device=device)
    teacher_row[teacher_pos] = torch.arange(teacher_pos.numel(), device=device)
    teacher_ok = teacher_row >= 0
    if mask_outside_draft_vocab:
        teacher_ok[teacher_pos] = head.t2d[teacher.argmax]

    # Step k at t reads the teacher at t+1+k, inside t's document: its weight.
    weights = torch.stack(
        [_shift(teacher_ok, k + 1, False) & _same_document(segments, k + 1) for k in range(ttt_steps)]
    )
    rows = weights.any(0).nonzero().squeeze(1)
    if rows.numel() == 0:  # nothing to learn here: one row keeps the graph, for a zero differentiable loss
        rows = torch.zeros(1, dtype=torch.int64, device=device)
    slot = torch.full((t,), -1, dtype=torch.int64, device=device)
    slot[rows] = torch.arange(rows.numel(), device=device)

    attend = FlexTTTAttention(segments, rows) if backend == "flex" else SdpaTTTAttention(segments, rows)
    pieces = _compiled() if compile else _EAGER
    fused = device.type == "cuda" if fused_loss is None else fused_loss
    dtype = _compute_dtype(device, head.fc.weight.dtype)
    lm_weight = head.lm_head.weight.to(dtype) if fused else None
    position_ids = batch["position_ids"].to(device, torch.int64)

    def rope(positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, head.head_dim, head.rope_theta, dtype)

    embeds = head.embed_tokens(input_ids)
    hidden = head.fuse(batch["aux_hidden_states"].to(device))
    chain_ok = torch.ones(t, dtype=torch.bool, device=device)
    context_kv, diagonal_kv, layer_weights = None, [], {}
    step_losses, weight_sums, correct_sums, counts = [], [], [], []
    for k in range(ttt_steps):
        if context_kv is None:
            hidden, normed_embeds, context_kv = head.midlayer(
                embeds, hidden, *rope(position_ids), rows, attend, pieces=pieces, weights=layer_weights,
                run=_first_step,
            )  # fmt: skip
        else:
            # Rows whose inputs run past the row's end carry no weight at this step or later: any token does.
            inputs = normed_embeds[(rows + k + 1).clamp(max=t - 1)]
            hidden, kv = head.midlayer(
                inputs, hidden, *rope(position_ids[rows] + k), attend, context_kv, diagonal_kv,
                pieces=pieces, weights=layer_weights, run=_next_step,
            )  # fmt: skip
            diagonal_kv.append(kv)

        weighted = weights[k].nonzero().squeeze(1)
        teacher_rows = teacher_row[weighted + k + 1]
        if fused:
            normed = head.norm(hidden[slot[weighted]]).to(dtype)
            ce, argmax = linear_soft_cross_entropy(
                normed, lm_weight, teacher, teacher_rows, chunk_tokens=chunk_tokens, compiled=compile
            )
        else:
            logits = head.logits(hidden[slot[weighted]])
            ce, argmax = (
                soft_cross_entropy(teacher.log_probs(teacher_rows), logits).sum(),
                logits.argmax(dim=-1),
            )
        step_losses.append(ce / max(weighted.numel(), 1))

        with torch.no_grad():
            correct = head.draft_target_ids[argmax] == teacher.argmax[teacher_rows]
            counted = chain_ok[weighted]
            chain_ok = torch.zeros_like(chain_ok)
            chain_ok[weighted] = counted & correct
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
