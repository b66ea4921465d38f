"""Serving-time inference of an EAGLE-3 draft head over one sequence, with the head's own KV cache.

It mirrors training (`eaglet.train.ttt`) entry by entry. For a sequence x_0, x_1, ... with target aux states
aux_t, the cache holds one step-0 entry per position t whose next token x_{t+1} is known: the midlayer run on
(embed(x_{t+1}), fc(aux_t)) at RoPE position t, attending causally to the entries before it. Greedy drafting
from the last context position n then appends chain entries: draft token 1 is argmax of the step-0 output at n;
draft token j > 1 comes from (embed(d_{j-1}), g_{j-1}) at RoPE position n + j - 1, which sees the whole
context plus the chain's earlier entries, exactly what TTT step j - 1 at position n sees in training. Chain
entries are speculative: the next `append_context` drops them before adding the accepted positions.

The layer is recomputed from the head's own modules (norms, projections, MLP, rope helpers), since the
training entry point `decoder_step` cannot read a growing cache; tests pin both to the same logits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from eaglet.errors import DataError
from eaglet.model.attention import context_attention
from eaglet.model.draft_head import Eagle3DraftHead, apply_rope, rope_cos_sin


class Eagle3Drafter:
    """Incremental draft-head state for one sequence: its KV cache and the last step-0 output."""

    def __init__(self, head: Eagle3DraftHead) -> None:
        self.head = head
        self._scale = 1.0 / math.sqrt(head.head_dim)
        self.reset()

    def reset(self) -> None:
        attn = self.head.midlayer.self_attn
        # On the head's current device and dtype: reset at every new sequence follows a moved head.
        empty = attn.k_proj.weight.new_zeros(0, attn.num_kv_heads, attn.head_dim)
        self._keys, self._values = empty, empty
        self._context = 0
        self._last_hidden: Tensor | None = None

    @torch.inference_mode()
    def append_context(self, next_tokens: Tensor, aux_hidden_states: Tensor) -> Tensor:
        """Add step-0 entries for the next n positions; returns their midlayer outputs [n, H].

        next_tokens [n]: the token following each position; aux_hidden_states [n, num_aux, H_t] (or
        [n, num_aux * H_t]): the target's aux states at each position. Drops any chain entries first.
        """
        if next_tokens.shape[0] != aux_hidden_states.shape[0]:
            raise DataError(
                f"{next_tokens.shape[0]} next tokens but {aux_hidden_states.shape[0]} rows of aux states; "
                "each new draft position needs its token and its target states"
            )
        self.discard_chain()
        device = self.head.fc.weight.device
        embeds = self.head.embed_tokens(next_tokens.to(device))
        hidden = self.head.fuse(aux_hidden_states.to(device))
        out = self._forward(embeds, hidden)
        self._context += out.shape[0]
        self._last_hidden = out[-1:]
        return out

    @torch.inference_mode()
    def chain_step(self, token: Tensor, hidden: Tensor) -> Tensor:
        """Append one chain entry reading (embed(token), hidden) [1], [1, H]; returns its output [1, H]."""
        embeds = self.head.embed_tokens(token.to(self.head.fc.weight.device))
        return self._forward(embeds, hidden)

    @torch.inference_mode()
    def propose(self, k: int) -> list[int]:
        """Greedy chain of up to k target token ids from the last context position (needs context)."""
        if self._last_hidden is None:
            raise RuntimeError("propose() needs at least one context entry; call append_context first")
        self.discard_chain()
        hidden, tokens = self._last_hidden, []
        for j in range(k):
            token = self.head.draft_target_ids[self.head.logits(hidden).argmax(dim=-1)]
            tokens.append(token)
            if j + 1 < k:
                hidden = self.chain_step(token, hidden)
        # One host sync per chain, not per token.
        return torch.cat(tokens).tolist() if tokens else []

    def discard_chain(self) -> None:
        self._keys, self._values = self._keys[: self._context], self._values[: self._context]

    def _forward(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        """The midlayer over t new entries at the next cache positions, each seeing the cache and earlier new ones."""
        layer, attn = self.head.midlayer, self.head.midlayer.self_attn
        t, cached = embeds.shape[0], self._keys.shape[0]
        # An entry's RoPE position is its index in the cache: chain step j of position n lands at n + j.
        positions = torch.arange(cached, cached + t, device=embeds.device)
        cos, sin = rope_cos_sin(positions, self.head.head_dim, self.head.rope_theta, embeds.dtype)
        normed_hidden = layer.hidden_norm(hidden)
        residual = normed_hidden if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed_hidden], dim=-1)
        q = apply_rope(attn.q_proj(x).view(t, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rope(attn.k_proj(x).view(t, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = attn.v_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
        self._keys = torch.cat([self._keys, k])
        self._values = torch.cat([self._values, v])
        key_pos = torch.arange(cached + t, device=embeds.device)
        mask = key_pos[None, :] <= positions[:, None]
        out = context_attention(q, self._keys, self._values, mask, self._scale)
        hidden = residual + attn.o_proj(out.reshape(t, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
