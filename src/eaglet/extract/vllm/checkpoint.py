"""What eaglet needs of the target's checkpoint when vLLM runs it: config dims and the head weights.

The weights are never loaded as a model here (a 1T-parameter INT4 target would not fit): config.json is
read as JSON and the embedding, final norm and lm_head are read by tensor name from the safetensors files.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open

from eaglet.config.schema import ModelConfig
from eaglet.errors import ConfigError, DataError
from eaglet.target_model import LAYER_PATHS, config_hash

_INDEX = "model.safetensors.index.json"
_HEAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{path} not found; model.path must be a Hugging Face folder with config.json"
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config.json."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def checkpoint_config_hash(config: dict[str, Any]) -> str:
    """The same hash eaglet records for a model loaded with transformers (target.config_hash)."""
    text = text_config(config)
    heads = text.get("num_attention_heads")
    dims = SimpleNamespace(
        architecture=config.get("model_type"),
        num_layers=text.get("num_hidden_layers"),
        hidden_size=text.get("hidden_size"),
        vocab_size=text.get("vocab_size"),
        num_attention_heads=heads,
        # transformers fills a missing num_key_value_heads with num_attention_heads.
        num_key_value_heads=text.get("num_key_value_heads", heads),
        intermediate_size=text.get("intermediate_size"),
    )
    return config_hash(dims)


def check_dims(cfg: ModelConfig, config: dict[str, Any]) -> None:
    text = text_config(config)
    for key, attr in (
        ("num_layers", "num_hidden_layers"),
        ("hidden_size", "hidden_size"),
        ("vocab_size", "vocab_size"),
    ):
        if text.get(attr) != getattr(cfg, key):
            raise ConfigError(
                f"model.{key}={getattr(cfg, key)} (model {cfg.name!r}) but {cfg.path}/config.json has "
                f"{attr}={text.get(attr)}; fix model.{key} or point model.path at the right checkpoint"
            )


def read_target_head(folder: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """embed_tokens.weight, norm.weight and lm_head.weight of the target, read by name from its safetensors."""
    files = _weight_files(Path(folder))
    base = _layers_parent(files, cfg.layer_path, folder)
    names = {
        "embed_tokens.weight": f"{base}.embed_tokens.weight",
        "norm.weight": f"{base}.norm.weight",
        "lm_head.weight": _lm_head_name(files, base, cfg.tie_word_embeddings, folder),
    }
    out = {}
    for key, name in names.items():
        if name not in files:
            raise DataError(
                f"{folder}: no tensor {name!r} (the target's {key}); eaglet reads the embedding, final norm and "
                "lm_head as plain tensors next to the decoder layers. Set model.layer_path to where the layers are"
            )
        with safe_open(files[name], framework="pt") as handle:
            tensor = handle.get_tensor(name)
        if tensor.dtype not in _HEAD_DTYPES:
            raise DataError(f"{files[name]}: {name} is stored as {tensor.dtype}; eaglet needs it unquantized")
        out[key] = tensor.contiguous()
    return out


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it."""
    index = folder / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: folder / file for name, file in weight_map.items()}
    files: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            files.update({name: path for name in handle.keys()})
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors files; model.path must hold the target's weights")
    return files


def _layers_parent(files: dict[str, Path], layer_path: str | None, folder: str | Path) -> str:
    candidates = [layer_path] if layer_path else list(LAYER_PATHS)
    for path in candidates:
        if any(name.startswith(f"{path}.0.") for name in files):
            return path.rpartition(".")[0]
    raise DataError(
        f"{folder}: no decoder layers under {candidates} in the checkpoint's tensor names; set "
        "model.layer_path=<prefix of the layers' tensor names>"
    )


def _lm_head_name(files: dict[str, Path], base: str, tied: bool, folder: str | Path) -> str:
    """The outermost `lm_head` from the top of the checkpoint down to the layers' parent (as on the model)."""
    owners = base.split(".")
    for depth in range(len(owners)):
        owner = ".".join(owners[:depth])
        name = f"{owner}.lm_head.weight" if owner else "lm_head.weight"
        if name in files:
            return name
    if tied:
        return f"{base}.embed_tokens.weight"
    raise DataError(
        f"{folder}: no lm_head.weight above {base!r} and model.tie_word_embeddings is false; the checkpoint is not "
        "a causal language model's"
    )
