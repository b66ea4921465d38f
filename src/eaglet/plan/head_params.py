"""Parameter counts of the EAGLE-3 head (eaglet.model.draft_head), for the training and serving estimates."""

from __future__ import annotations

from eaglet.config.schema import DraftConfig


def fc_params(num_aux: int, target_hidden: int, draft: DraftConfig) -> int:
    """fc fuses the n_aux target hidden states into one draft hidden state."""
    return num_aux * target_hidden * draft.hidden_size


def kv_projection_params(draft: DraftConfig) -> int:
    """k and v read cat(norm(embed), norm(hidden)) (2·H inputs)."""
    return 2 * draft.hidden_size * 2 * draft.num_key_value_heads * draft.head_dim


def decoder_layer_params(draft: DraftConfig) -> int:
    """q, k, v read cat(norm(embed), norm(hidden)) (2·H inputs); o; gate, up and down of the MLP."""
    q = 2 * draft.hidden_size * draft.num_attention_heads * draft.head_dim
    out = draft.num_attention_heads * draft.head_dim * draft.hidden_size
    return q + kv_projection_params(draft) + out + 3 * draft.hidden_size * draft.intermediate_size


def lm_head_params(draft: DraftConfig, draft_vocab_size: int) -> int:
    return draft.hidden_size * draft_vocab_size
