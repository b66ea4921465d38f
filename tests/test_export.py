"""Export formats: EAGLE and speculators round trips, what validation rejects, and interop with `speculators`."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError, DataError
from eaglet.formats.contract import check_eagle_folder, check_speculators_folder
from eaglet.formats.reader import load_eagle_draft
from eaglet.formats.server_names import eagle_server_names
from eaglet.formats.speculators import speculators_name
from eaglet.formats.writer import export_eagle, export_speculators
from eaglet.model.attention import document_causal_mask
from eaglet.model.draft_head import Eagle3DraftHead

H, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, V, VD = 64, 4, 2, 16, 128, 1000, 200
AUX = [2, 15, 27]


def _config(**overrides) -> DraftConfig:
    shape = dict(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
    )
    return DraftConfig(**{**shape, **overrides})


def _head(
    cfg: DraftConfig,
    *,
    draft_vocab: int = VD,
    target_hidden: int = H,
    seed: int = 0,
    target: dict[str, Tensor] | None = None,
) -> Eagle3DraftHead:
    """A head with a real (random, sorted) draft vocab and every weight random, norms included; embeddings and
    lm_head rows from `target` (a Llama state dict) when given."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = Eagle3DraftHead(cfg, target_hidden_size=target_hidden, vocab_size=V, draft_vocab_size=draft_vocab)
    used = torch.randperm(V, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    if target is None:
        target = {
            "model.embed_tokens.weight": torch.randn(V, H, generator=gen),
            "lm_head.weight": torch.randn(V, H, generator=gen),
        }
    head.init_from_target(
        target["model.embed_tokens.weight"],
        target["lm_head.weight"],
        used - torch.arange(draft_vocab),
        t2d,
        lm_head_trainable=True,
    )
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
    return head


@pytest.fixture
def cfg() -> DraftConfig:
    return _config()


@pytest.fixture
def head(cfg: DraftConfig) -> Eagle3DraftHead:
    return _head(cfg)


@pytest.fixture
def eagle_dir(tmp_path: Path, head: Eagle3DraftHead, cfg: DraftConfig) -> Path:
    return export_eagle(head, cfg, tmp_path / "eagle", aux_layer_ids=AUX, dtype=torch.float32)


@pytest.fixture
def speculators_dir(tmp_path: Path, head: Eagle3DraftHead, cfg: DraftConfig) -> Path:
    return export_speculators(
        head, cfg, tmp_path / "spec", aux_layer_ids=AUX, ttt_steps=3, dtype=torch.float32
    )


# --- EAGLE format ---------------------------------------------------------------------------------------------


def test_eagle_round_trip(eagle_dir: Path, head: Eagle3DraftHead) -> None:
    config = check_eagle_folder(eagle_dir)
    assert (config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]) == (H, V, VD)
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    tensors = load_file(eagle_dir / "model.safetensors")
    assert tensors.keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensors[name], tensor), name


def test_eagle_names_map_as_vllm_loads_them(eagle_dir: Path) -> None:
    names = load_file(eagle_dir / "model.safetensors").keys()
    mapping = eagle_server_names(names, vocab_size=V, draft_vocab_size=VD)
    assert mapping["midlayer.self_attn.k_proj.weight"] == "model.layers.0.self_attn.qkv_proj.weight[k]"
    assert mapping["midlayer.mlp.up_proj.weight"] == "model.layers.0.mlp.gate_up_proj.weight[1]"
    assert mapping["midlayer.hidden_norm.weight"] == "model.layers.0.hidden_norm.weight"
    assert mapping["fc.weight"] == "model.fc.weight"
    assert mapping["lm_head.weight"] == "lm_head.weight"
    assert mapping["d2t"] == "draft_id_to_target_id"
    assert mapping["t2d"] is None


