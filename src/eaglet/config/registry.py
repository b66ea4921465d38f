"""Registers the structured-config schema and the resolvers every composing process needs.

Two roots, kept apart so that several checkouts can share one virtualenv:
- REPO_ROOT, the checkout this code comes from: the config roots (conf/, sweeps/, experiments/) and the
  files shipped beside them; `${eaglet_repo:}` in the configs.
- the project root, where a run reads and writes: data/, outputs/, .cache/ and ../shared/data are looked
  for there; `${eaglet_root:}` in the configs. It is $EAGLET_ROOT when set, else the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from eaglet.config.schema import EagletConfig
from eaglet.config.trials import trial_name

# src/eaglet/config/registry.py -> the checkout's root, where conf/ and the entry scripts live.
REPO_ROOT = Path(__file__).resolve().parents[3]
CONF_DIR = REPO_ROOT / "conf"


def project_root() -> Path:
    """$EAGLET_ROOT, else the working directory (DDP children and submitit jobs inherit both)."""
    return Path(os.environ.get("EAGLET_ROOT") or os.getcwd()).resolve()


def register_configs() -> None:
    """Idempotent: entry points, tests and DDP children all call it before composing."""
    ConfigStore.instance().store(name="eaglet_schema", node=EagletConfig)
    if not OmegaConf.has_resolver("eaglet_root"):
        OmegaConf.register_new_resolver("eaglet_root", lambda: str(project_root()))
    if not OmegaConf.has_resolver("eaglet_repo"):
        OmegaConf.register_new_resolver("eaglet_repo", lambda: str(REPO_ROOT))
    if not OmegaConf.has_resolver("eaglet_trial"):
        # A multirun job's folder (hydra.sweep.subdir): its swept values, `ttt5-vocab8192`.
        OmegaConf.register_new_resolver("eaglet_trial", lambda *, _root_: trial_name(_root_.hydra))
