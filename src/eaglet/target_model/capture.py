"""Capture the hidden states eaglet stores: the residual stream entering chosen layers and the last layer's output.

Hooks on the decoder layers, rather than `output_hidden_states=True`: transformers' last entry of that tuple is
already after the final norm (EAGLE3.md section 2), and it keeps all L states alive at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eaglet.config.schema import ModelConfig
from eaglet.errors import ConfigError
from eaglet.target_model.layers import TargetParts


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def aux_layer_ids_out_of_range(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The ids outside [1, L-1]: each id k names the input of decoder layer k."""
    return [k for k in aux_layer_ids if not 1 <= k <= num_layers - 1]


def check_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Each id k names the input of decoder layer k, so it must be in [1, L-1]."""
    ids = [int(k) for k in aux_layer_ids]
    bad = aux_layer_ids_out_of_range(ids, num_layers)
    if not ids or bad:
        problem = f"ids {bad} are out of range" if bad else "the list is empty"
        raise ConfigError(
            f"model.aux_layer_ids={ids}: {problem} for a target with L={num_layers} layers; each id must be in "
            f"[1, {num_layers - 1}] (id k = the input of decoder layer k). Set model.aux_layer_ids=[...] "
            "(null = [2, L//2, L-3])"
        )
    return ids


def resolve_aux_layer_ids(cfg: ModelConfig) -> list[int]:
    """cfg.aux_layer_ids, or (2, L//2, L-3) when unset; validated against cfg.num_layers."""
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else default_aux_layer_ids(cfg.num_layers)
    return check_aux_layer_ids(ids, cfg.num_layers)


@dataclass
class CapturedBatch:
    aux_hidden_states: torch.Tensor  # [B, S, n_aux, H]: residual stream entering layer k, per aux id k
    last_hidden_state: torch.Tensor  # [B, S, H]: output of the last decoder layer, before the final norm


class HiddenStateCapture:
    """Context manager that hooks the layers; after a forward pass, `result()` holds that pass's states."""

    def __init__(self, parts: TargetParts, aux_layer_ids: Sequence[int]) -> None:
        self._layers = parts.layers
        self._aux_ids = check_aux_layer_ids(aux_layer_ids, len(parts.layers))
        # Layers run in order, so the lowest aux layer firing marks the start of a new forward pass.
        self._first_id = min(self._aux_ids)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._aux: torch.Tensor | None = None
        self._seen: set[int] = set()
        self._last: torch.Tensor | None = None

    def __enter__(self) -> HiddenStateCapture:
        for layer_id in sorted(set(self._aux_ids)):
            slots = [i for i, k in enumerate(self._aux_ids) if k == layer_id]
            hook = self._input_hook(layer_id, slots)
            self._handles.append(self._layers[layer_id].register_forward_pre_hook(hook, with_kwargs=True))
        self._handles.append(self._layers[-1].register_forward_hook(self._on_last_output))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def result(self) -> CapturedBatch:
        missing = sorted(set(self._aux_ids) - self._seen)
        if self._aux is None or missing or self._last is None:
            raise RuntimeError(
                f"hidden states incomplete (layers never run: {missing or 'last'}); run one forward pass of "
                "the model inside the `with HiddenStateCapture(...)` block"
            )
        return CapturedBatch(aux_hidden_states=self._aux, last_hidden_state=self._last)

    def _input_hook(self, layer_id: int, slots: list[int]):
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor):
                raise RuntimeError(
                    f"{type(module).__name__} (layer {layer_id}) was called without hidden states as its first "
                    "argument or as `hidden_states=`; eaglet cannot read its input"
                )
            if layer_id == self._first_id:
                batch, seq, width = hidden.shape
                self._aux = hidden.new_empty(batch, seq, len(self._aux_ids), width)
                self._seen.clear()
                self._last = None
            # A copy: the stored input must not change if a later layer updates its residual in place.
            for slot in slots:
                self._aux[:, :, slot].copy_(hidden.detach())
            self._seen.add(layer_id)

        return hook

    def _on_last_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple | list) else output
        self._last = hidden.detach()


@torch.inference_mode()
def capture_hidden_states(
    model: nn.Module,
    parts: TargetParts,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aux_layer_ids: Sequence[int],
    **forward_kwargs: Any,
) -> CapturedBatch:
    """Run the model once over a right-padded batch [B, S] and return its captured states.

    States at padded positions are meaningless; callers keep only each row's real (leading) positions.
    `attention_mask=None` runs the forward without a mask: under the causal mask a real token never attends to
    the pads after it and positions stay 0..n-1, so the states at real positions are those of the masked
    forward, and attention takes SDPA's mask-free (flash) path. It also spares the check below, which reads
    the mask on the host (a device sync for a mask on the GPU): callers that build right-padded rows
    themselves, like extraction, pass None. `forward_kwargs` go to the model's forward as they are (a packed
    row's position ids and document boundaries: eaglet.target_model.packed_attention).
    """
    if attention_mask is not None and (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
        raise ValueError("attention_mask must be right-padded (each row: ones, then zeros)")
    with HiddenStateCapture(parts, aux_layer_ids) as capture:
        direct = attention_mask is None and not forward_kwargs and _runs_layers_directly(model)
        if not (direct and _causal_layers(model, parts, input_ids)):
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=False,
                **_one_logit_kwargs(model),
                **forward_kwargs,
            )
    return capture.result()


# Decoders whose layers take (hidden, position_embeddings, position_ids) and attend causally through SDPA when
# given no mask: the Llama family.
_DIRECT_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def _runs_layers_directly(model: nn.Module) -> bool:
    """Whether `_causal_layers` computes what the model's own forward does without a mask (see there)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    full = all(t == "full_attention" for t in (getattr(config, "layer_types", None) or []))
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return (
        getattr(config, "model_type", None) in _DIRECT_ARCHITECTURES
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and full
        and not sliding
    )


def _causal_layers(model: nn.Module, parts: TargetParts, input_ids: torch.Tensor) -> bool:
    """The decoder layers over `input_ids` [B, S] without a mask (causal through SDPA's is_causal), skipping the
    final norm and head, whose outputs extraction does not use.

    transformers' own forward builds its causal mask first, and without a mask it looks for packed sequences in
    the position ids with a test read on the host: a device sync in every forward, which made extraction's next
    launch wait for the forward before it (measured on an H200, 2026-12-03).
    """
    parent = model.get_submodule(parts.layer_path.rpartition(".")[0])
    if not hasattr(parent, "rotary_emb"):
        return False  # the caller runs the model's own forward
    hidden = parts.embed_tokens(input_ids)
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
    position_embeddings = parent.rotary_emb(hidden, position_ids=position_ids)
    for layer in parts.layers:
        out = layer(
            hidden,
            attention_mask=None,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=None,
            use_cache=False,
        )
        hidden = out[0] if isinstance(out, tuple | list) else out
    return True


def _one_logit_kwargs(model: nn.Module) -> dict[str, int]:
    """Ask for the last position's logits only, so no [B, S, V] tensor is built, under whichever name applies."""
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def head_weights(parts: TargetParts) -> dict[str, torch.Tensor]:
    """CPU copies of the weights the draft head takes from the target (embeddings, final norm, lm_head)."""
    weights = {
        "embed_tokens.weight": parts.embed_tokens.weight,
        "norm.weight": parts.final_norm.weight,
        "lm_head.weight": parts.lm_head.weight,
    }
    return {name: w.detach().to("cpu", copy=True) for name, w in weights.items()}
