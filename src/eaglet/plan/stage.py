"""plan.py's stage: size the data, plan every hardware asked for, print the tables and the verdict."""

from __future__ import annotations

from eaglet.config.schema import EagletConfig, HardwareConfig
from eaglet.errors import ConfigError
from eaglet.plan.acceptance import acceptance_curve
from eaglet.plan.configs import load_hardware, options
from eaglet.plan.data_size import estimate_data_size
from eaglet.plan.planner import HardwarePlan, PlannedRun, plan_hardware
from eaglet.plan.quality import measure_quality
from eaglet.plan.report import print_plan
from eaglet.shards.layout import shard_dir


def hardware_to_compare(compare: list[str], hardware: HardwareConfig) -> list[HardwareConfig]:
    """plan.compare by name (the composed `hardware`, with its overrides, where it is one of them)."""
    if not compare:
        return [hardware]
    return [hardware if name == hardware.name else load_hardware(name) for name in compare]


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
    hardware = hardware_to_compare(list(cfg.plan.compare), cfg.hardware)
    for hw in hardware:
        check_datasheet(hw)
    data = estimate_data_size(
        cfg.plan,
        cfg.dataset,
        cfg.extract,
        shard_dir(cfg.paths.data_dir, cfg.model.name, cfg.dataset.name, cfg.extract.output_dir),
    )
    curve = acceptance_curve(cfg.plan.serving)
    quality = measure_quality(cfg.plan.quality)  # before the estimates: a bad path fails fast
    run = PlannedRun(
        model=cfg.model,
        draft=cfg.draft,
        trainer=cfg.trainer,
        plan=cfg.plan,
        shard_dtype=str(cfg.extract.dtype),
        regenerate=cfg.extract.regenerate.enabled,
        shard_tokens=cfg.extract.shard_tokens,
    )
    plans = [plan_hardware(run, hw, data, curve) for hw in hardware]
    return plans, print_plan(run, data, curve, plans, quality=quality)
