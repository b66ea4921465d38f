"""The evaluation prompt sets of eval.set_defs, each checked against EvalSetConfig with its defaults filled in.

The schema types eval.set_defs as a plain mapping, not as a mapping of EvalSetConfig: OmegaConf refuses to
create a new structured entry from the command line, so `+eval.set_defs.z.path=/x.jsonl` would fail on
its type. Each entry is checked here instead (keys, types, ranges), by check_config and by every reader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eaglet.config.bounds import at_least
from eaglet.config.schema import EvalConfig, EvalSetConfig
from eaglet.errors import ConfigError

SET_KEYS = tuple(f.name for f in dataclasses.fields(EvalSetConfig))


def eval_set_defs(ev: EvalConfig) -> dict[str, EvalSetConfig]:
    """Every prompt set of eval.set_defs, checked, by name."""
    return {str(name): eval_set(str(name), spec) for name, spec in ev.set_defs.items()}


def eval_set(name: str, spec: Any) -> EvalSetConfig:
    """One entry of eval.set_defs as an EvalSetConfig; a ConfigError names the wrong key."""
    key = f"eval.set_defs.{name}"
    if isinstance(spec, EvalSetConfig):
        values = dataclasses.asdict(spec)
    elif OmegaConf.is_dict(spec):
        values = OmegaConf.to_container(spec, resolve=True)  # the node's root resolves ${paths.shared_data}
    elif isinstance(spec, Mapping):
        values = dict(spec)
    else:
        raise ConfigError(
            f"{key} must be a prompt set with keys {', '.join(SET_KEYS)}, got {spec!r}; add one with "
            f"+{key}.path=/data/prompts.jsonl (and optionally +{key}.skip=... +{key}.count=...)"
        )
    unknown = sorted(set(values) - set(SET_KEYS))
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]} is not a setting of a prompt set; its keys: {', '.join(SET_KEYS)}"
        )
    if values.get("path") in (None, "", "???"):  # "???": OmegaConf's mark of a value never set
        raise ConfigError(
            f"{key}.path is not set: give the set's JSONL file, +{key}.path=/data/prompts.jsonl"
        )
    try:
        checked = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalSetConfig), values))
    except OmegaConfBaseException as exc:  # a value of the wrong type
        raise ConfigError(f"{key}.{exc.full_key}: {str(exc).splitlines()[0]}") from None
    at_least(key, {"skip": checked.skip}, 0)
    at_least(key, {"count": checked.count}, 1, hint=f" (the prompts taken from {checked.path})")
    return checked
