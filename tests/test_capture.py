"""Which hidden states eaglet captures: layer-id convention, pre-norm last state, padding, hook mechanics."""

from __future__ import annotations

import hydra
import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import eaglet.config
from eaglet.config.schema import ModelConfig
from eaglet.errors import ConfigError
from eaglet.target_model import (
    HiddenStateCapture,
    TargetParts,
    capture_hidden_states,
    find_target_parts,
    head_weights,
    resolve_aux_layer_ids,
)

VOCAB, HIDDEN, LAYERS = 96, 32, 4
AUX_IDS = [1, 2, 3]


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def random_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def manual_pre_norm_forward(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Embeddings through every decoder layer, stopping before the final norm (unpadded, causal)."""
    hidden = model.model.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    rope = model.model.rotary_emb(hidden, positions)
    for layer in model.model.layers:
        hidden = layer(hidden, attention_mask=None, position_embeddings=rope, position_ids=positions)
    return hidden


def test_aux_id_k_is_the_input_of_layer_k(llama: LlamaForCausalLM) -> None:
    parts = find_target_parts(llama)
    input_ids = random_ids(2, 9)
    mask = torch.ones_like(input_ids)
    captured = capture_hidden_states(llama, parts, input_ids, mask, AUX_IDS)
    assert captured.aux_hidden_states.shape == (2, 9, len(AUX_IDS), HIDDEN)
    with torch.no_grad():
        reference = llama(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for slot, layer_id in enumerate(AUX_IDS):
        torch.testing.assert_close(captured.aux_hidden_states[:, :, slot], reference[layer_id])


def test_last_state_is_before_the_final_norm(llama: LlamaForCausalLM) -> None:
    parts = find_target_parts(llama)
    input_ids = random_ids(1, 11, seed=1)
    captured = capture_hidden_states(llama, parts, input_ids, torch.ones_like(input_ids), AUX_IDS)
    with torch.no_grad():
        expected = manual_pre_norm_forward(llama, input_ids)
        output = llama(input_ids=input_ids, output_hidden_states=True)
        rebuilt_logits = parts.lm_head(parts.final_norm(captured.last_hidden_state))
    torch.testing.assert_close(captured.last_hidden_state, expected)
    torch.testing.assert_close(rebuilt_logits, output.logits)
    # The trap the hooks avoid: transformers' last output_hidden_states entry already went through the norm.
    torch.testing.assert_close(output.hidden_states[-1], parts.final_norm(captured.last_hidden_state))
    assert not torch.allclose(output.hidden_states[-1], captured.last_hidden_state)


def test_only_the_last_position_gets_logits(llama: LlamaForCausalLM) -> None:
    parts = find_target_parts(llama)
    shapes = []
    handle = parts.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    try:
        input_ids = random_ids(2, 6)
        capture_hidden_states(llama, parts, input_ids, torch.ones_like(input_ids), AUX_IDS)
    finally:
        handle.remove()
    assert shapes == [(2, 1, VOCAB)]


def test_right_padding_matches_unpadded_runs(llama: LlamaForCausalLM) -> None:
    parts = find_target_parts(llama)
    lengths = (10, 6)
    rows = [random_ids(1, n, seed=n) for n in lengths]
    input_ids = torch.zeros(2, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        input_ids[i, :n] = row[0]
        mask[i, :n] = 1
    batch = capture_hidden_states(llama, parts, input_ids, mask, AUX_IDS)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        single = capture_hidden_states(llama, parts, row, torch.ones_like(row), AUX_IDS)
        torch.testing.assert_close(batch.aux_hidden_states[i, :n], single.aux_hidden_states[0])
        torch.testing.assert_close(batch.last_hidden_state[i, :n], single.last_hidden_state[0])


def test_left_padding_is_refused(llama: LlamaForCausalLM) -> None:
    input_ids = random_ids(1, 4)
    with pytest.raises(ValueError, match="right-padded"):
        capture_hidden_states(
            llama, find_target_parts(llama), input_ids, torch.tensor([[0, 1, 1, 1]]), AUX_IDS
        )


class TupleLayer(nn.Module):
    """A layer called with `hidden_states=` that returns a tuple, as some remote-code models do."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        return hidden_states * self.scale + 1.0, None


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 3)
        self.layers = nn.ModuleList([TupleLayer(float(i + 2)) for i in range(4)])
        self.norm = nn.LayerNorm(3)
        self.lm_head = nn.Linear(3, 10)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden_states=hidden)[0]
        return self.lm_head(self.norm(hidden))


