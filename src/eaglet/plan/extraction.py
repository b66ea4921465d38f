"""Regeneration and extraction time on a machine.

The target runs as replicas of the smallest power-of-two tensor-parallel group that holds its weights.

Extraction runs its parts side by side (eaglet.extract.transformers_backend: copies to pinned memory on a side
stream, shard writers on threads under a byte budget). Per token of one replica:
- the forward: 2 × active parameters + attention over the causal context, at a calibrated share of
  datasheet bf16 (plan.calibration.prefill_efficiency);
- tensor parallelism: two all-reduces of the token's H activations per layer over the link (bandwidth term;
  large batches amortise the fixed cost), which is what PCIe boxes pay and NVLink mostly does not;
- storing: the token's shard bytes at the slower of the host's own rate (plan.calibration.host_store_gbs, as
  fast as storing goes when the filesystem is memory) and the replica's share of the machine's one disk
  (hardware.disk_write_gbs, shared by the replicas).
Storing overlaps the forward, but not wholly: the forward still waits for a calibrated share of the storing
time (plan.calibration.store_exposed_share: the writer threads' host work, the byte budget when a shard write
runs long), and it can never outrun storing:

    seconds per token = max(forward + all-reduce + store_exposed_share × storing, storing)

Regeneration: answers are decoded in batches of plan.regenerate_batch_size sequences per replica (fewer
when the KV cache does not fit beside the weights), each step a decode forward as in serving (its bandwidth
share calibrated on the generation engine's decode step); the prompt before each answer is prefilled at the
extraction forward's rate. The loop around the steps (scheduling, templating, prefills, rows waiting for a
conversation's next turn) reaches plan.calibration.regeneration_loop_efficiency of that, calibrated end to end
on the scale recipe's answers on one H200 (benchmarks/check_planner.py holds another data stage out).
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.config.schema import HardwareConfig, ModelConfig, PlanConfig
from eaglet.plan.data_size import DataSize
from eaglet.plan.disk import shard_bytes_per_token
from eaglet.plan.serving import target_step
from eaglet.plan.target_cost import (
    ACTIVATION_BYTES,
    allreduces_per_forward,
    devices_per_replica,
    forward_flops_per_token,
    kv_cache_bytes_per_token,
    ring_allreduce_seconds,
    stored_weight_bytes,
)


@dataclass(frozen=True)
class Placement:
    """How the target sits on the machine; group None = its weights do not fit."""

    group: int | None
    replicas: int
    weight_bytes: float
    memory_bytes: float  # all devices together


def place_target(model: ModelConfig, hardware: HardwareConfig, plan: PlanConfig) -> Placement:
    world = hardware.devices * hardware.num_nodes
    group = devices_per_replica(model, hardware, plan.weight_memory_fraction)
    return Placement(
        group=group,
        replicas=world // group if group else 0,
        weight_bytes=stored_weight_bytes(model),
        memory_bytes=world * hardware.memory_gb_per_device * 1e9,
    )


@dataclass(frozen=True)
class ExtractionEstimate:
    """Seconds per token of one replica for each part, and the machine's rate."""

    forward: float
    allreduce: float
    host_store: float  # the token's shard bytes at the host's own storing rate
    disk: float  # the same bytes at the replica's share of the machine's disk
    exposed_share: float  # of the storing time, what the forward waits for
    replicas: int
    disk_write_gbs: float
    disk_assumed: bool

    @property
    def store(self) -> float:
        return max(self.host_store, self.disk)

    @property
    def forward_side(self) -> float:
        """The forward, its all-reduces and the share of storing it waits for."""
        return self.forward + self.allreduce + self.exposed_share * self.store

    @property
    def seconds_per_token(self) -> float:
        """One replica: never faster than storing."""
        return max(self.forward_side, self.store)

    @property
    def tokens_per_second(self) -> float:
        return self.replicas / self.seconds_per_token

    @property
    def bottleneck(self) -> str:
        if self.store >= self.forward_side:
            return "disk" if self.disk >= self.host_store else "host"
        return "all-reduce" if self.allreduce > self.forward else "forward"


def prefill_seconds_per_token(
    model: ModelConfig, hardware: HardwareConfig, group: int, context: float, plan: PlanConfig
) -> tuple[float, float]:
    """(forward, all-reduce) seconds per token of one replica over long batches."""
    compute = group * hardware.bf16_tflops * 1e12 * plan.calibration.prefill_efficiency
    forward = forward_flops_per_token(model, context) / compute
    message = model.hidden_size * ACTIVATION_BYTES
    allreduce = allreduces_per_forward(model) * ring_allreduce_seconds(
        message, group, hardware.interconnect_bandwidth_gbs
    )
    return forward, allreduce


def estimate_extraction(
    model: ModelConfig,
    hardware: HardwareConfig,
    placement: Placement,
    data: DataSize,
    plan: PlanConfig,
    stored_dtype: str,
) -> ExtractionEstimate:
    """Shards stored in `stored_dtype` (extract.dtype)."""
    assert placement.group is not None
    cal = plan.calibration
    forward, allreduce = prefill_seconds_per_token(model, hardware, placement.group, data.mean_context, plan)
    per_token = shard_bytes_per_token(model, stored_dtype)
    disk_gbs = hardware.disk_write_gbs or cal.disk_write_gbs
    return ExtractionEstimate(
        forward=forward,
        allreduce=allreduce,
        host_store=per_token / (cal.host_store_gbs * 1e9),
        disk=placement.replicas * per_token / (disk_gbs * 1e9),
        exposed_share=cal.store_exposed_share,
        replicas=placement.replicas,
        disk_write_gbs=disk_gbs,
        disk_assumed=not hardware.disk_write_gbs,
    )


@dataclass(frozen=True)
class RegenerationEstimate:
    batch: int  # sequences per replica per decode step
    step_tokens_per_second: float  # whole machine, the decode steps alone
    prefill_seconds: float
    decode_seconds: float
    loop_efficiency: float  # the share of the steps' rate the whole loop reaches

    @property
    def seconds(self) -> float:
        return (self.prefill_seconds + self.decode_seconds) / self.loop_efficiency


def estimate_regeneration(
    model: ModelConfig, hardware: HardwareConfig, placement: Placement, data: DataSize, plan: PlanConfig
) -> RegenerationEstimate:
    assert placement.group is not None
    loop = plan.calibration.regeneration_loop_efficiency
    group, replicas = placement.group, placement.replicas
    context = data.mean_context
    free = group * hardware.memory_gb_per_device * 1e9 - placement.weight_bytes
    fits = int(free // max(kv_cache_bytes_per_token(model) * max(context, 1.0), 1.0))
    batch = max(1, min(plan.regenerate_batch_size, fits))
    step = target_step(
        model,
        hardware,
        group,
        batch=batch,
        tokens_per_sequence=1,
        context=context,
        calibration=plan.calibration,
    )
    decode_rate = replicas * batch / step.seconds
    forward, allreduce = prefill_seconds_per_token(model, hardware, group, context, plan)
    return RegenerationEstimate(
        batch=batch,
        step_tokens_per_second=decode_rate,
        prefill_seconds=data.prefill_tokens * (forward + allreduce) / replicas,
        decode_seconds=data.generated_tokens / decode_rate,
        loop_efficiency=loop,
    )
