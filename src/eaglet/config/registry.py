"""Registers the structured-config schema and the resolvers every composing process needs."""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from eaglet.config.schema import EagletConfig

# src/eaglet/config/registry.py -> the repository root, where conf/ and the entry scripts live.
PROJECT_ROOT = Path(__file__).resolve().parents[3]
CONF_DIR = PROJECT_ROOT / "conf"


def register_configs() -> None:
    """Idempotent: entry points, tests and DDP children all call it before composing."""
    ConfigStore.instance().store(name="eaglet_schema", node=EagletConfig)
    if not OmegaConf.has_resolver("eaglet_root"):
        OmegaConf.register_new_resolver("eaglet_root", lambda: str(PROJECT_ROOT))