def _edit_tensors(folder: Path, edit: Callable[[dict[str, Tensor]], None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def _edit_config(folder: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


EAGLE_BREAKAGES = {
    "extra tensor": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({"midlayer.self_attn.q_norm.weight": torch.ones(HEAD_DIM)})
        ),
        "unknown tensor midlayer.self_attn.q_norm.weight",
    ),
    "missing tensor": (
        lambda f: _edit_tensors(f, lambda t: t.pop("midlayer.hidden_norm.weight")),
        "missing tensor midlayer.hidden_norm.weight",
    ),
    "wrong shape": (
        lambda f: _edit_tensors(f, lambda t: t.update({"fc.weight": torch.zeros(H, 2 * H)})),
        r"fc.weight: shape \(64, 128\), expected \(64, 192\)",
    ),
    "draft_vocab_size missing": (
        lambda f: _edit_config(f, lambda c: c.pop("draft_vocab_size")),
        "draft_vocab_size=None",
    ),
    "d2t outside the vocab": (
        lambda f: _edit_tensors(f, lambda t: t["d2t"].add_(V)),
        "d2t maps draft ids outside the target vocab",
    ),
    "layer id mismatch": (
        lambda f: _edit_config(
            f, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3])
        ),
        "eagle_config.eagle_aux_hidden_state_layer_ids differs",
    ),
}


@pytest.mark.parametrize("breakage", EAGLE_BREAKAGES)
def test_check_eagle_folder_rejects(eagle_dir: Path, breakage: str) -> None:
    corrupt, message = EAGLE_BREAKAGES[breakage]
    corrupt(eagle_dir)
    with pytest.raises(DataError, match=message):
        check_eagle_folder(eagle_dir)


def test_eagle_folder_without_embeddings_is_valid(
    tmp_path: Path, head: Eagle3DraftHead, cfg: DraftConfig
) -> None:
    folder = export_eagle(head, cfg, tmp_path / "eagle", aux_layer_ids=AUX, include_embed=False)
    assert "embed_tokens.weight" not in load_file(folder / "model.safetensors")


NAME_BREAKAGES = {
    "model. prefix": ({"fc.weight": "model.fc.weight"}, "drop the `model.` prefix"),
    "layers.0. name": (
        {"midlayer.mlp.down_proj.weight": "layers.0.mlp.down_proj.weight"},
        "name it midlayer.mlp.down_proj.weight",
    ),
    "unknown name": ({"norm.weight": "final_norm.weight"}, "final_norm.weight: unknown to the servers"),
    "missing shard": ({"midlayer.self_attn.v_proj.weight": None}, r"nothing loads .*qkv_proj.weight\[v\]"),
    "missing d2t": ({"d2t": None}, "nothing loads draft_id_to_target_id"),
}


@pytest.mark.parametrize("breakage", NAME_BREAKAGES)
def test_eagle_server_names_rejects(eagle_dir: Path, breakage: str) -> None:
    renames, message = NAME_BREAKAGES[breakage]
    names = [renames.get(n, n) for n in load_file(eagle_dir / "model.safetensors")]
    with pytest.raises(DataError, match=message):
        eagle_server_names([n for n in names if n is not None], vocab_size=V, draft_vocab_size=VD)


def test_full_vocab_head_needs_no_d2t() -> None:
    names = {"fc.weight", "norm.weight", "lm_head.weight"} | {
        f"midlayer.{m}.weight"
        for m in (
            "input_layernorm",
            "hidden_norm",
            "post_attention_layernorm",
            *(f"self_attn.{p}_proj" for p in "qkvo"),
            *(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
        )
    }
    assert "draft_id_to_target_id" not in eagle_server_names(names, vocab_size=V, draft_vocab_size=V).values()


# --- export folder handling -----------------------------------------------------------------------------------

EXPORTERS = {
    "eagle": lambda head, cfg, out, **kw: export_eagle(head, cfg, out, aux_layer_ids=AUX, **kw),
    "speculators": lambda head, cfg, out, **kw: export_speculators(
        head, cfg, out, aux_layer_ids=AUX, ttt_steps=3, **kw
    ),
}


@pytest.mark.parametrize("fmt", EXPORTERS)
def test_export_refuses_non_empty_folder(
    tmp_path: Path, head: Eagle3DraftHead, cfg: DraftConfig, fmt: str
) -> None:
    out = tmp_path / fmt
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"is not empty \(notes.txt\).*export.overwrite=true"):
        EXPORTERS[fmt](head, cfg, out)
    assert not (out / "model.safetensors").exists()
    EXPORTERS[fmt](head, cfg, out, overwrite=True)
    # A second export over the first one is the same refusal: the folder now holds a head.
    with pytest.raises(ConfigError, match="config.json"):
        EXPORTERS[fmt](head, cfg, out)
    assert (out / "notes.txt").read_text() == "keep me"


