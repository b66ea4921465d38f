"""A Llama-family target's forward over a static per-slot cache: the arithmetic of the generation engine.

`SlotDecoder` runs the target's own modules (projections, norms, MLPs, rotary embedding, head) and does the
attention itself, so that a decode step has fixed shapes and no host work: each slot's new key and value are
written in place at the slot's position, and attention reads each slot up to its own length
(eaglet.generation.decode_attention). That makes the step capturable as one CUDA graph. Prompts are
prefilled right-padded without a mask (causal attention never lets a token see the padding after it), or
packed end to end without padding (`prefill_packed`, eaglet.generation.packed_attention).

Architectures: those whose decoder layer is Llama's (pre-norm attention and MLP, rotary embedding, optional
per-head q/k norms): llama, mistral, qwen2, qwen3, without sliding-window layers. `unsupported_reason` says
why another model is not, and generation then uses the reference decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from eaglet.generation.decode_attention import decode_attention
from eaglet.generation.packed_attention import packed_attention
from eaglet.target_model.layers import find_target_parts

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model` cannot decode over slots (None when it can)."""
    config = _text_config(model)
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} is not one of {', '.join(ARCHITECTURES)}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "it has sliding-window attention layers"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it uses sliding-window attention"
    try:
        parts = find_target_parts(model)
    except Exception as error:  # the reference decoder gives its own message, if any
        return str(error)
    layer = parts.layers[0]
    missing = [name for name in _LAYER_PARTS if not hasattr(layer, name)]
    missing += [f"self_attn.{name}" for name in _ATTENTION_PARTS if not hasattr(layer.self_attn, name)]
    if missing:
        return f"its decoder layer {type(layer).__name__} lacks {', '.join(missing)}"
    if _rotary(model) is None:
        return "no rotary embedding module `rotary_emb` next to its decoder layers"
    return None


@dataclass
class PackedPrompts:
    """Prompts end to end, the input of `SlotDecoder.prefill_packed`: T tokens of n prompts."""

    ids: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] each token's position in its prompt: its column of the cache
    slots: torch.Tensor  # [T] the slot whose cache takes each token's keys and values
    starts: torch.Tensor  # [n + 1] where each prompt begins, then T
    last: torch.Tensor  # [n] each prompt's last token
    longest: int  # no prompt is longer

    @staticmethod
    def build(prompts: list[list[int]], slots: list[int], device: torch.device) -> PackedPrompts:
        """`prompts` packed for `slots` (one each), built on the host and moved to `device` in one copy."""
        lengths = torch.tensor([len(p) for p in prompts])
        total = int(lengths.sum())
        starts = torch.zeros(len(prompts) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=starts[1:])
        host = torch.empty(3 * total + 2 * len(prompts) + 1, dtype=torch.long)
        host[:total] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        host[total : 2 * total] = torch.arange(total) - torch.repeat_interleave(starts[:-1], lengths)
        host[2 * total : 3 * total] = torch.repeat_interleave(torch.tensor(slots), lengths)
        host[3 * total : 3 * total + len(prompts) + 1] = starts
        host[3 * total + len(prompts) + 1 :] = starts[1:] - 1
        moved = host.to(device)
        ids, positions, token_slots, rest = moved.split([total, total, total, 2 * len(prompts) + 1])
        return PackedPrompts(
            ids,
            positions,
            token_slots,
            rest[: len(prompts) + 1],
            rest[len(prompts) + 1 :],
            int(lengths.max()),
        )


