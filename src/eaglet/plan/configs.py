"""Config group files read outside a Hydra composition: hardware to compare, calibration references, the
deployments a sweep predicts for."""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

from omegaconf import OmegaConf

from eaglet.config import CONF_DIR
from eaglet.config.schema import DraftConfig, HardwareConfig, ModelConfig, PlanConfig
from eaglet.errors import ConfigError

T = TypeVar("T")


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def _load(group: str, name: str, schema: type[T]) -> T:
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"unknown {group} '{name}': choose one of {options(group)} (files in conf/{group}/)"
        )
    merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path))
    obj: Any = OmegaConf.to_object(merged)
    return obj


@cache
def load_hardware(name: str) -> HardwareConfig:
    return _load("hardware", name, HardwareConfig)


@cache
def load_model(name: str) -> ModelConfig:
    return _load("model", name, ModelConfig)


@cache
def load_draft(name: str) -> DraftConfig:
    return _load("draft", name, DraftConfig)


@cache
def default_plan() -> PlanConfig:
    """conf/plan/default.yaml: the planner's settings and calibration when no composed config is at hand."""
    return _load("plan", "default", PlanConfig)
