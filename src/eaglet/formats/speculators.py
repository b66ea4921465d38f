"""The speculators format: config.json + model.safetensors, as `speculators` (0.9.0) saves and loads an EAGLE-3 draft.

vLLM serves this format too (SGLang does not: export the EAGLE format for it, `eaglet.formats.eagle`).
The writer is `eaglet.formats.writer`, the check `eaglet.formats.contract`.

- config.json: `speculators_model_type: "eagle3"`, `architectures: ["Eagle3DraftModel"]`,
  `transformer_layer_config` (a LlamaConfig dict of the one draft layer; its `vocab_size` is the target's V),
  `draft_vocab_size`, `norm_before_residual` (always written: vLLM takes `true` when it is absent),
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `speculators_config` (algorithm, greedy proposal
  with `speculative_tokens`, default proposal method, verifier `name_or_path` and `architectures`) and
  `speculators_version`.
- Tensors: the EAGLE names (EAGLE3.md section 1) with `midlayer.` renamed `layers.0.`, as speculators'
  `Eagle3DraftModel` names its decoder layers. `d2t`/`t2d` are written only when the draft vocab is smaller
  than the target's: with V_d == V speculators registers no vocab buffers (they would be unexpected keys).
- speculators' `fc` reads `num_aux * hidden_size` features, so the target hidden size must equal the draft's.
- `embed_tokens` is always written. speculators means to fill a missing one from the verifier, but detects
  "missing" by a NaN fill that transformers' loader does not keep (seen with transformers 5.23): the model
  would embed with uninitialised memory.
- speculators 0.9.0's `Eagle3DraftModel.from_pretrained` reads the verifier's config (`AutoConfig` on
  `verifier.name_or_path`, even when it is null): give the target's folder or hub id to load the export there.
  vLLM does not read it.
"""

from __future__ import annotations

from typing import Any

import torch

from eaglet.config.schema import DraftConfig
from eaglet.formats.eagle import expected_shapes, llama_layer_config
from eaglet.model.draft_head import Eagle3DraftHead

# The speculators release whose loader this layout is tested against (tests/test_export.py).
SPECULATORS_VERSION = "0.9.0"
ARCHITECTURE = "Eagle3DraftModel"
ALGORITHM = "eagle3"
PROPOSAL_METHOD = "greedy"
EAGLE_LAYER_PREFIX, LAYER_PREFIX = "midlayer.", "layers.0."
VOCAB_BUFFERS = ("d2t", "t2d")


def speculators_name(eagle_name: str) -> str:
    """The speculators tensor name of an EAGLE-format name: `midlayer.` becomes `layers.0.`."""
    if eagle_name.startswith(EAGLE_LAYER_PREFIX):
        return LAYER_PREFIX + eagle_name.removeprefix(EAGLE_LAYER_PREFIX)
    return eagle_name


def uses_draft_vocab(head: Eagle3DraftHead) -> bool:
    return head.d2t.numel() != head.t2d.numel()


def expected_speculators_shapes(head: Eagle3DraftHead, cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes speculators' `Eagle3DraftModel` loads for this head's dimensions."""
    shapes = {
        speculators_name(name): shape
        for name, shape in expected_shapes(head, cfg, include_embed=True).items()
    }
    if not uses_draft_vocab(head):
        for name in VOCAB_BUFFERS:
            shapes.pop(name)
    return shapes


def transformer_layer_config(head: Eagle3DraftHead, cfg: DraftConfig) -> dict[str, Any]:
    """The LlamaConfig fields of the draft layer; RoPE both as `rope_parameters` (transformers 5) and `rope_theta`."""
    return {
        **llama_layer_config(head, cfg),
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
    }


def speculators_config(
    head: Eagle3DraftHead,
    cfg: DraftConfig,
    *,
    aux_layer_ids: list[int],
    target_architecture: str,
    ttt_steps: int,
    verifier_name_or_path: str | None,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """config.json of the speculators format; `ttt_steps` becomes the greedy proposal's `speculative_tokens`."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "speculators_model_type": ALGORITHM,
        "architectures": [ARCHITECTURE],
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": transformer_layer_config(head, cfg),
        "draft_vocab_size": head.d2t.numel(),
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": head.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,  # the name transformers < 5 (and servers built on it) read
        "speculators_config": {
            "algorithm": ALGORITHM,
            "proposal_methods": [
                {"proposal_type": PROPOSAL_METHOD, "speculative_tokens": ttt_steps, "verifier_accept_k": 1}
            ],
            "default_proposal_method": PROPOSAL_METHOD,
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": [target_architecture]},
        },
    }
