"""Re-read an exported folder and check it against the serving contract, as the servers' loaders would see it.

`check_eagle_folder` and `check_speculators_folder` read config.json and the tensor headers of
model.safetensors (and the small d2t/t2d), rebuild the expected names and shapes from the config alone, and
raise one `DataError` listing every unknown, missing or mis-shaped tensor and every bad config field. An
EAGLE-format folder's tensor names also go through `eaglet.formats.server_names`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError, DataError
from eaglet.formats import eagle
from eaglet.formats.folder import CONFIG_FILE, WEIGHTS_FILE, read_json_object
from eaglet.formats.server_names import eagle_server_names
from eaglet.formats.speculators import ALGORITHM, expected_speculators_shapes
from eaglet.model.draft_head import Eagle3DraftHead

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
    """Check a speculators-format folder (see `eaglet.formats.speculators`); return its config."""
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
    # Every tensor is required: speculators does not reliably fill a missing embed_tokens (formats.speculators).
    problems = _check_tensors(path, expected_speculators_shapes(head, cfg), (), shapes, dtypes)
    problems += _check_vocab_map(vocab, dims["vocab_size"])
    _raise(folder, "speculators-format", problems)
    return config
