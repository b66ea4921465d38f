"""Config schemas, their registration with Hydra, the checks after composition, and where things are."""

from eaglet.config.checks import check_config
from eaglet.config.registry import (
    ASSETS_DIR,
    CONF_DIR,
    REPO_ROOT,
    project_root,
    register_configs,
    shared_data_dir,
)

register_configs()

__all__ = [
    "ASSETS_DIR",
    "CONF_DIR",
    "REPO_ROOT",
    "check_config",
    "project_root",
    "register_configs",
    "shared_data_dir",
]
