"""The composed config as plain data: what a run records (W&B's config, JSON reports)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from eaglet.config.schema import EagletConfig


def plain_config(cfg: EagletConfig) -> dict[str, Any]:
    """Resolved, with each choice as its string (not its enum member), so any reader can load it."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