def test_keyword_inputs_tuple_outputs_and_repeated_ids() -> None:
    model = KeywordModel()
    parts = TargetParts(model.layers, "layers", model.norm, model.lm_head, model.embed_tokens)
    input_ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        inputs = [model.embed_tokens(input_ids)]
        for layer in model.layers:
            inputs.append(layer(inputs[-1])[0])
        with HiddenStateCapture(parts, [3, 1, 3]) as capture:
            model(input_ids)
    captured = capture.result()
    for slot, layer_id in enumerate([3, 1, 3]):
        torch.testing.assert_close(captured.aux_hidden_states[:, :, slot], inputs[layer_id])
    torch.testing.assert_close(captured.last_hidden_state, inputs[-1])


def test_hooks_are_removed_and_an_unrun_capture_fails(llama: LlamaForCausalLM) -> None:
    parts = find_target_parts(llama)

    def hook_counts() -> list[tuple[int, int]]:
        return [(len(layer._forward_pre_hooks), len(layer._forward_hooks)) for layer in parts.layers]

    before = hook_counts()
    with HiddenStateCapture(parts, AUX_IDS) as capture:
        assert hook_counts() != before
        with pytest.raises(RuntimeError, match="forward pass"):
            capture.result()
    assert hook_counts() == before


def test_capture_out_of_range_id_is_a_config_error(llama: LlamaForCausalLM) -> None:
    with pytest.raises(ConfigError, match="model.aux_layer_ids"):
        HiddenStateCapture(find_target_parts(llama), [0, 2])


def model_cfg(num_layers: int, aux_layer_ids: list[int] | None = None) -> ModelConfig:
    return OmegaConf.structured(ModelConfig(name="t", num_layers=num_layers, aux_layer_ids=aux_layer_ids))


@pytest.mark.parametrize(
    ("num_layers", "expected"), [(30, [2, 15, 27]), (32, [2, 16, 29]), (61, [2, 30, 58])]
)
def test_default_aux_ids(num_layers: int, expected: list[int]) -> None:
    assert resolve_aux_layer_ids(model_cfg(num_layers)) == expected


def test_explicit_aux_ids_are_kept_in_order() -> None:
    assert resolve_aux_layer_ids(model_cfg(12, [9, 1, 11])) == [9, 1, 11]


@pytest.mark.parametrize("bad", [[0, 2, 3], [2, 3, 12], []])
def test_aux_ids_out_of_range(bad: list[int]) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_aux_layer_ids(model_cfg(12, bad))
    message = str(err.value)
    assert "model.aux_layer_ids" in message and "L=12" in message and "[1, 11]" in message


@pytest.fixture
def compose_model():
    def compose(name: str):
        with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
            return hydra.compose("config", overrides=[f"model={name}"]).model

    yield compose
    GlobalHydra.instance().clear()


@pytest.mark.parametrize(("name", "expected"), [("tiny_llama", [2, 3, 3]), ("kimi_k2_5", [2, 30, 58])])
def test_aux_ids_of_shipped_configs(compose_model, name: str, expected: list[int]) -> None:
    assert resolve_aux_layer_ids(compose_model(name)) == expected


def test_head_weights_are_cpu_copies(llama: LlamaForCausalLM) -> None:
    parts = find_target_parts(llama)
    weights = head_weights(parts)
    assert set(weights) == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    assert weights["embed_tokens.weight"].shape == (VOCAB, HIDDEN)
    assert weights["lm_head.weight"].shape == (VOCAB, HIDDEN)
    assert weights["norm.weight"].shape == (HIDDEN,)
    torch.testing.assert_close(weights["lm_head.weight"], llama.lm_head.weight)
    assert all(w.device.type == "cpu" for w in weights.values())
    assert weights["norm.weight"].data_ptr() != llama.model.norm.weight.data_ptr()


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_mask_free_capture_runs_the_layers_itself_and_equals_the_models_forward(
    model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a mask, Llama-family targets skip transformers' forward (whose packed-sequence check syncs the
    device) for the layers alone; the states are exactly those of the model's own forward."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from eaglet.target_model import capture

    torch.manual_seed(1)
    dims = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = kinds[model_type]
    model = model_class(config_class(**dims, attn_implementation="sdpa")).eval().requires_grad_(False)
    parts = find_target_parts(model)
    input_ids = random_ids(3, 9, seed=4)
    called = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: called.append(1))
    direct = capture_hidden_states(model, parts, input_ids, None, AUX_IDS)
    assert not called  # the model's own forward did not run
    monkeypatch.undo()  # the model's own forward again
    monkeypatch.setattr(capture, "_runs_layers_directly", lambda model: False)
    through_forward = capture_hidden_states(model, parts, input_ids, None, AUX_IDS)
    assert torch.equal(direct.aux_hidden_states, through_forward.aux_hidden_states)
    assert torch.equal(direct.last_hidden_state, through_forward.last_hidden_state)
