"""Config schemas, their registration with Hydra, and helpers that derive values from a composed config."""

from eaglet.config.registry import CONF_DIR, PROJECT_ROOT, register_configs

register_configs()

__all__ = ["CONF_DIR", "PROJECT_ROOT", "register_configs"]
