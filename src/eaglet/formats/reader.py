"""Load an EAGLE-3 draft head from a serving-format folder (config.json + model.safetensors, EAGLE3.md section 4).

Tensor names go through the mapping servers apply: a leading `model.` is stripped and `layers.0.` (other
exporters, vLLM's internal name) becomes our `midlayer.`. Unknown and missing names fail, since a server that
skips them silently serves random weights. `embed_tokens` may be absent (servers share the target's): then the
caller passes the target's embedding; `t2d` may be absent (servers ignore it): it is rebuilt from `d2t`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError, DataError
from eaglet.formats.folder import CONFIG_FILE, WEIGHTS_FILE, read_json_object
from eaglet.model.draft_head import Eagle3DraftHead

_REQUIRED_KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def _read_config(folder: Path) -> dict[str, Any]:
    return read_json_object(folder / CONFIG_FILE)


def flatten_speculators(config: dict[str, Any]) -> dict[str, Any]:
    """A speculators-format config seen as an EAGLE one: the layer's LlamaConfig plus the head's own fields."""
    if "speculators_model_type" not in config:
        return config
    layer = config.get("transformer_layer_config") or {}
    own = (
        "draft_vocab_size",
        "norm_before_residual",
        "eagle_aux_hidden_state_layer_ids",
        "target_hidden_size",
    )
    return {**layer, **{key: config[key] for key in own if key in config}}


def aux_layer_ids_of(config: dict[str, Any], where: str) -> list[int]:
    """`eagle_aux_hidden_state_layer_ids`, top level or inside `eagle_config`; required."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise DataError(
            f"{where}: no eagle_aux_hidden_state_layer_ids (top level or in eagle_config), got {ids!r}; add the "
            "target layer ids the head was trained on, e.g. [2, L//2, L-3]"
        )
    return ids


def draft_config_of(config: dict[str, Any], where: str) -> DraftConfig:
    missing = [key for key in _REQUIRED_KEYS if key not in config]
    wrong = [k for k in _REQUIRED_KEYS if k in config and not (isinstance(config[k], int) and config[k] > 0)]
    if wrong:
        raise DataError(f"{where}: {wrong} must be positive integers, got {[config[k] for k in wrong]}")
    if missing:
        raise DataError(f"{where}: missing keys {missing}")
    if config.get("num_hidden_layers", 1) != 1:
        raise DataError(
            f"{where}: num_hidden_layers={config['num_hidden_layers']}; an EAGLE-3 head has one layer"
        )
    heads = config["num_attention_heads"]
    return DraftConfig(
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", DraftConfig.rms_norm_eps),
        rope_theta=config.get("rope_theta", DraftConfig.rope_theta),
        max_position_embeddings=config.get("max_position_embeddings", DraftConfig.max_position_embeddings),
        norm_before_residual=config.get("norm_before_residual", False),
    )


def canonical_name(name: str) -> str:
    """The name of our head's tensor for a serving-format tensor name."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def _read_weights(folder: Path) -> dict[str, Tensor]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise DataError(f"{path} does not exist; the draft folder needs its weights next to config.json")
    try:
        raw = load_file(path)
    except SafetensorError as e:
        raise DataError(f"{path} is not a readable safetensors file: {e}") from e
    state: dict[str, Tensor] = {}
    for name, tensor in raw.items():
        ours = canonical_name(name)
        if ours in state:
            raise DataError(f"{path}: tensors {name!r} and another one both map to {ours!r}; keep one")
        state[ours] = tensor
    return state


def load_eagle_draft(
    folder: Path | str, *, embed_tokens: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> tuple[Eagle3DraftHead, DraftConfig, list[int]]:
    """(head in eval mode, its DraftConfig, its aux layer ids) from an EAGLE-format folder.

    embed_tokens [V, H]: the target's embedding, required when the folder ships none (and used only then).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(
            f"draft folder {folder} does not exist; export a trained head first (or fix the path)"
        )
    config = flatten_speculators(_read_config(folder))
    where = str(folder / CONFIG_FILE)
    aux_ids = aux_layer_ids_of(config, where)
    cfg = draft_config_of(config, where)
    vocab = config["vocab_size"]
    state = _read_weights(folder)
    try:
        head = Eagle3DraftHead(
            cfg,
            target_hidden_size=config.get("target_hidden_size", cfg.hidden_size),
            vocab_size=vocab,
            draft_vocab_size=config.get("draft_vocab_size", vocab),
            num_aux=len(aux_ids),
        )
    except ConfigError as e:  # the shape comes from the file: a fault of the data, not of a setting
        raise DataError(f"{where}: {e}") from e
    _fill_shared(state, head, embed_tokens, folder)
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    if "t2d" not in state:
        expected.pop("t2d")  # servers ignore it; rebuilt from d2t below
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    problems = [f"unknown tensors {unknown}"] * bool(unknown) + [f"missing tensors {missing}"] * bool(missing)
    problems += [
        f"{n}: shape {tuple(state[n].shape)}, expected {shape}"
        for n, shape in expected.items()
        if n in state and tuple(state[n].shape) != shape
    ]
    if problems:
        raise DataError(
            f"{folder / WEIGHTS_FILE} does not match {where}: {'; '.join(problems)}. Re-export the head, "
            "or fix config.json (sizes, vocab_size, draft_vocab_size, eagle_aux_hidden_state_layer_ids)"
        )
    state["t2d"] = _checked_t2d(state, vocab, folder / WEIGHTS_FILE)
    head.load_state_dict({n: t.to(head.state_dict()[n].dtype) for n, t in state.items()})
    return head.to(dtype).eval().requires_grad_(False), cfg, aux_ids


def _fill_shared(
    state: dict[str, Tensor], head: Eagle3DraftHead, embed_tokens: Tensor | None, folder: Path
) -> None:
    """embed_tokens from the caller; d2t as the identity when the draft vocab is the whole target vocab."""
    if "embed_tokens.weight" not in state:
        if embed_tokens is None:
            raise DataError(
                f"{folder / WEIGHTS_FILE} has no embed_tokens.weight; pass the target's input embedding "
                "(load_eagle_draft(..., embed_tokens=<target embedding weight>))"
            )
        state["embed_tokens.weight"] = embed_tokens.detach().cpu()
    if "d2t" not in state and head.d2t.numel() == head.t2d.numel():
        state["d2t"] = torch.zeros_like(head.d2t)


def _checked_t2d(state: dict[str, Tensor], vocab: int, where: Path) -> Tensor:
    """t2d as d2t implies it; a shipped t2d must agree."""
    target_ids = torch.arange(state["d2t"].numel()) + state["d2t"].to(torch.int64)
    if target_ids.numel() and not 0 <= int(target_ids.min()) <= int(target_ids.max()) < vocab:
        raise DataError(
            f"{where}: d2t maps draft ids outside the target vocab of {vocab} ids; re-export the head"
        )
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    if int(t2d.sum()) != target_ids.numel():
        raise DataError(f"{where}: d2t maps two draft ids to the same target id; re-export the head")
    if "t2d" in state and not torch.equal(state["t2d"].to(torch.bool), t2d):
        raise DataError(f"{where}: t2d does not mark exactly the target ids of d2t; re-export the head")
    return t2d