# --- speculators format ---------------------------------------------------------------------------------------


def test_speculators_round_trip(speculators_dir: Path, head: Eagle3DraftHead, cfg: DraftConfig) -> None:
    config = check_speculators_folder(speculators_dir)
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3DraftModel"]
    assert (config["draft_vocab_size"], config["norm_before_residual"]) == (VD, False)
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}
    layer = LlamaConfig(**config["transformer_layer_config"])
    assert (layer.hidden_size, layer.head_dim, layer.num_key_value_heads, layer.vocab_size) == (
        H,
        HEAD_DIM,
        2,
        V,
    )
    assert layer.rope_parameters["rope_theta"] == cfg.rope_theta and layer.num_hidden_layers == 1

    tensors = load_file(speculators_dir / "model.safetensors")
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(
        n.startswith("midlayer.") for n in tensors
    )
    assert tensors.keys() == {speculators_name(n) for n in head.state_dict()}
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensors[speculators_name(name)], tensor), name


def test_speculators_full_vocab_drops_vocab_buffers(tmp_path: Path, cfg: DraftConfig) -> None:
    folder = export_speculators(
        _head(cfg, draft_vocab=V), cfg, tmp_path / "spec", aux_layer_ids=AUX, ttt_steps=2
    )
    check_speculators_folder(folder)
    names = load_file(folder / "model.safetensors").keys()
    assert "d2t" not in names and "t2d" not in names and "lm_head.weight" in names


SPECULATORS_BREAKAGES = {
    "EAGLE name left": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({"midlayer.hidden_norm.weight": t.pop("layers.0.hidden_norm.weight")})
        ),
        "unknown tensor midlayer.hidden_norm.weight.*missing tensor layers.0.hidden_norm.weight",
    ),
    "wrong shape": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({"layers.0.self_attn.k_proj.weight": torch.zeros(H, 2 * H)})
        ),
        r"layers.0.self_attn.k_proj.weight: shape \(64, 128\), expected \(32, 128\)",
    ),
    "norm_before_residual missing": (
        lambda f: _edit_config(f, lambda c: c.pop("norm_before_residual")),
        "norm_before_residual=None",
    ),
    "embeddings missing": (
        lambda f: _edit_tensors(f, lambda t: t.pop("embed_tokens.weight")),
        "missing tensor embed_tokens.weight",
    ),
    "no speculative tokens": (
        lambda f: _edit_config(
            f, lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens")
        ),
        "speculative_tokens=None",
    ),
    "t2d dtype": (
        lambda f: _edit_tensors(f, lambda t: t.update({"t2d": t["t2d"].long()})),
        "t2d: dtype I64, expected BOOL",
    ),
}


@pytest.mark.parametrize("breakage", SPECULATORS_BREAKAGES)
def test_check_speculators_folder_rejects(speculators_dir: Path, breakage: str) -> None:
    corrupt, message = SPECULATORS_BREAKAGES[breakage]
    corrupt(speculators_dir)
    with pytest.raises(DataError, match=message):
        check_speculators_folder(speculators_dir)


def test_export_speculators_refuses_what_speculators_cannot_load(tmp_path: Path, cfg: DraftConfig) -> None:
    with pytest.raises(ConfigError, match="target hidden size 96 differs"):
        export_speculators(_head(cfg, target_hidden=96), cfg, tmp_path / "a", aux_layer_ids=AUX, ttt_steps=3)
    with pytest.raises(ConfigError, match="aux_layer_ids has 2 ids"):
        export_speculators(_head(cfg), cfg, tmp_path / "b", aux_layer_ids=[2, 15], ttt_steps=3)
    assert not any(tmp_path.iterdir())


# --- interop with the speculators package ---------------------------------------------------------------------


