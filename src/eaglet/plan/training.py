"""Draft-head training time: FLOPs from the head's shapes at a calibrated share of datasheet bf16, plus the
loss's element-wise passes over the draft vocab at a share of datasheet memory bandwidth.

What one packed micro-batch computes (eaglet.train.ttt, eaglet.model.ttt_flex, eaglet.train.kd_loss), per
token, counting a multiply-add as 2 FLOPs and a backward as 2 × the forward (1 × where only the weight
gradient is needed):
- fc fuses the n_aux target states at every position: forward + weight gradient (its input is data), 4 · fc;
- step 0's keys and values at every position, the context of later positions: 6 · (k, v). A position no
  step puts weight on (a prompt token) costs nothing else;
- at the "rows", the positions some step puts weight on (the loss positions, plus K − 1 before each answer
  span): step 0's query, o_proj and MLP, and every later step's whole layer, 6 · (K · layer − k, v); and per
  step, attention over the keys a query visits: 2 matmuls forward, 5 backward (the flash-style backward
  recomputes the scores), 14 · heads · head_dim · keys;
- lm_head at each step's loss positions: 4 · H·V_d frozen (logits, and the hidden state's gradient), 6 ·
  trainable (+ the weight gradient); the teacher once per loss position, over the draft-vocab rows of the
  target's lm_head only: 2 · H_t·V_d.
Keys per query: a block-sparse kernel (flex attention, the GPU default) visits about the document's causal
keys, as does the CPU path (tiled by document); a dense masked kernel (trainer.attention=sdpa on GPUs) scores
the whole packed micro-batch (plan.calibration.training_attention says which).

Memory traffic the FLOPs do not cover: the fused loss keeps each chunk's [tokens, V_d] logits in float32 and
passes over them about LOSS_BYTES_PER_LOGIT bytes per logit per step (cast, max, log-sum-exp, the teacher's
log-probabilities, exp, the gradient), the teacher about TEACHER_BYTES_PER_LOGIT once; counted from
eaglet.train.kd_loss. With trainer.compile each chunk is one compiled graph: the bf16 logits written by the
matmul and read by two reductions and a pointwise pass, the teacher rows read by all three, one bf16 gradient
written (LOSS_BYTES_PER_LOGIT_COMPILED). Its share of a step does not shrink with the head's width (it weighs more on
Llama-3.1-8B's H = 4096 than on Kimi-K2.5's 7168) and grows on low-bandwidth cards.

Time neither term covers, on GPUs: a narrow head is bound by its many small kernels (norms, rotary, activations,
attention's bookkeeping), not by its FLOPs. Per TTT step it costs about the same per packed token and per
micro-batch (launches, host work) whatever the head's width (SmallKernelCosts, calibrated on a 576-wide head,
where it is most of a step; a fifth to a quarter of a 4096-wide head's step, a tenth of a 7168-wide one's).

The layer runs eager or through torch.compile (trainer.compile): each has its own calibrated efficiency.
Data parallel: each optimizer step all-reduces the fp32 gradients of the trainable parameters over the
link; DDP overlaps that with the backward, so a step takes the longer of compute and all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.config.choices import AttentionKeys
from eaglet.config.schema import (
    DraftConfig,
    HardwareConfig,
    ModelConfig,
    PlanCalibrationConfig,
    TrainerConfig,
)
from eaglet.errors import ConfigError
from eaglet.plan.disk import num_aux
from eaglet.plan.head_params import decoder_layer_params, fc_params, kv_projection_params, lm_head_params
from eaglet.plan.target_cost import ring_allreduce_seconds

GRADIENT_BYTES = 4  # bf16-mixed keeps fp32 parameters, so DDP reduces fp32 gradients
ATTENTION_MATMULS = 7  # scores and values forward; scores again, dV, dP, dQ, dK backward
LOSS_BYTES_PER_LOGIT = 110  # per step and loss position, frozen lm_head
LOSS_BYTES_PER_LOGIT_TRAINABLE = 116  # + the logit gradients kept for lm_head's weight gradient
LOSS_BYTES_PER_LOGIT_COMPILED = 16  # 2 (write) + 3 x 2 (reads) logits, 3 x 2 teacher, 2 gradient
LOSS_BYTES_PER_LOGIT_COMPILED_TRAINABLE = 20  # + the kept logit gradients gathered into one tensor
TEACHER_BYTES_PER_LOGIT = 30  # once per loss position


@dataclass(frozen=True)
class HeadShape:
    """What the training cost depends on."""

    target_hidden: int
    target_vocab: int
    num_aux: int
    draft: DraftConfig
    draft_vocab_size: int
    ttt_steps: int
    lm_head_trainable: bool
    compiled_loss: bool = False  # trainer.compile: the fused loss's chunks run compiled

    @classmethod
    def of(
        cls,
        model: ModelConfig,
        draft: DraftConfig,
        trainer: TrainerConfig,
        draft_vocab_size: int | None = None,
    ) -> HeadShape:
        """draft_vocab_size: another draft vocab than draft.vocab_size."""
        return cls(
            target_hidden=model.hidden_size,
            target_vocab=model.vocab_size,
            num_aux=num_aux(model),
            draft=draft,
            draft_vocab_size=draft_vocab_size or draft.vocab_size,
            ttt_steps=trainer.ttt_steps,
            lm_head_trainable=trainer.lm_head_trainable,
            compiled_loss=trainer.compile,
        )

    @property
    def fc_params(self) -> int:
        return fc_params(self.num_aux, self.target_hidden, self.draft)

    @property
    def kv_params(self) -> int:
        return kv_projection_params(self.draft)

    @property
    def layer_params(self) -> int:
        return decoder_layer_params(self.draft)

    @property
    def lm_head_params(self) -> int:
        return lm_head_params(self.draft, self.draft_vocab_size)

    @property
    def trainable_params(self) -> int:
        return self.fc_params + self.layer_params + (self.lm_head_params if self.lm_head_trainable else 0)


@dataclass(frozen=True)
class SmallKernelCosts:
    """Time per TTT step outside the FLOPs and the loss's bytes, on GPUs (plan.calibration.training_token_step_us,
    training_microbatch_step_ms): per packed token, and per micro-batch."""

    token_step_us: float = 0.0
    microbatch_step_ms: float = 0.0

    @classmethod
    def of(cls, calibration: PlanCalibrationConfig) -> SmallKernelCosts:
        return cls(calibration.training_token_step_us, calibration.training_microbatch_step_ms)

    def token_seconds(self, shape: HeadShape, hardware: HardwareConfig) -> float:
        """Per packed token."""
        return shape.ttt_steps * self.token_step_us * 1e-6 if hardware.accelerator == "gpu" else 0.0

    def microbatch_seconds(self, shape: HeadShape, hardware: HardwareConfig) -> float:
        """Per micro-batch, whatever its size."""
        return shape.ttt_steps * self.microbatch_step_ms * 1e-3 if hardware.accelerator == "gpu" else 0.0


def _check_steps(shape: HeadShape) -> None:
    if shape.ttt_steps < 1:
        raise ConfigError(f"ttt_steps must be >= 1, got {shape.ttt_steps}")


def training_flops_per_token(
    shape: HeadShape, *, loss_fraction: float, attention_context: float, row_fraction: float | None = None
) -> float:
    """FLOPs per packed token (forward + backward, all K steps, teacher included).

    loss_fraction: share of tokens in the loss mask; row_fraction: share that runs every step (default the
    loss share: the K − 1 extra rows per answer span are left out); attention_context: keys per query.
    """
    _check_steps(shape)
    k, d = shape.ttt_steps, shape.draft
    rows = loss_fraction if row_fraction is None else row_fraction
    attention = ATTENTION_MATMULS * 2 * d.num_attention_heads * d.head_dim * attention_context
    per_row = 6 * (k * shape.layer_params - shape.kv_params) + k * attention
    lm_head = (6 if shape.lm_head_trainable else 4) * shape.lm_head_params * k * loss_fraction
    teacher = 2 * shape.target_hidden * shape.draft_vocab_size * loss_fraction
    return 4 * shape.fc_params + 6 * shape.kv_params + rows * per_row + lm_head + teacher


def loss_bytes_per_token(shape: HeadShape, *, loss_fraction: float) -> float:
    """Bytes the loss and the teacher move per packed token, outside the matmuls."""
    _check_steps(shape)
    if shape.compiled_loss:
        per_logit = (
            LOSS_BYTES_PER_LOGIT_COMPILED_TRAINABLE
            if shape.lm_head_trainable
            else LOSS_BYTES_PER_LOGIT_COMPILED
        )
    else:
        per_logit = LOSS_BYTES_PER_LOGIT_TRAINABLE if shape.lm_head_trainable else LOSS_BYTES_PER_LOGIT
    return shape.draft_vocab_size * loss_fraction * (shape.ttt_steps * per_logit + TEACHER_BYTES_PER_LOGIT)


ATTENTION_KEYS = tuple(str(keys) for keys in AttentionKeys)


def attention_context(hardware: HardwareConfig, mean_document_context: float, keys: str) -> float:
    """Mean keys a training query visits; `keys` is plan.calibration.training_attention."""
    if keys not in ATTENTION_KEYS:
        raise ConfigError(f"training_attention must be one of {list(ATTENTION_KEYS)}, got {keys!r}")
    if hardware.accelerator == "gpu" and keys == "row":
        return float(hardware.tokens_per_device)
    return mean_document_context


def calibrated_efficiency(calibration: PlanCalibrationConfig, trainer: TrainerConfig) -> float:
    """The share of datasheet bf16 for the layer as trainer.compile runs it."""
    return calibration.training_efficiency_compiled if trainer.compile else calibration.training_efficiency


@dataclass(frozen=True)
class TrainingEstimate:
    flops_per_token: float
    loss_bytes_per_token: float
    tokens_per_second: float  # whole machine
    optimizer_step_tokens: int
    compute_seconds_per_step: float
    allreduce_seconds_per_step: float
    seconds_per_epoch: float
    epochs: int

    @property
    def seconds(self) -> float:
        return self.seconds_per_epoch * self.epochs


def device_seconds_per_token(
    shape: HeadShape,
    hardware: HardwareConfig,
    *,
    loss_fraction: float,
    attention_context: float,
    efficiency: float,
    bandwidth_efficiency: float,
    row_fraction: float | None = None,
    small_kernels: SmallKernelCosts = SmallKernelCosts(),
) -> tuple[float, float, float]:
    """(seconds per token on one device, its FLOPs, its loss bytes); a micro-batch's fixed time is not in it
    (SmallKernelCosts.microbatch_seconds)."""
    datasheet = {"bf16_tflops": hardware.bf16_tflops, "memory_bandwidth_gbs": hardware.memory_bandwidth_gbs}
    for name, value in datasheet.items():
        if value <= 0:
            raise ConfigError(
                f"hardware '{hardware.name}' has no {name}: set it in conf/hardware/{hardware.name}.yaml"
            )
    shares = {"training_efficiency": efficiency, "training_bandwidth_efficiency": bandwidth_efficiency}
    for name, value in shares.items():
        if not 0 < value <= 1:
            raise ConfigError(f"{name} must lie in (0, 1], got {value}")
    flops = training_flops_per_token(
        shape, loss_fraction=loss_fraction, attention_context=attention_context, row_fraction=row_fraction
    )
    moved = loss_bytes_per_token(shape, loss_fraction=loss_fraction)
    seconds = (
        flops / (hardware.bf16_tflops * 1e12 * efficiency)
        + moved / (hardware.memory_bandwidth_gbs * 1e9 * bandwidth_efficiency)
        + small_kernels.token_seconds(shape, hardware)
    )
    return seconds, flops, moved


def estimate_training(
    shape: HeadShape,
    hardware: HardwareConfig,
    trainer: TrainerConfig,
    *,
    tokens: float,
    loss_fraction: float,
    mean_document_context: float,
    efficiency: float,
    bandwidth_efficiency: float,
    attention_keys: str = "document",
    small_kernels: SmallKernelCosts = SmallKernelCosts(),
) -> TrainingEstimate:
    """Time per epoch over `tokens` (less the validation split) on `hardware`."""
    world = hardware.devices * hardware.num_nodes
    seconds_per_token, flops, moved = device_seconds_per_token(
        shape,
        hardware,
        loss_fraction=loss_fraction,
        attention_context=attention_context(hardware, mean_document_context, attention_keys),
        efficiency=efficiency,
        bandwidth_efficiency=bandwidth_efficiency,
        small_kernels=small_kernels,
    )
    # The trainer's global batch, raised to one micro-batch per device when smaller (eaglet.train.hardware).
    micro = hardware.tokens_per_device * world
    step_tokens = max(-(-trainer.global_batch_tokens // micro), 1) * micro
    micro_batches = step_tokens // micro  # on each device
    compute = step_tokens / world * seconds_per_token + micro_batches * small_kernels.microbatch_seconds(
        shape, hardware
    )
    allreduce = ring_allreduce_seconds(
        GRADIENT_BYTES * shape.trainable_params, world, hardware.interconnect_bandwidth_gbs
    )
    step = max(compute, allreduce)
    trained = tokens * (1.0 - trainer.val_fraction) * trainer.train_fraction
    return TrainingEstimate(
        flops_per_token=flops,
        loss_bytes_per_token=moved,
        tokens_per_second=step_tokens / step,
        optimizer_step_tokens=step_tokens,
        compute_seconds_per_step=compute,
        allreduce_seconds_per_step=allreduce,
        seconds_per_epoch=trained / step_tokens * step,
        epochs=trainer.max_epochs,
    )
