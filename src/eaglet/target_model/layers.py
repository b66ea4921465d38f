"""Find the parts of a target model eaglet needs (decoder layers, final norm, lm_head, embeddings) in any wrapper."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from eaglet.errors import ConfigError

# Tried in order, relative to the object from_pretrained returns: plain CausalLMs first, then multimodal
# wrappers (Llava-style `model.language_model`, Kimi-K2.5-style `language_model.model`).
LAYER_PATHS = (
    "model.layers",
    "model.model.layers",
    "model.language_model.model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "language_model.layers",
)
_MAX_LISTED = 10


@dataclass
class TargetParts:
    layers: nn.ModuleList
    layer_path: str
    final_norm: nn.Module
    lm_head: nn.Module
    embed_tokens: nn.Embedding

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def find_target_parts(model: nn.Module, layer_path: str | None = None) -> TargetParts:
    """Locate the decoder layers (at `layer_path`, or the first of LAYER_PATHS present) and their neighbours."""
    path = _checked_layer_path(model, layer_path) if layer_path else _discover_layer_path(model)
    layers = model.get_submodule(path)
    parent_path = path.rpartition(".")[0]
    parent = model.get_submodule(parent_path)
    final_norm = getattr(parent, "norm", None)
    if not isinstance(final_norm, nn.Module):
        raise ConfigError(
            f"{type(model).__name__}: no final norm `{parent_path}.norm` next to the decoder layers at {path!r}; "
            "eaglet needs it to rebuild the teacher logits. Point model.layer_path=... at the layers whose "
            "parent holds the final norm"
        )
    return TargetParts(
        layers=layers,
        layer_path=path,
        final_norm=final_norm,
        lm_head=_find_lm_head(model, parent_path),
        embed_tokens=_find_embeddings(model, parent),
    )


def _checked_layer_path(model: nn.Module, layer_path: str) -> str:
    if not isinstance(_get_or_none(model, layer_path), nn.ModuleList):
        raise ConfigError(
            f"model.layer_path={layer_path!r} is not a ModuleList in {type(model).__name__}; "
            f"ModuleLists found: {_module_lists(model)}. Set model.layer_path to one of them "
            "(or null to discover it)"
        )
    return layer_path


def _discover_layer_path(model: nn.Module) -> str:
    for path in LAYER_PATHS:
        if isinstance(_get_or_none(model, path), nn.ModuleList):
            return path
    raise ConfigError(
        f"could not find the decoder layers of {type(model).__name__}: tried {list(LAYER_PATHS)}; "
        f"ModuleLists found: {_module_lists(model)}. Set model.layer_path=<dotted path of the decoder layers>"
    )


def _find_lm_head(model: nn.Module, parent_path: str) -> nn.Module:
    """`lm_head` on the outermost module that has one, walking from the model towards the layers' parent."""
    names = parent_path.split(".")
    for depth in range(len(names)):
        owner = model.get_submodule(".".join(names[:depth]))
        head = getattr(owner, "lm_head", None)
        if isinstance(head, nn.Module):
            return head
    raise ConfigError(
        f"{type(model).__name__}: no `lm_head` on the model or on the modules above {parent_path!r}; "
        "load the causal-LM class of the checkpoint (the one with a language-model head)"
    )


def _find_embeddings(model: nn.Module, parent: nn.Module) -> nn.Embedding:
    getter = getattr(model, "get_input_embeddings", None)
    embed = None
    if getter is not None:
        try:
            embed = getter()
        except NotImplementedError:  # wrappers that do not forward the call to their language model
            embed = None
    if not isinstance(embed, nn.Embedding):
        embed = getattr(parent, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding):
        raise ConfigError(
            f"{type(model).__name__}: no token embeddings from get_input_embeddings() or next to the decoder "
            "layers (`embed_tokens`)"
        )
    return embed


def _get_or_none(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _module_lists(model: nn.Module) -> list[str]:
    """Outermost ModuleLists of the model (lists nested in another list, such as experts, are left out)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(f"{f}.") for f in found):
            found.append(name)
    return found[:_MAX_LISTED] or ["none"]