def _eaglet_logits(
    head: Eagle3DraftHead,
    aux: Tensor,
    input_ids: Tensor,
    document_ids: Tensor,
    position_ids: Tensor,
    steps: int,
) -> Tensor:
    """[steps, T, V_d] logits of the head unrolled as in training-time test (eaglet.train.ttt)."""
    mask = document_causal_mask(document_ids)
    embeds = head.embed_tokens(input_ids)
    hidden = head.fuse(aux)
    context_kv, diagonal_kv, logits = None, [], []
    for k in range(steps):
        shifted = torch.cat([embeds[k + 1 :], embeds.new_zeros(k + 1, embeds.shape[1])])
        hidden, kv = head.decoder_step(shifted, hidden, position_ids + k, mask, context_kv, diagonal_kv)
        if context_kv is None:
            context_kv = kv
        else:
            diagonal_kv.append(kv)
        logits.append(head.logits(hidden))
    return torch.stack(logits)


def _speculators_logits(
    folder: Path, aux: Tensor, input_ids: Tensor, document_ids: Tensor, position_ids: Tensor, steps: int
) -> Tensor:
    """The same through speculators' own loader and model (eager attention: its flex attention targets GPUs)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(folder, config=config).eval()
    assert model.lm_head.weight.dtype == torch.float32
    logits = []
    model.lm_head.register_forward_hook(lambda _module, _args, out: logits.append(out[0]))
    # speculators takes the input ids already shifted to the next token (its data pipeline does this).
    shifted = torch.cat([input_ids[1:], input_ids.new_zeros(1)])
    # Eagerly: speculators compiles its forward wherever CUDA is present, and inductor's CPU path failed to
    # build that kernel on a GPU machine (experiments/BENCHMARKS.md, "the conversion check failed to compile").
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        model(
            hidden_states=aux[None],
            input_ids=shifted[None],
            document_ids=document_ids[None],
            position_ids=position_ids[None],
            ttt_steps=steps,
        )
    return torch.stack(logits)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama target saved as a Hugging Face folder: speculators 0.9.0's `from_pretrained` reads
    the verifier's config (layer count, hidden size) and its embed_tokens / lm_head / final norm."""
    config = LlamaConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        vocab_size=V,
        num_hidden_layers=max(AUX) + 1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    folder = tmp_path_factory.mktemp("target")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.skipif(
    importlib.util.find_spec("speculators") is None,
    reason="the speculators package is not installed: pip install --no-deps -r requirements/speculators.txt",
)
@pytest.mark.parametrize(
    ("norm_before_residual", "draft_vocab"),
    [(False, VD), (True, V)],
    ids=["residual-before-norm", "residual-after-norm-full-vocab"],
)
def test_speculators_loads_export_with_identical_logits(
    tmp_path: Path, target_dir: Path, norm_before_residual: bool, draft_vocab: int
) -> None:
    cfg = _config(norm_before_residual=norm_before_residual)
    target = load_file(target_dir / "model.safetensors")
    head = _head(cfg, draft_vocab=draft_vocab, seed=3, target=target).eval()
    steps, lengths = 3, (9, 7)
    folder = export_speculators(
        head,
        cfg,
        tmp_path / "spec",
        aux_layer_ids=AUX,
        ttt_steps=steps,
        verifier_name_or_path=str(target_dir),
        dtype=torch.float32,
    )
    check_speculators_folder(folder)

    gen = torch.Generator().manual_seed(4)
    t = sum(lengths)
    aux = torch.randn(t, len(AUX) * H, generator=gen)
    input_ids = torch.randint(0, V, (t,), generator=gen)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        ours = _eaglet_logits(head, aux, input_ids, document_ids, position_ids, steps)
    theirs = _speculators_logits(folder, aux, input_ids, document_ids, position_ids, steps)

    assert theirs.shape == ours.shape == (steps, t, draft_vocab)
    for k in range(steps):
        # Step k at t reads tokens up to t + 1 + k; past the row's end the two pad differently.
        valid = t - 1 - k
        torch.testing.assert_close(theirs[k, :valid], ours[k, :valid], rtol=1e-4, atol=1e-4, msg=f"step {k}")
    assert ours.std() > 0.1  # random weights: the comparison is not between two near-constant tensors


def test_the_evaluator_loads_a_speculators_folder_as_a_baseline(
    speculators_dir: Path, head: Eagle3DraftHead
) -> None:
    loaded, _, aux_ids = load_eagle_draft(speculators_dir)
    assert aux_ids == AUX
    hidden = torch.randn(5, head.hidden_size)
    torch.testing.assert_close(loaded.logits(hidden), head.logits(hidden))  # fp32 on disk
    assert torch.equal(loaded.d2t, head.d2t)
