"""What a replica of the target takes in a device's memory, and the share of it online training allows (the
training stage checks it before loading the target; the planner, before renting hardware)."""

from __future__ import annotations

from eaglet.config.schema import ModelConfig

# The target's weights may take at most this share of one device's memory when it trains online beside the
# head: the rest holds its activations over a micro-batch, the head, its optimizer state and the TTT activations.
TARGET_MEMORY_SHARE = 0.6


def target_weight_bytes(model: ModelConfig, itemsize: int) -> int:
    """The target's weights at `itemsize` bytes a parameter: model.total_params_b when set, else counted from
    the dims of a dense decoder (embeddings, attention, gated MLP, lm_head unless tied)."""
    if model.total_params_b > 0:
        return int(model.total_params_b * 1e9 * itemsize)
    h, heads, kv, d = model.hidden_size, model.num_attention_heads, model.num_key_value_heads, model.head_dim
    layer = h * d * (2 * heads + 2 * kv) + 3 * h * model.intermediate_size + 2 * h
    embeddings = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    return (model.num_layers * layer + embeddings + h) * itemsize
