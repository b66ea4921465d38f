"""plan.py's stage: size the data, plan every hardware asked for, print the tables and the verdict."""

from __future__ import annotations

from eaglet.config.schema import EagletConfig, HardwareConfig
from eaglet.errors import ConfigError
from eaglet.plan.acceptance import acceptance_curve
from eaglet.plan.configs import load_hardware, options
from eaglet.plan.data_size import estimate_data_size
from eaglet.plan.planner import HardwarePlan, plan_hardware
from eaglet.plan.report import print_plan


def hardware_to_compare(cfg: EagletConfig) -> list[HardwareConfig]:
    """plan.compare by name (the composed `hardware`, with its overrides, where it is one of them)."""
    names = list(cfg.plan.compare)
    if not names:
        return [cfg.hardware]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"plan.compare lists {twice} more than once; list each hardware once")
    return [cfg.hardware if name == cfg.hardware.name else load_hardware(name) for name in names]


def has_datasheet(hardware: HardwareConfig) -> bool:
    return hardware.bf16_tflops > 0 and hardware.memory_bandwidth_gbs > 0


def check_datasheet(hardware: HardwareConfig) -> None:
    if not has_datasheet(hardware):
        with_numbers = [name for name in options("hardware") if has_datasheet(load_hardware(name))]
        raise ConfigError(
            f"hardware '{hardware.name}' has no bf16_tflops / memory_bandwidth_gbs to plan with; choose "
            f"hardware=<name> or plan.compare=[...] from {with_numbers}, or add them to conf/hardware/{hardware.name}.yaml"
        )


def run_plan(cfg: EagletConfig) -> tuple[list[HardwarePlan], str]:
    if cfg.plan.deadline_hours <= 0:
        raise ConfigError(f"plan.deadline_hours must be > 0, got {cfg.plan.deadline_hours}")
    hardware = hardware_to_compare(cfg)
    for hw in hardware:
        check_datasheet(hw)
    data = estimate_data_size(cfg)
    curve = acceptance_curve(cfg.plan.serving)
    plans = [plan_hardware(cfg, hw, data, curve) for hw in hardware]
    return plans, print_plan(cfg, data, curve, plans)
