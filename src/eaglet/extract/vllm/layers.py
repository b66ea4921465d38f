"""eaglet's layer ids as vLLM's `eagle_aux_hidden_state_layer_ids`, and vLLM's stacked states back as eaglet's.

The conventions agree: in vLLM's decoder loops (llama-family `_maybe_add_hidden_state(..., idx + 1, ...)`
after layer idx, DeepSeek-V2 `idx in aux_hidden_state_layers` before layer idx) id k is `hidden_states +
residual` entering decoder layer k, i.e. eaglet's aux id k (= transformers' output_hidden_states[k]), and
id L (= num_hidden_layers) is the last layer's output *before* the final norm, i.e. eaglet's
last_hidden_state. So ids pass unchanged; what needs care is the order: vLLM appends states while it walks
the layers, so dim 1 of its `hidden_states` follows ascending layer order, one entry per distinct id,
whatever order the config lists them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eaglet.errors import DataError
from eaglet.target_model import check_aux_layer_ids


@dataclass(frozen=True)
class LayerLayout:
    """How eaglet's aux ids (any order, repeats allowed) map onto vLLM's captured states."""

    aux_layer_ids: tuple[int, ...]
    num_layers: int

    @classmethod
    def for_target(cls, aux_layer_ids: Sequence[int], num_layers: int) -> LayerLayout:
        return cls(tuple(check_aux_layer_ids(aux_layer_ids, num_layers)), num_layers)

    @property
    def vllm_layer_ids(self) -> list[int]:
        """What to pass as eagle_aux_hidden_state_layer_ids: distinct aux ids ascending, then L (pre-norm final)."""
        return [*sorted(set(self.aux_layer_ids)), self.num_layers]

    @property
    def aux_slots(self) -> list[int]:
        """For each eaglet aux slot, its index along dim 1 of vLLM's hidden_states."""
        position = {layer: i for i, layer in enumerate(self.vllm_layer_ids)}
        return [position[layer] for layer in self.aux_layer_ids]

    def split(self, hidden_states: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's [T, n_ids, H] into eaglet's aux [T, n_aux, H] (in eaglet's order) and last [T, H]."""
        expected = len(self.vllm_layer_ids)
        if hidden_states.ndim != 3 or hidden_states.shape[1] != expected:
            raise DataError(
                f"{where}: hidden_states has shape {list(hidden_states.shape)}, expected [T, {expected}, H] for "
                f"layer ids {self.vllm_layer_ids}; a vLLM that drops the final layer returns one state fewer "
                "(see the version table in the README), and a server started with other layer ids returns a "
                "different count: restart it with the command eaglet prints"
            )
        return hidden_states[:, self.aux_slots], hidden_states[:, -1]
