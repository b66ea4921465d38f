"""The EAGLE serving format that vLLM and SGLang load: config.json + model.safetensors (EAGLE3.md section 4)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglet.config.schema import DraftConfig
from eaglet.errors import DataError
from eaglet.fsutil import atomic_output, atomic_write_bytes
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


def contract_problems(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Unexpected, missing and mis-shaped tensors of `state` against the expected names and shapes."""
    problems = [f"unexpected tensor {n}" for n in state if n not in expected]
    problems += [f"missing tensor {n}" for n in expected if n not in state]
    problems += [
        f"{n}: shape {tuple(state[n].shape)}, expected {shape}"
        for n, shape in expected.items()
        if n in state and tuple(state[n].shape) != shape
    ]
    return problems


def eagle_config(
    head: Eagle3DraftHead, cfg: DraftConfig, aux_layer_ids: list[int], dtype: torch.dtype = torch.bfloat16
) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": head.target_hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "vocab_size": head.t2d.numel(),
        "draft_vocab_size": head.d2t.numel(),
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def export_eagle(
    head: Eagle3DraftHead,
    cfg: DraftConfig,
    out_dir: Path,
    *,
    aux_layer_ids: list[int],
    include_embed: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write the head as an EAGLE-format folder; refuses tensors that break the name/shape contract."""
    state = {name: t.detach().cpu() for name, t in head.state_dict().items()}
    if not include_embed:
        state.pop("embed_tokens.weight", None)
    expected = expected_shapes(head, cfg, include_embed=include_embed)
    problems = contract_problems(state, expected)
    if problems:
        raise DataError(f"refusing to export a head that breaks the serving contract: {'; '.join(problems)}")
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in state.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_output(out_dir / "model.safetensors") as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    config = eagle_config(head, cfg, aux_layer_ids, dtype)
    atomic_write_bytes(out_dir / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return out_dir
