"""Registers the structured-config schema and the resolvers every composing process needs.

Where things are, kept apart so that several checkouts can share one virtualenv and an installed package
works from any directory:
- CONF_DIR, the config groups (conf/ inside the package: model, dataset, ..., experiments, sweeps), and
  ASSETS_DIR, the data files shipped with the package (`${eaglet_assets:}` in the configs); both come with
  the code, in a checkout as in an installed wheel.
- REPO_ROOT, the source checkout this code comes from (entry scripts, benchmarks, experiment reports);
  `${eaglet_repo:}` in the configs. An installed package has none: use ${eaglet_assets:} for shipped files.
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

PACKAGE_DIR = Path(__file__).resolve().parents[1]
CONF_DIR = PACKAGE_DIR / "conf"
ASSETS_DIR = PACKAGE_DIR / "assets"
# src/eaglet/config/registry.py -> the checkout's root, where the entry scripts live.
REPO_ROOT = Path(__file__).resolve().parents[3]


def project_root() -> Path:
    """$EAGLET_ROOT, else the working directory (DDP children and submitit jobs inherit both)."""
    return Path(os.environ.get("EAGLET_ROOT") or os.getcwd()).resolve()


def register_configs() -> None:
    """Idempotent: entry points, tests and DDP children all call it before composing."""
    ConfigStore.instance().store(name="eaglet_schema", node=EagletConfig)
    resolvers = {
        "eaglet_root": lambda: str(project_root()),
        "eaglet_repo": lambda: str(REPO_ROOT),
        "eaglet_assets": lambda: str(ASSETS_DIR),
        # A multirun job's folder (hydra.sweep.subdir): its swept values, `ttt5-vocab8192`.
        "eaglet_trial": lambda *, _root_: trial_name(_root_.hydra),
    }
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
