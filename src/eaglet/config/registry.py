"""Registers the structured-config schema and the resolvers every composing process needs.

Where things are, kept apart so that several checkouts can share one virtualenv and an installed package
works from any directory:
- CONF_DIR, the config groups (conf/ inside the package: model, dataset, ..., experiments, sweeps), and
  ASSETS_DIR, the data files shipped with the package (`${eaglet_assets:}` in the configs); both come with
  the code, in a checkout as in an installed wheel.
- REPO_ROOT, the source checkout this code comes from (entry scripts, benchmarks, experiment reports);
  `${eaglet_repo:}` in the configs. An installed package has none: use ${eaglet_assets:} for shipped files.
- the project root, where a run reads and writes: data/, outputs/ and .cache/ are there; `${eaglet_root:}` in
  the configs. It is $EAGLET_ROOT when set, else the working directory.
- the shared prompts, `${eaglet_shared_data:}`: see shared_data_dir().
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
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


def shared_data_dir(root: Path | None = None, checkout: Path = REPO_ROOT) -> Path:
    """The first `../shared/data` that exists: beside the project root, beside this checkout, or beside the
    local repository this checkout was cloned from (a clone made elsewhere still finds the prompts).
    None exists: the one beside the project root, so that the error names where they were expected."""
    candidates = [(root or project_root()) / "../shared/data", checkout / "../shared/data"]
    origin = _local_origin(checkout)
    if origin is not None:
        candidates.append(origin / "../shared/data")
    found = next((path for path in candidates if path.is_dir()), candidates[0])
    return Path(os.path.normpath(found))


@cache
def _local_origin(checkout: Path) -> Path | None:
    """The folder `git remote get-url origin` names when it is a path on this machine; None otherwise."""
    try:
        url = subprocess.run(
            ["git", "-C", str(checkout), "config", "--get", "remote.origin.url"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git: nothing to fall back on
        return None
    url = url.removeprefix("file://")
    if not url or "://" in url or ":" in url.split("/")[0]:  # https://..., ssh://..., git@host:path
        return None
    origin = (checkout / url).resolve()
    return origin if origin.is_dir() else None


def register_configs() -> None:
    """Idempotent: entry points, tests and DDP children all call it before composing."""
    ConfigStore.instance().store(name="eaglet_schema", node=EagletConfig)
    resolvers = {
        "eaglet_root": lambda: str(project_root()),
        "eaglet_repo": lambda: str(REPO_ROOT),
        "eaglet_assets": lambda: str(ASSETS_DIR),
        "eaglet_shared_data": lambda: str(shared_data_dir()),
        # A multirun job's folder (hydra.sweep.subdir): its swept values, `ttt5-vocab8192`.
        "eaglet_trial": lambda *, _root_: trial_name(_root_.hydra),
    }
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