class SlotDecoder:
    """The target's forward for `slots` rows of at most `capacity` tokens each, over its own key/value cache.

    `spare` slots more are allocated past them: a prefill may write there (eaglet.generation.prefill_graphs puts
    its padding rows in one); a decode step over n tokens reads slots 0..n-1 only.
    """

    def __init__(self, model: torch.nn.Module, *, slots: int, capacity: int, spare: int = 0) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot decode over slots: {reason}")
        config = _text_config(model)
        parts = find_target_parts(model)
        self.layers, self.norm, self.lm_head, self.embed = (
            parts.layers,
            parts.final_norm,
            parts.lm_head,
            parts.embed_tokens,
        )
        self.rotary = _rotary(model)
        attention = self.layers[0].self_attn
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = float(getattr(attention, "scaling", self.head_dim**-0.5))
        self.slots, self.capacity = slots, capacity
        weight = self.embed.weight
        shape = (slots + spare, self.kv_heads, capacity, self.head_dim)
        # Zeroed: a column no slot wrote yet must not be NaN, which the masked softmax would still spread.
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in self.layers]

    @staticmethod
    def cache_bytes(model: torch.nn.Module, slots: int, capacity: int) -> int:
        """Bytes the keys and values of `slots` x `capacity` tokens take."""
        config = _text_config(model)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        itemsize = next(model.parameters()).element_size()
        return 2 * config.num_hidden_layers * slots * kv_heads * capacity * head_dim * itemsize

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [slots, vocab] after each slot's token `tokens` [slots] at `positions` [slots].

        Writes each slot's key and value at column `positions` and attends to columns 0..positions.
        """
        slots = torch.arange(tokens.shape[0], device=tokens.device)
        lengths = positions + 1

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [S, 1, H, D], k/v [S, 1, KV, D]
            self.keys[index][slots, :, positions] = k[:, 0]
            self.values[index][slots, :, positions] = v[:, 0]
            rows = tokens.shape[0]
            out = decode_attention(
                q[:, 0], self.keys[index][:rows], self.values[index][:rows], lengths, self.scale
            )
            return out[:, None]

        hidden = self._layers(self.embed(tokens[:, None]), positions[:, None], attend)
        return self.lm_head(self.norm(hidden[:, 0]))

    def prefill(self, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] after the last token of each right-padded prompt `ids` [n, W] (`lengths` [n] real
        tokens); their keys and values go to columns 0..W-1 of `slots` [n] (those past a prompt's length are
        padding, overwritten as the slot decodes)."""
        width = ids.shape[1]
        positions = torch.arange(width, device=ids.device).expand(ids.shape[0], width)

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # [n, W, heads, D] -> [n, heads, W, D]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            self.keys[index][slots, :, :width] = k
            self.values[index][slots, :, :width] = v
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.kv_heads != self.heads
            )
            return out.transpose(1, 2)

        hidden = self._layers(self.embed(ids), positions, attend)
        last = hidden[torch.arange(ids.shape[0], device=ids.device), lengths - 1]
        return self.lm_head(self.norm(last))

    def prefill_packed(self, packed: PackedPrompts) -> torch.Tensor:
        """Logits [n, vocab] after the last token of each of `packed`'s prompts, as `prefill` gives them; each
        token's key and value go to its slot's column at its position."""

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # [1, T, heads, D]
            self.keys[index][packed.slots, :, packed.positions] = k[0]
            self.values[index][packed.slots, :, packed.positions] = v[0]
            return packed_attention(q[0], k[0], v[0], packed.starts, packed.longest, self.scale)[None]

        hidden = self._layers(self.embed(packed.ids[None]), packed.positions[None], attend)
        return self.lm_head(self.norm(hidden[0, packed.last]))

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, attend: Any) -> torch.Tensor:
        """The decoder layers over hidden [N, T, hidden] at `positions` [N, T], attention by `attend`."""
        cos, sin = self.rotary(hidden, positions)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        batch, length = hidden.shape[:2]
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            h = layer.input_layernorm(hidden)
            q = attention.q_proj(h).view(batch, length, self.heads, self.head_dim)
            k = attention.k_proj(h).view(batch, length, self.kv_heads, self.head_dim)
            v = attention.v_proj(h).view(batch, length, self.kv_heads, self.head_dim)
            if hasattr(attention, "q_norm"):
                q, k = attention.q_norm(q), attention.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            out = attend(index, q.to(v.dtype), k.to(v.dtype), v)
            hidden = hidden + attention.o_proj(out.reshape(batch, length, self.heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _text_config(model: torch.nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rotary(model: torch.nn.Module) -> torch.nn.Module | None:
    """The rotary embedding module beside the decoder layers (it computes cos/sin, scaling included)."""
    path = find_target_parts(model).layer_path.rpartition(".")[0]
    return getattr(model.get_submodule(path), "rotary_emb", None)
