"""Predicted serving speedup of an EAGLE-3 head: a roofline model of one speculative decode step.

One step drafts K tokens (K draft forwards) and verifies K + 1 tokens in one target forward, yielding τ
tokens; plain decoding yields one token per one-token target forward. So

    speedup(K) = τ(K) · t_target(1) / (K · t_draft + t_target(K + 1))

A forward costs max(bytes read / bandwidth, FLOPs / compute) plus its tensor-parallel all-reduces (a fixed
time per all-reduce plus the bandwidth term of its message). Bytes read are the weights and each
sequence's KV cache. On a mixture-of-experts target, verifying n tokens per sequence reads every distinct
expert the batch routes to, E·(1 − (1 − k/E)^n) per layer instead of k, so verification costs more than on
a dense target. The fixed all-reduce time on PCIe is solved from a measured share of decode time spent in
all-reduce (plan.calibration.pcie_allreduce_*); on NVLink it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from eaglet.config.schema import DraftConfig, HardwareConfig, ModelConfig, PlanCalibrationConfig, PlanConfig
from eaglet.errors import ConfigError
from eaglet.plan.configs import default_plan, load_hardware, load_model
from eaglet.plan.disk import num_aux
from eaglet.plan.head_params import decoder_layer_params, fc_params, lm_head_params
from eaglet.plan.target_cost import (
    ACTIVATION_BYTES,
    allreduces_per_forward,
    expected_distinct_experts,
    forward_flops_per_token,
    forward_weight_bytes,
    kv_cache_bytes_per_token,
    require_param_counts,
    ring_allreduce_seconds,
)

DRAFT_WEIGHT_BYTES = 2  # heads are served in bf16
# One draft forward reduces after attention and after the MLP, and gathers its vocab-parallel logits.
DRAFT_COLLECTIVES = 3


@dataclass(frozen=True)
class StepCost:
    """Seconds of one forward: the memory and compute terms overlap, the all-reduces do not."""

    memory: float
    compute: float
    allreduce: float

    @property
    def seconds(self) -> float:
        return max(self.memory, self.compute) + self.allreduce


@dataclass(frozen=True)
class ServingPoint:
    """One draft length: τ, the step costs and the predicted speedup over plain decoding."""

    draft_length: int
    tau: float
    plain: StepCost
    draft: StepCost
    verify: StepCost
    distinct_experts: float

    @property
    def step_seconds(self) -> float:
        return self.draft_length * self.draft.seconds + self.verify.seconds

    @property
    def speedup(self) -> float:
        return self.tau * self.plain.seconds / self.step_seconds


def allreduce_seconds(
    hardware: HardwareConfig, group: int, message_bytes: float, calibration: PlanCalibrationConfig
) -> float:
    """One decode all-reduce inside a group of `group` devices: fixed time plus the ring bandwidth term."""
    if group <= 1:
        return 0.0
    fixed = pcie_allreduce_fixed_seconds(calibration) if hardware.interconnect == "pcie" else None
    if fixed is None:
        fixed = calibration.nvlink_allreduce_us * 1e-6
    return fixed + ring_allreduce_seconds(message_bytes, group, hardware.interconnect_bandwidth_gbs)


def target_step(
    model: ModelConfig,
    hardware: HardwareConfig,
    group: int,
    *,
    batch: int,
    tokens_per_sequence: int,
    context: float,
    calibration: PlanCalibrationConfig,
) -> StepCost:
    """One target forward over `batch` sequences carrying `tokens_per_sequence` new tokens each."""
    tokens = batch * tokens_per_sequence
    bytes_read = forward_weight_bytes(model, tokens) + batch * context * kv_cache_bytes_per_token(model)
    bandwidth = group * hardware.memory_bandwidth_gbs * 1e9 * calibration.decode_bandwidth_efficiency
    compute = group * hardware.bf16_tflops * 1e12 * calibration.decode_compute_efficiency
    message = tokens * model.hidden_size * ACTIVATION_BYTES
    return StepCost(
        memory=bytes_read / bandwidth,
        compute=tokens * forward_flops_per_token(model, context) / compute,
        allreduce=allreduces_per_forward(model) * allreduce_seconds(hardware, group, message, calibration),
    )


def draft_params(model: ModelConfig, draft: DraftConfig, draft_vocab_size: int) -> float:
    """Weights one draft forward reads: fc over the aux states, the decoder layer, lm_head over the draft vocab."""
    return (
        fc_params(num_aux(model), model.hidden_size, draft)
        + decoder_layer_params(draft)
        + lm_head_params(draft, draft_vocab_size)
    )


def draft_step(
    model: ModelConfig,
    hardware: HardwareConfig,
    group: int,
    draft: DraftConfig,
    draft_vocab_size: int,
    *,
    batch: int,
    context: float,
    calibration: PlanCalibrationConfig,
) -> StepCost:
    """One draft forward (one new token per sequence), sharded over the target's group."""
    params = draft_params(model, draft, draft_vocab_size)
    kv = 2 * draft.num_key_value_heads * draft.head_dim * DRAFT_WEIGHT_BYTES * context * batch
    bandwidth = group * hardware.memory_bandwidth_gbs * 1e9 * calibration.decode_bandwidth_efficiency
    compute = group * hardware.bf16_tflops * 1e12 * calibration.decode_compute_efficiency
    message = batch * draft.hidden_size * ACTIVATION_BYTES
    return StepCost(
        memory=(params * DRAFT_WEIGHT_BYTES + kv) / bandwidth,
        compute=2.0 * params * batch / compute,
        allreduce=DRAFT_COLLECTIVES * allreduce_seconds(hardware, group, message, calibration),
    )


