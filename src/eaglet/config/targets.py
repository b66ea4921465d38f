"""Config entries built by Hydra from a `_target_` (callbacks, loggers): checked before any work, built by name.

`callbacks` and `logger` are plain mappings of name -> entry, so that `+callbacks.<name>._target_=...` adds one
from the command line; the schema cannot type their entries (every target takes its own arguments). Each entry
is checked here instead: a mapping with a `_target_` that imports (nested ones too), or null (switched off).
A wrong one fails with one message naming its key, not Hydra's traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from eaglet.errors import ConfigError

EXAMPLES = {
    "callbacks": "+callbacks.early_stop._target_=lightning.pytorch.callbacks.EarlyStopping",
    "logger": "+logger.tb._target_=lightning.pytorch.loggers.TensorBoardLogger",
}


def check_targets(cfg: Any, group: str) -> None:
    """Every entry of cfg.<group> is null or has a `_target_` that imports; a ConfigError names the key."""
    node = OmegaConf.select(cfg, group)
    for name, entry in (node or {}).items():
        key = f"{group}.{name}"
        if entry is None:
            continue
        if not isinstance(entry, (Mapping, DictConfig)) or "_target_" not in entry:
            raise ConfigError(
                f"{key} has no _target_: each entry of {group} names the class to build, e.g. "
                f"{EXAMPLES.get(group, f'+{key}._target_=package.module.Class')} (or {key}=null to switch "
                "it off)"
            )
        _check_nested(entry, key)


def _check_nested(node: Any, key: str) -> None:
    if isinstance(node, (Mapping, DictConfig)):
        if "_target_" in node:
            _check_import(str(node["_target_"]), f"{key}._target_")
        for child, value in node.items():
            if child != "_target_":
                _check_nested(value, f"{key}.{child}")
    elif isinstance(node, (list, tuple, ListConfig)):
        for i, value in enumerate(node):
            _check_nested(value, f"{key}[{i}]")


def _check_import(target: str, key: str) -> None:
    try:
        get_object(target)
    except Exception as exc:  # ImportError, AttributeError, ValueError: each says why in its last line
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{key}={target} does not import ({reason}); give the full dotted path of a class or function "
            "that is installed, e.g. lightning.pytorch.callbacks.EarlyStopping"
        ) from None


def build_entries(cfg: Any, group: str, kind: type) -> dict[str, Any]:
    """cfg.<group>'s entries built by Hydra, by name, in order; null entries and targets returning None are
    left out. Each built object must be a `kind` (a Lightning Callback, a Logger); a ConfigError names the key
    of one that fails to build or is something else."""
    check_targets(cfg, group)
    built = {}
    for name, entry in (OmegaConf.select(cfg, group) or {}).items():
        if entry is None:
            continue
        key = f"{group}.{name}"
        try:
            obj = instantiate(entry, _convert_="all")
        except InstantiationException as exc:  # its cause says why: a wrong keyword, a missing package, ...
            cause = exc.__cause__ or exc
            reason = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise ConfigError(
                f"{key} could not be built ({entry['_target_']}): {type(cause).__name__}: {reason}"
            ) from None
        if obj is None:  # a factory that has nothing to add here (W&B disabled)
            continue
        if not isinstance(obj, kind):
            raise ConfigError(
                f"{key}._target_={entry['_target_']} built a {type(obj).__name__}, not a {kind.__module__}."
                f"{kind.__name__}; point it at one"
            )
        built[str(name)] = obj
    return built
