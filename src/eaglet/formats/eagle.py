"""The EAGLE serving format that vLLM and SGLang load: config.json + model.safetensors (EAGLE3.md section 4).

What the format holds for a head: its tensor names and shapes, and its config.json (a LlamaConfig of the one
draft layer plus the EAGLE fields). The writer is `eaglet.formats.writer`, the check `eaglet.formats.contract`.
"""

from __future__ import annotations

from typing import Any

import torch

from eaglet.config.schema import DraftConfig
from eaglet.model.draft_head import Eagle3DraftHead

ARCHITECTURE = "LlamaForCausalLMEagle3"


def expected_shapes(
    head: Eagle3DraftHead, cfg: DraftConfig, *, include_embed: bool
) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes a server expects for this head's dimensions."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    v, vd = head.t2d.numel(), head.d2t.numel()
    shapes = {
        "fc.weight": (h, head.num_aux * head.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (vd, h),
        "d2t": (vd,),
        "t2d": (v,),
    }
    if include_embed:
        shapes["embed_tokens.weight"] = (v, h)
    return shapes


def llama_layer_config(head: Eagle3DraftHead, cfg: DraftConfig) -> dict[str, Any]:
    """The LlamaConfig fields of the one draft layer; its `vocab_size` is the target's V. Both formats hold it."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": head.t2d.numel(),
        "tie_word_embeddings": False,
    }


def eagle_config(
    head: Eagle3DraftHead, cfg: DraftConfig, aux_layer_ids: list[int], dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """config.json of the EAGLE format: the layer's LlamaConfig plus the head's own fields."""
    return {
        "architectures": [ARCHITECTURE],
        **llama_layer_config(head, cfg),
        "target_hidden_size": head.target_hidden_size,
        "draft_vocab_size": head.d2t.numel(),
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }
