"""Re-read an exported folder and check it against the serving contract, as the servers' loaders would see it.

`check_eagle_folder` and `check_speculators_folder` read config.json and the tensor headers of
model.safetensors (and the small d2t/t2d), rebuild the expected names and shapes from the config alone, and
raise one `DataError` listing every unknown, missing or mis-shaped tensor and every bad config field.
`eagle_server_names` replays the name mapping vLLM applies to an EAGLE-format file, plus SGLang's constraint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError, DataError
from eaglet.export import eagle
from eaglet.export.speculators_format import (
    ALGORITHM,
    EAGLE_LAYER_PREFIX,
    LAYER_PREFIX,
    expected_speculators_shapes,
    refuse_non_empty,
)
from eaglet.model.draft_head import Eagle3DraftHead

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
# safetensors dtype codes of the vocab buffers; every other tensor must be floating point.
INT_DTYPES = {"d2t": "I64", "t2d": "BOOL"}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Servers take these from the target when absent (vLLM, SGLang) or ignore them (t2d).
SERVER_OPTIONAL = ("embed_tokens.weight", "t2d")
_DIMS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


def read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(
            f"{path} does not exist; point at an exported draft folder (config.json + model.safetensors)"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON (line {e.lineno}): {e.msg}") from e
    if not isinstance(config, dict):
        raise DataError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def _read_tensor_headers(
    path: Path,
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, torch.Tensor]]:
    """Shapes and dtype codes of every tensor (headers only), and the vocab buffers' values."""
    if not path.is_file():
        raise DataError(f"{path} does not exist; re-export the draft head")
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes, dtypes = {}, {}
            for name in f.keys():
                sliced = f.get_slice(name)
                shapes[name], dtypes[name] = tuple(sliced.get_shape()), sliced.get_dtype()
            vocab = {name: f.get_tensor(name) for name in INT_DTYPES if name in shapes}
    except SafetensorError as e:
        raise DataError(f"{path} is not a readable safetensors file ({e}); re-export the draft head") from e
    return shapes, dtypes, vocab


def _field(
    config: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, problems: list[str]
) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    value = config.get(key)
    # bool is an int subclass: a `true` must not pass as a size.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        problems.append(f"{where}{key}={value!r}, expected {' or '.join(k.__name__ for k in kinds)}")
        return None
    return value


def _aux_ids(config: dict[str, Any], where: str, problems: list[str]) -> list[int] | None:
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        problems.append(
            f"{where}eagle_aux_hidden_state_layer_ids={ids!r}, expected a non-empty list of layer ids"
        )
        return None
    return ids


def _meta_head(
    dims: dict[str, Any], config: dict[str, Any], aux_ids: list[int], folder: Path
) -> tuple[Eagle3DraftHead, DraftConfig]:
    """A weightless head of the folder's dimensions: the expected shapes come from the exporter's own contract."""
    cfg = DraftConfig(**{k: dims[k] for k in _DIMS if k != "vocab_size"})
    try:
        with torch.device("meta"):
            head = Eagle3DraftHead(
                cfg,
                target_hidden_size=config.get("target_hidden_size") or dims["hidden_size"],
                vocab_size=dims["vocab_size"],
                draft_vocab_size=config["draft_vocab_size"],
                num_aux=len(aux_ids),
            )
    except ConfigError as e:
        raise DataError(f"{folder / CONFIG_FILE}: inconsistent dimensions: {e}") from e
    return head, cfg


def _check_tensors(
    path: Path,
    expected: dict[str, tuple[int, ...]],
    optional: Iterable[str],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
) -> list[str]:
    optional = set(optional)
    problems = [f"unknown tensor {n}" for n in sorted(shapes) if n not in expected]
    problems += [f"missing tensor {n}" for n in expected if n not in shapes and n not in optional]
    for name, shape in expected.items():
        if name not in shapes:
            continue
        if shapes[name] != shape:
            problems.append(f"{name}: shape {shapes[name]}, expected {shape}")
        want = INT_DTYPES.get(name)
        if (want and dtypes[name] != want) or (not want and dtypes[name] not in FLOAT_DTYPES):
            problems.append(f"{name}: dtype {dtypes[name]}, expected {want or 'a float type'}")
    return [f"{path.name}: {p}" for p in problems]


def _check_vocab_map(vocab: dict[str, torch.Tensor], vocab_size: int) -> list[str]:
    """d2t must map draft ids to distinct, increasing target ids inside the vocab; t2d must mark exactly those."""
    if "d2t" not in vocab or vocab["d2t"].dtype != torch.int64:
        return []
    target_ids = torch.arange(vocab["d2t"].numel()) + vocab["d2t"]
    problems = []
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size):
        problems.append(f"d2t maps draft ids outside the target vocab [0, {vocab_size})")
    elif bool((target_ids[1:] <= target_ids[:-1]).any()):
        problems.append(
            "d2t target ids are not strictly increasing (draft ids must be target ids sorted by id)"
        )
    t2d = vocab.get("t2d")
    if not problems and t2d is not None and t2d.dtype == torch.bool and t2d.numel() == vocab_size:
        if int(t2d.sum()) != target_ids.numel() or not bool(t2d[target_ids].all()):
            problems.append("t2d does not mark exactly the target ids arange(V_d) + d2t")
    return [f"{WEIGHTS_FILE}: {p}" for p in problems]


def _raise(folder: Path, kind: str, problems: list[str]) -> None:
    if problems:
        raise DataError(
            f"{folder} is not a valid {kind} folder: {'; '.join(problems)}; re-export it with eaglet's exporter"
        )


def check_eagle_folder(folder: Path) -> dict[str, Any]:
    """Check an EAGLE-format folder (EAGLE3.md section 4) against the contract; return its config."""
    where = f"{CONFIG_FILE}: "
    config = read_json_object(folder / CONFIG_FILE)
    problems = []
    if config.get("architectures") != [eagle.ARCHITECTURE]:
        problems.append(
            f"{where}architectures={config.get('architectures')!r}, expected [{eagle.ARCHITECTURE!r}]"
        )
    if config.get("model_type") != "llama":
        problems.append(f"{where}model_type={config.get('model_type')!r}, expected 'llama'")
    if config.get("num_hidden_layers") != 1:
        problems.append(f"{where}num_hidden_layers={config.get('num_hidden_layers')!r}, expected 1")
    dims = {k: _field(config, k, int, where, problems) for k in _DIMS}
    for key in ("draft_vocab_size", "target_hidden_size", "max_position_embeddings"):
        _field(config, key, int, where, problems)
    for key in ("rms_norm_eps", "rope_theta"):
        _field(config, key, (int, float), where, problems)
    _field(config, "norm_before_residual", bool, where, problems)
    aux_ids = _aux_ids(config, where, problems)
    eagle_config = config.get("eagle_config")
    if not isinstance(eagle_config, dict) or eagle_config.get("use_aux_hidden_state") is not True:
        problems.append(f"{where}eagle_config must hold use_aux_hidden_state: true, got {eagle_config!r}")
    elif aux_ids is not None and eagle_config.get("eagle_aux_hidden_state_layer_ids") != aux_ids:
        problems.append(
            f"{where}eagle_config.eagle_aux_hidden_state_layer_ids differs from the top-level ids"
        )
    _raise(folder, "EAGLE-format", problems)

    head, cfg = _meta_head(dims, config, aux_ids, folder)
    path = folder / WEIGHTS_FILE
    shapes, dtypes, vocab = _read_tensor_headers(path)
    expected = eagle.expected_shapes(head, cfg, include_embed=True)
    problems = _check_tensors(path, expected, SERVER_OPTIONAL, shapes, dtypes)
    problems += _check_vocab_map(vocab, dims["vocab_size"])
    _raise(folder, "EAGLE-format", problems)
    eagle_server_names(shapes, vocab_size=dims["vocab_size"], draft_vocab_size=config["draft_vocab_size"])
    return config


def _check_speculators_config(spec: Any, where: str) -> list[str]:
    if not isinstance(spec, dict):
        return [f"{where}speculators_config={spec!r}, expected an object"]
    problems = []
    if spec.get("algorithm") != ALGORITHM:
        problems.append(
            f"{where}speculators_config.algorithm={spec.get('algorithm')!r}, expected {ALGORITHM!r}"
        )
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not all(isinstance(m, dict) for m in methods):
        problems.append(f"{where}speculators_config.proposal_methods={methods!r}, expected a non-empty list")
        return problems
    tokens = methods[0].get("speculative_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        problems.append(f"{where}proposal_methods[0].speculative_tokens={tokens!r}, expected an int >= 1")
    if spec.get("default_proposal_method") not in [m.get("proposal_type") for m in methods]:
        problems.append(
            f"{where}speculators_config.default_proposal_method={spec.get('default_proposal_method')!r} "
            "is not the proposal_type of any proposal method"
        )
    verifier = spec.get("verifier")
    if (
        not isinstance(verifier, dict)
        or "name_or_path" not in verifier
        or not isinstance(verifier["name_or_path"], str | None)
        or not isinstance(verifier.get("architectures"), list)
    ):
        problems.append(
            f"{where}speculators_config.verifier={verifier!r}, expected name_or_path (string or null) "
            "and architectures (list)"
        )
    return problems


def check_speculators_folder(folder: Path) -> dict[str, Any]:
    """Check a speculators-format folder (see `eaglet.export.speculators_format`); return its config."""
    where = f"{CONFIG_FILE}: "
    config = read_json_object(folder / CONFIG_FILE)
    problems = []
    if config.get("speculators_model_type") != ALGORITHM:
        problems.append(
            f"{where}speculators_model_type={config.get('speculators_model_type')!r}, expected 'eagle3'"
        )
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        problems.append(f"{where}architectures={architectures!r}, expected a non-empty list")
    _field(config, "speculators_version", str, where, problems)
    _field(config, "draft_vocab_size", int, where, problems)
    # vLLM takes norm_before_residual=true when the key is absent: it must be explicit.
    _field(config, "norm_before_residual", bool, where, problems)
    aux_ids = _aux_ids(config, where, problems)
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if config.get(flag, False) is not False:
            problems.append(
                f"{where}{flag}={config[flag]!r}: an eaglet head has no such variant, expected false"
            )
    layer = config.get("transformer_layer_config")
    dims: dict[str, Any] = {}
    if not isinstance(layer, dict):
        problems.append(f"{where}transformer_layer_config={layer!r}, expected a LlamaConfig object")
    else:
        lwhere = f"{where}transformer_layer_config."
        if layer.get("model_type") != "llama":
            problems.append(f"{lwhere}model_type={layer.get('model_type')!r}, expected 'llama'")
        if layer.get("num_hidden_layers") != 1:
            problems.append(f"{lwhere}num_hidden_layers={layer.get('num_hidden_layers')!r}, expected 1")
        dims = {k: _field(layer, k, int, lwhere, problems) for k in _DIMS}
        target_hidden = config.get("target_hidden_size")
        if target_hidden is not None and target_hidden != dims["hidden_size"]:
            problems.append(
                f"{where}target_hidden_size={target_hidden!r} differs from hidden_size={dims['hidden_size']!r}; "
                "speculators' fc reads num_aux * hidden_size features"
            )
    spec = config.get("speculators_config")
    problems += _check_speculators_config(spec, where)
    _raise(folder, "speculators-format", problems)

    head, cfg = _meta_head(dims, config, aux_ids, folder)
    path = folder / WEIGHTS_FILE
    shapes, dtypes, vocab = _read_tensor_headers(path)
    # Every tensor is required: speculators does not reliably fill a missing embed_tokens (speculators_format).
    problems = _check_tensors(path, expected_speculators_shapes(head, cfg), (), shapes, dtypes)
    problems += _check_vocab_map(vocab, dims["vocab_size"])
    _raise(folder, "speculators-format", problems)
    return config


# vLLM's Eagle3LlamaForCausalLM parameters an EAGLE file loads into, with the shards of its stacked ones.
VLLM_PARAMS: dict[str, tuple[str | int, ...]] = {
    "model.embed_tokens.weight": (),
    "model.fc.weight": (),
    "model.layers.0.input_layernorm.weight": (),
    "model.layers.0.hidden_norm.weight": (),
    "model.layers.0.self_attn.qkv_proj.weight": ("q", "k", "v"),
    "model.layers.0.self_attn.o_proj.weight": (),
    "model.layers.0.post_attention_layernorm.weight": (),
    "model.layers.0.mlp.gate_up_proj.weight": (0, 1),
    "model.layers.0.mlp.down_proj.weight": (),
    "model.norm.weight": (),
    "lm_head.weight": (),
    "draft_id_to_target_id": (),
}
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def _vllm_target(name: str) -> tuple[str, str | int | None] | None:
    """(parameter, shard) vLLM loads `name` into; None for names it drops (t2d)."""
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id", None
    param = (
        name if name.startswith("lm_head.") else "model." + name.replace(EAGLE_LAYER_PREFIX, LAYER_PREFIX, 1)
    )
    for part, (stacked, shard) in _STACKED.items():
        if part in param:
            return param.replace(part, stacked), shard
    return param, None


def eagle_server_names(
    names: Iterable[str], *, vocab_size: int, draft_vocab_size: int
) -> dict[str, str | None]:
    """Map each tensor name of an EAGLE-format file to the vLLM parameter it loads into; fail on any name a
    server would drop, misplace or miss.

    vLLM (`Eagle3LlamaForCausalLM.load_weights` in `llama_eagle3.py`): drops names containing `t2d`; renames
    `d2t` to the top-level `draft_id_to_target_id`; keeps `lm_head.*`; prefixes every other name with
    `model.`; then its `LlamaModel.load_weights` replaces `midlayer.` by `layers.0.`, stacks `q/k/v_proj` into
    `qkv_proj` (shards q, k, v) and `gate/up_proj` into `gate_up_proj` (shards 0, 1), and looks the result up
    among its parameters: an unknown name raises, but a missing one goes unnoticed (no `d2t` silently keeps the
    identity map; no `embed_tokens` shares the target's, which is fine).
    SGLang (`LlamaForCausalLMEagle3.load_weights`) names the layer `midlayer` itself, turns `d2t` into its hot
    token ids, drops `t2d`, and silently skips every name it does not know. So a file both serve uses the
    `midlayer.` names without a `model.` prefix: a `layers.0.` or `model.` name loads in one server and is
    skipped (random weights) or fails in the other.

    Returns {file name: "param" or "param[shard]", or None for t2d}. `embed_tokens` is optional; `d2t` is
    required when the draft vocab is smaller than the target's.
    """
    mapping: dict[str, str | None] = {}
    loaded: dict[str, set] = {}
    problems = []
    for name in sorted(names):
        if name.startswith("model."):
            problems.append(f"{name}: drop the `model.` prefix (vLLM would look up model.{name})")
            continue
        if name.startswith(LAYER_PREFIX):
            problems.append(
                f"{name}: name it {EAGLE_LAYER_PREFIX}{name.removeprefix(LAYER_PREFIX)} (SGLang skips it)"
            )
            continue
        target = _vllm_target(name)
        if target is None:
            mapping[name] = None
            continue
        param, shard = target
        if param not in VLLM_PARAMS or (shard is not None and shard not in VLLM_PARAMS[param]):
            problems.append(f"{name}: unknown to the servers (vLLM has no parameter {param})")
            continue
        loaded.setdefault(param, set()).add(shard)
        mapping[name] = param if shard is None else f"{param}[{shard}]"
    optional = {"model.embed_tokens.weight"}
    if draft_vocab_size == vocab_size:
        optional.add("draft_id_to_target_id")
    for param, shards in VLLM_PARAMS.items():
        missing = set(shards or (None,)) - loaded.get(param, set())
        if param in loaded or param not in optional:
            problems += [
                f"nothing loads {param}" + (f"[{s}]" if s is not None else "")
                for s in sorted(missing, key=str)
            ]
    if problems:
        raise DataError(
            f"EAGLE-format tensor names the servers would not load as intended: {'; '.join(problems)}"
        )
    return mapping


def export_eagle_checked(
    head: Eagle3DraftHead,
    cfg: DraftConfig,
    out_dir: Path,
    *,
    aux_layer_ids: list[int],
    include_embed: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """`eaglet.export.eagle.export_eagle` into an empty folder (or over one, with `overwrite`), then re-read
    and check what was written."""
    refuse_non_empty(out_dir, overwrite=overwrite)
    eagle.export_eagle(
        head, cfg, out_dir, aux_layer_ids=aux_layer_ids, include_embed=include_embed, dtype=dtype
    )
    check_eagle_folder(out_dir)
    return out_dir
