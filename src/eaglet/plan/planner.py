"""One plan per hardware: disk, regeneration, extraction, training and serving for the composed run, and which way
to train (shards, online, window) fits it."""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.config.schema import DraftConfig, HardwareConfig, ModelConfig, PlanConfig, TrainerConfig
from eaglet.plan.acceptance import AcceptanceCurve
from eaglet.plan.data_size import DataSize
from eaglet.plan.disk import DiskEstimate, estimate_disk
from eaglet.plan.extraction import (
    ExtractionEstimate,
    Placement,
    RegenerationEstimate,
    estimate_extraction,
    estimate_regeneration,
    place_target,
)
from eaglet.plan.modes import ModeChoice, ModeEstimate, choose_mode, estimate_modes
from eaglet.plan.serving import ServingPoint, serving_group, serving_point
from eaglet.plan.training import (
    HeadShape,
    SmallKernelCosts,
    TrainingEstimate,
    calibrated_efficiency,
    estimate_training,
)


@dataclass(frozen=True)
class PlannedRun:
    """The run a plan is for: what the planner reads of the composed config."""

    model: ModelConfig
    draft: DraftConfig
    trainer: TrainerConfig
    plan: PlanConfig
    shard_dtype: str  # extract.dtype
    regenerate: bool  # extract.regenerate.enabled
    shard_tokens: int = 65536  # extract.shard_tokens


@dataclass(frozen=True)
class HardwarePlan:
    hardware: HardwareConfig
    placement: Placement
    disk: list[DiskEstimate]
    regeneration: RegenerationEstimate | None  # None: regeneration off, or the target does not fit
    extraction: ExtractionEstimate | None  # None: the target does not fit
    extraction_seconds: float
    training: TrainingEstimate
    serving: list[ServingPoint]  # empty: the target does not fit one serving group
    problems: list[str]
    modes: list[ModeEstimate]  # shards, online, window
    choice: ModeChoice

    @property
    def devices(self) -> int:
        return self.hardware.devices * self.hardware.num_nodes

    @property
    def feasible(self) -> bool:
        return not self.problems

    @property
    def seconds(self) -> float:
        """The whole run in the way to train chosen for this machine (from shards when none fits)."""
        chosen = [m for m in self.modes if m.mode == self.choice.mode]
        if chosen:
            return chosen[0].seconds
        regeneration = self.regeneration.seconds if self.regeneration else 0.0
        return regeneration + self.extraction_seconds + self.training.seconds

    @property
    def gpu_hours(self) -> float:
        return self.seconds / 3600 * self.devices


def plan_hardware(
    run: PlannedRun, hardware: HardwareConfig, data: DataSize, curve: AcceptanceCurve
) -> HardwarePlan:
    model, plan = run.model, run.plan
    placement = place_target(model, hardware, plan)
    problems = []
    regeneration = extraction = None
    if placement.group is None:
        problems.append(
            f"the target's {placement.weight_bytes / 1e9:,.0f} GB of weights do not fit "
            f"{hardware.devices * hardware.num_nodes} × {hardware.memory_gb_per_device:g} GB "
            f"(at most {plan.weight_memory_fraction:.0%} for weights)"
        )
    else:
        extraction = estimate_extraction(model, hardware, placement, data, plan, run.shard_dtype)
        if run.regenerate:
            regeneration = estimate_regeneration(model, hardware, placement, data, plan)
    disk = [estimate_disk(model, hardware, dtype, data.tokens, data.conversations) for dtype in plan.dtypes]
    stored = estimate_disk(model, hardware, run.shard_dtype, data.tokens, data.conversations)
    training = estimate_training(
        HeadShape.of(model, run.draft, run.trainer),
        hardware,
        run.trainer,
        tokens=data.tokens,
        loss_fraction=data.loss_fraction,
        mean_document_context=data.mean_context,
        efficiency=calibrated_efficiency(plan.calibration, run.trainer),
        bandwidth_efficiency=plan.calibration.training_bandwidth_efficiency,
        attention_keys=plan.calibration.training_attention,
        small_kernels=SmallKernelCosts.of(plan.calibration),
    )
    serving: list[ServingPoint] = []
    group = serving_group(hardware, plan)
    if placement.group is not None and placement.group <= group:
        serving = [
            serving_point(model, hardware, run.draft, run.draft.vocab_size, curve.tau(k), k, plan)
            for k in range(1, plan.serving.max_draft_length + 1)
        ]
    extraction_seconds = data.tokens / extraction.tokens_per_second if extraction else 0.0
    modes = estimate_modes(
        model,
        hardware,
        run.trainer,
        plan,
        data,
        placement=placement,
        stored=stored,
        shard_tokens=run.shard_tokens,
        regeneration_seconds=regeneration.seconds if regeneration else 0.0,
        extraction_seconds=extraction_seconds,
        training=training,
    )
    choice = choose_mode(modes)
    if choice.mode is None and placement.group is not None:
        problems.append(f"no way to train fits: {choice.reason}")
    return HardwarePlan(
        hardware=hardware,
        placement=placement,
        disk=disk,
        regeneration=regeneration,
        extraction=extraction,
        extraction_seconds=extraction_seconds,
        training=training,
        serving=serving,
        problems=problems,
        modes=modes,
        choice=choice,
    )
