"""The target model: loading it, finding its parts in any wrapper, and capturing the hidden states eaglet stores."""

from eaglet.target_model.capture import (
    CapturedBatch,
    HiddenStateCapture,
    capture_hidden_states,
    check_aux_layer_ids,
    default_aux_layer_ids,
    head_weights,
    resolve_aux_layer_ids,
)
from eaglet.target_model.layers import LAYER_PATHS, TargetParts, find_target_parts
from eaglet.target_model.loader import (
    LoadedTarget,
    config_hash,
    load_target,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    tokenizer_hash,
)

__all__ = [
    "LAYER_PATHS",
    "CapturedBatch",
    "HiddenStateCapture",
    "LoadedTarget",
    "TargetParts",
    "capture_hidden_states",
    "check_aux_layer_ids",
    "config_hash",
    "default_aux_layer_ids",
    "find_target_parts",
    "head_weights",
    "load_target",
    "load_tokenizer",
    "resolve_aux_layer_ids",
    "resolve_device",
    "resolve_dtype",
    "tokenizer_hash",
]
