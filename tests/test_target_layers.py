"""Finding the decoder layers, final norm, lm_head and embeddings of a target inside plain models and wrappers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import (
    CLIPVisionConfig,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from eaglet.errors import ConfigError
from eaglet.target_model import LAYER_PATHS, capture_hidden_states, find_target_parts

VOCAB, HIDDEN, LAYERS = 96, 32, 4


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )


class CausalLMWrapper(nn.Module):
    """Kimi-K2.5 style: the wrapper's `language_model` is a whole CausalLM (layers at language_model.model.layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.language_model = LlamaForCausalLM(tiny_llama_config())

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class BaseModelWrapper(nn.Module):
    """`language_model` is a bare LlamaModel and the lm_head sits on the wrapper (layers at language_model.layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.language_model = LlamaModel(tiny_llama_config())
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, **kwargs):
        hidden = self.language_model(
            input_ids=input_ids, attention_mask=attention_mask, **kwargs
        ).last_hidden_state
        return SimpleNamespace(logits=self.lm_head(hidden[:, -logits_to_keep:]))


class KimiK25Wrapper(nn.Module):
    """Kimi-K2.5's structure: a vision tower (with its own block list) and a projector beside a whole
    DeepSeek-V3 (MLA + MoE) CausalLM at `language_model`, so the decoder layers sit at language_model.model.layers."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = nn.Module()
        self.vision_tower.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.mm_projector = nn.Linear(16, HIDDEN)
        self.language_model = DeepseekV3ForCausalLM(
            DeepseekV3Config(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_hidden_layers=LAYERS,
                num_attention_heads=4,
                num_key_value_heads=4,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
            )
        )

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def tiny_llava() -> LlavaForConditionalGeneration:
    """A real transformers multimodal wrapper: layers at model.language_model.layers, beside a vision tower's."""
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    )
    return LlavaForConditionalGeneration(
        LlavaConfig(vision_config=vision, text_config=tiny_llama_config(), image_token_index=VOCAB - 1)
    )


# (builder, expected layer path, the module owning layers/norm/embed_tokens, the module owning lm_head)
STRUCTURES = {
    "llama": (lambda: LlamaForCausalLM(tiny_llama_config()), "model.layers", "model", ""),
    "causal_lm_wrapper": (
        CausalLMWrapper,
        "language_model.model.layers",
        "language_model.model",
        "language_model",
    ),
    "base_model_wrapper": (BaseModelWrapper, "language_model.layers", "language_model", ""),
    "llava": (tiny_llava, "model.language_model.layers", "model.language_model", ""),
    "kimi_k25": (KimiK25Wrapper, "language_model.model.layers", "language_model.model", "language_model"),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return STRUCTURES[name][0]().eval()


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_finds_the_parts_of_each_structure(name: str) -> None:
    model = build(name)
    _, path, base_path, head_owner = STRUCTURES[name]
    base = model.get_submodule(base_path)
    parts = find_target_parts(model)
    assert parts.layer_path == path
    assert parts.layers is base.layers
    assert parts.num_layers == LAYERS
    assert parts.final_norm is base.norm
    assert parts.embed_tokens is base.embed_tokens
    assert parts.lm_head is model.get_submodule(head_owner).lm_head


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_capture_works_on_each_structure(name: str) -> None:
    model = build(name)
    base = model.get_submodule(STRUCTURES[name][2])
    parts = find_target_parts(model)
    input_ids = torch.randint(0, VOCAB - 1, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(input_ids)
    captured = capture_hidden_states(model, parts, input_ids, mask, [1, 2, 3])
    with torch.no_grad():
        reference = base(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    for slot, layer_id in enumerate([1, 2, 3]):
        torch.testing.assert_close(captured.aux_hidden_states[:, :, slot], reference[layer_id])
    torch.testing.assert_close(parts.lm_head(parts.final_norm(captured.last_hidden_state)), logits)


def test_kimi_k2_5_config_points_at_the_wrapper_layers(compose) -> None:
    model = build("kimi_k25")
    parts = find_target_parts(model, compose("model=kimi_k2_5").model.layer_path)
    assert parts.layers is model.language_model.model.layers
    assert parts.final_norm is model.language_model.model.norm
    assert parts.lm_head is model.language_model.lm_head
    with pytest.raises(ConfigError, match="vision_tower.blocks"):  # listed among the ModuleLists it has
        find_target_parts(model, "model.layers")


def test_explicit_layer_path_is_used() -> None:
    model = build("causal_lm_wrapper")
    parts = find_target_parts(model, "language_model.model.layers")
    assert parts.layers is model.language_model.model.layers


def test_bad_layer_path_lists_what_exists() -> None:
    with pytest.raises(ConfigError) as err:
        find_target_parts(build("causal_lm_wrapper"), "model.layers")
    message = str(err.value)
    assert "model.layer_path='model.layers'" in message
    assert "language_model.model.layers" in message


def test_layer_path_to_a_non_list_is_rejected() -> None:
    with pytest.raises(ConfigError, match="not a ModuleList"):
        find_target_parts(build("llama"), "model.norm")


class Blocks(nn.Module):
    """Layers under a name eaglet does not try, and no final norm next to them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])


def test_nothing_found_tells_to_set_layer_path() -> None:
    with pytest.raises(ConfigError) as err:
        find_target_parts(Blocks())
    message = str(err.value)
    assert "model.layer_path=" in message
    assert all(path in message for path in LAYER_PATHS)
    assert "blocks" in message


def test_missing_final_norm_is_reported() -> None:
    with pytest.raises(ConfigError, match="final norm"):
        find_target_parts(Blocks(), "blocks")


def test_missing_lm_head_is_reported() -> None:
    with pytest.raises(ConfigError, match="lm_head"):
        find_target_parts(LlamaModel(tiny_llama_config()), "layers")
