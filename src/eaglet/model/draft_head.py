"""The EAGLE-3 draft head: one Llama-style decoder layer over (token embedding, fused target features).

Parameter and buffer names are the export contract of EAGLE3.md section 1 (no `model.` prefix):
`embed_tokens`, `fc`, `midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`, `lm_head`, and the buffers `d2t`, `t2d`.

The layer's attention input is cat(input_layernorm(embed), hidden_norm(hidden)), embeddings first; its
residual is the hidden input before `hidden_norm` (norm_before_residual=False, what SGLang serves) or after.
How the layer is unrolled over training-time-test steps is in `eaglet.train.ttt`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError, DataError
from eaglet.model.attention import ttt_attention

KV = tuple[Tensor, Tensor]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama RMSNorm: statistics in float32 (or wider), normalised values cast back before the weight."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(
    position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin [T, head_dim] of the rotate-half RoPE; angles computed in float64, then cast to `dtype`."""
    inv_freq = theta ** -(
        torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim
    )
    angles = position_ids.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, d] rotated by position: pairs (i, i + d/2), as in Llama."""
    first, second = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat([-second, first], dim=-1) * sin[:, None, :]


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scale = 1.0 / math.sqrt(d)
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def project_q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated queries [t, heads, d] of the layer input x [t, 2H]."""
        return apply_rope(self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim), cos, sin)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> KV:
        """Rotated keys and values [t, kv_heads, d] of the layer input x [t, 2H]."""
        t = x.shape[0]
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        return k, self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        context_kv: KV | None,
        diagonal_kv: Sequence[KV],
    ) -> tuple[Tensor, KV]:
        """Attention output [t, heads, d] (before o_proj) and this step's (k, v)."""
        q = self.project_q(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        if context_kv is None:
            if diagonal_kv:
                raise ValueError("diagonal keys need the step-0 context keys")
            return ttt_attention(q, k, v, None, None, mask, self.scale), (k, v)
        diagonal_k = torch.stack([*(dk for dk, _ in diagonal_kv), k])
        diagonal_v = torch.stack([*(dv for _, dv in diagonal_kv), v])
        return ttt_attention(q, *context_kv, diagonal_k, diagonal_v, mask, self.scale), (k, v)


class Eagle3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = Eagle3MLP(h, cfg.intermediate_size)

    def attention_input(self, normed_embeds: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The attention input cat(normed_embeds, hidden_norm(hidden)) [t, 2H] and the residual [t, H].

        normed_embeds is input_layernorm(embeds): training normalises each row's embeddings once for all steps.
        """
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        return torch.cat([normed_embeds, normed_hidden], dim=-1), residual

    def finish(self, residual: Tensor, attention: Tensor) -> Tensor:
        """o_proj of the attention output [t, heads, d], the residual, then the MLP block: the layer output [t, H]."""
        hidden = residual + self.self_attn.o_proj(attention.reshape(attention.shape[0], -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, *args: Any, run: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """The layer on (embeds, hidden, cos, sin, mask, context_kv, diagonal_kv), see `Eagle3DraftHead.decoder_step`.

        With `run`: returns run(self, *args, **kwargs) instead. Training's TTT steps use the layer's pieces
        (`attention_input`, `finish`, the projections) through here, so that wrappers acting on forward see
        every use of the parameters (FSDP gathers them there).
        """
        if run is not None:
            return run(self, *args, **kwargs)
        return self._decoder_step(*args, **kwargs)

    def _decoder_step(
        self,
        embeds: Tensor,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        context_kv: KV | None,
        diagonal_kv: Sequence[KV],
    ) -> tuple[Tensor, KV]:
        x, residual = self.attention_input(self.input_layernorm(embeds), hidden)
        attention, kv = self.self_attn(x, cos, sin, mask, context_kv, diagonal_kv)
        return self.finish(residual, attention), kv


def _check_shape(cfg: DraftConfig) -> None:
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim={cfg.head_dim} must be even for rotary embeddings")


class Eagle3DraftHead(nn.Module):
    """The draft head; `init_from_target` must run before training (embeddings, lm_head rows, vocab map)."""

    def __init__(
        self,
        cfg: DraftConfig,
        *,
        target_hidden_size: int,
        vocab_size: int,
        draft_vocab_size: int,
        num_aux: int = 3,
    ) -> None:
        super().__init__()
        _check_shape(cfg)
        if draft_vocab_size > vocab_size:
            raise ConfigError(
                f"draft_vocab_size={draft_vocab_size} exceeds the target vocab size {vocab_size}"
            )
        h = cfg.hidden_size
        self.hidden_size, self.target_hidden_size, self.num_aux = h, target_hidden_size, num_aux
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self.embed_tokens = nn.Embedding(vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(num_aux * target_hidden_size, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        # Identity mapping until init_from_target installs the real one.
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(vocab_size) < draft_vocab_size)

    @property
    def draft_target_ids(self) -> Tensor:
        """int64 [V_d]: the target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def init_from_target(
        self, embed_tokens: Tensor, lm_head: Tensor, d2t: Tensor, t2d: Tensor, *, lm_head_trainable: bool
    ) -> None:
        """Copy the target's embeddings (frozen) and its lm_head rows of the draft ids; install d2t/t2d."""
        expected = {
            "embed_tokens": (embed_tokens, tuple(self.embed_tokens.weight.shape)),
            "lm_head": (lm_head, (self.t2d.numel(), self.hidden_size)),
            "d2t": (d2t, tuple(self.d2t.shape)),
            "t2d": (t2d, tuple(self.t2d.shape)),
        }
        for name, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape:
                raise ConfigError(
                    f"target {name} has shape {tuple(tensor.shape)}, the draft head expects {shape}; "
                    "the head's vocab sizes and hidden sizes must match the target and its draft vocab"
                )
        target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.int64)
        if d2t.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= t2d.numel()):
            raise DataError(
                "d2t maps draft ids outside the target vocab; rebuild the draft vocab (token counts) for this target"
            )
        if int(t2d.sum()) != d2t.numel() or not bool(t2d[target_ids].all()):
            raise DataError(
                "d2t and t2d disagree (t2d must mark exactly the target ids arange(V_d) + d2t); "
                "rebuild both from the same token counts"
            )
        self.embed_tokens.weight.copy_(embed_tokens)
        self.lm_head.weight.copy_(lm_head[target_ids.to(lm_head.device)])
        self.lm_head.weight.requires_grad_(lm_head_trainable)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fuse(self, aux_hidden_states: Tensor) -> Tensor:
        """fc over the concatenated aux states: [T, num_aux*H_t] (or [T, num_aux, H_t]) -> [T, H]."""
        if aux_hidden_states.shape[-2:] == (self.num_aux, self.target_hidden_size):
            aux_hidden_states = aux_hidden_states.flatten(-2)
        if aux_hidden_states.shape[-1] != self.num_aux * self.target_hidden_size:
            raise DataError(
                f"aux_hidden_states has shape {tuple(aux_hidden_states.shape)}; the draft head expects "
                f"[..., {self.num_aux}*{self.target_hidden_size}]: the features were extracted for another target "
                "or another number of aux layers"
            )
        # Under autocast the matmul casts by itself: bf16 features are not widened to float32 on the way.
        if not torch.is_autocast_enabled(aux_hidden_states.device.type):
            aux_hidden_states = aux_hidden_states.to(self.fc.weight.dtype)
        return self.fc(aux_hidden_states)

    def decoder_step(
        self,
        embeds: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        mask: Tensor,
        context_kv: KV | None = None,
        diagonal_kv: Sequence[KV] = (),
    ) -> tuple[Tensor, KV]:
        """One application of the midlayer to [T, H] embeds and hidden at RoPE `position_ids` [T].

        Step 0: context_kv=None (the step attends to its own keys under `mask`, a bool [T, T] from
        `document_causal_mask`). Step k > 0: context_kv = step 0's (k, v) and diagonal_kv = steps 1..k-1's.
        Returns the layer output [T, H] (before `norm`: the next step's hidden) and this step's (k, v).
        """
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta, embeds.dtype)
        return self.midlayer(embeds, hidden, cos, sin, mask, context_kv, diagonal_kv)

    def logits(self, hidden: Tensor) -> Tensor:
        """lm_head(norm(hidden)): logits over the draft vocab [..., V_d]."""
        return self.lm_head(self.norm(hidden))