def pcie_allreduce_fixed_seconds(calibration: PlanCalibrationConfig) -> float:
    """Fixed time of one PCIe decode all-reduce, solved so that plain decode of the reference model on the
    reference PCIe machine spends `pcie_allreduce_share` of its time in all-reduce."""
    share = calibration.pcie_allreduce_share
    if not 0.0 <= share < 1.0:
        raise ConfigError(f"pcie_allreduce_share must lie in [0, 1), got {share}")
    return _pcie_fixed_seconds(
        share,
        calibration.pcie_allreduce_model,
        calibration.pcie_allreduce_hardware,
        calibration.pcie_allreduce_batch_size,
        calibration.decode_bandwidth_efficiency,
        calibration.decode_compute_efficiency,
    )


@cache
def _pcie_fixed_seconds(
    share: float, model_name: str, hardware_name: str, batch: int, bandwidth_eff: float, compute_eff: float
) -> float:
    model, hardware = load_model(model_name), load_hardware(hardware_name)
    group = hardware.devices
    one_device = target_step(
        model,
        hardware,
        1,
        batch=batch,
        tokens_per_sequence=1,
        context=0.0,
        calibration=PlanCalibrationConfig(
            decode_bandwidth_efficiency=bandwidth_eff, decode_compute_efficiency=compute_eff
        ),
    )
    # Spread over the group, weights and compute split evenly; the all-reduces come on top.
    rest = max(one_device.memory, one_device.compute) / group
    per_allreduce = share / (1.0 - share) * rest / allreduces_per_forward(model)
    message = batch * model.hidden_size * ACTIVATION_BYTES
    return max(
        per_allreduce - ring_allreduce_seconds(message, group, hardware.interconnect_bandwidth_gbs), 0.0
    )


def serving_group(hardware: HardwareConfig, plan: PlanConfig) -> int:
    group = plan.serving.tensor_parallel_size or hardware.devices
    if group < 1 or group > hardware.devices * hardware.num_nodes:
        raise ConfigError(
            f"plan.serving.tensor_parallel_size={group} does not fit hardware '{hardware.name}' "
            f"({hardware.devices} devices per node)"
        )
    return group


def serving_point(
    model: ModelConfig,
    hardware: HardwareConfig,
    draft: DraftConfig,
    draft_vocab_size: int,
    tau: float,
    draft_length: int,
    plan: PlanConfig,
) -> ServingPoint:
    """Step costs and speedup of serving with `draft_length` drafted tokens and mean acceptance length τ."""
    if draft_length < 1:
        raise ConfigError(f"draft length must be at least 1, got {draft_length}")
    if not 1.0 <= tau <= draft_length + 1:
        raise ConfigError(f"τ must lie in [1, draft length + 1] = [1, {draft_length + 1}], got {tau}")
    if hardware.memory_bandwidth_gbs <= 0 or hardware.bf16_tflops <= 0:
        raise ConfigError(
            f"hardware '{hardware.name}' has no memory_bandwidth_gbs / bf16_tflops: set them in "
            f"conf/hardware/{hardware.name}.yaml"
        )
    require_param_counts(model)
    group = serving_group(hardware, plan)
    s, cal = plan.serving, plan.calibration
    if s.batch_size < 1 or s.context_tokens < 0:
        raise ConfigError(
            f"serving batch_size must be >= 1 and context_tokens >= 0, got {s.batch_size} and {s.context_tokens}"
        )
    common = {"batch": s.batch_size, "context": s.context_tokens, "calibration": cal}
    return ServingPoint(
        draft_length=draft_length,
        tau=tau,
        plain=target_step(model, hardware, group, tokens_per_sequence=1, **common),
        draft=draft_step(model, hardware, group, draft, draft_vocab_size, **common),
        verify=target_step(model, hardware, group, tokens_per_sequence=draft_length + 1, **common),
        distinct_experts=expected_distinct_experts(
            model.num_experts, model.num_experts_per_tok, s.batch_size * (draft_length + 1)
        ),
    )


def predicted_speedup(
    model: ModelConfig,
    hardware: HardwareConfig,
    draft: DraftConfig,
    draft_vocab_size: int,
    tau: float,
    draft_length: int,
    plan: PlanConfig | None = None,
) -> float:
    """Decode speedup over plain decoding when each step drafts `draft_length` tokens and accepts τ on average.

    `plan` defaults to conf/plan/default.yaml (serving batch, context and calibration).
    """
    point = serving_point(model, hardware, draft, draft_vocab_size, tau, draft_length, plan or default_plan())
    return point.speedup
