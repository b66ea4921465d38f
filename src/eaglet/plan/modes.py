"""The three ways to train, side by side on one machine: disk and time of each, and the one to use.

- shards (trainer.features=shards): extraction writes every shard, then training reads them max_epochs times.
  Disk: the whole folder. Time: regeneration + extraction + training.
- online (trainer.features=online): extraction writes token streams (5 bytes a token) and training runs the
  frozen target over every micro-batch, on every device beside the head (eaglet.train.online). Disk: the
  tokens. Time: regeneration + max_epochs × (training + the target's forward over the tokens on one device).
  Needs a replica of the target (bf16) within TARGET_MEMORY_SHARE of one device's memory.
- window (trainer.features=window): extraction writes shards under extract.max_disk_gb while training reads
  them and deletes each once done with. Disk: the bound, at least the target head, token counts and
  window + validation + 1 shards of extract.shard_tokens tokens. Time: as shards, summed (both run on the
  same devices here, so they take turns rather than overlap).

Which to use: shards when the folder fits the disk (the target's forward then runs once, not every epoch);
else online when the target fits beside the head on one device; else window.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglet.config.schema import HardwareConfig, ModelConfig, PlanConfig, TrainerConfig
from eaglet.plan.data_size import DataSize
from eaglet.plan.disk import DiskEstimate, shard_bytes_per_token
from eaglet.plan.extraction import Placement, prefill_seconds_per_token
from eaglet.plan.training import TrainingEstimate
from eaglet.shards.tokens import TOKEN_BYTES_PER_TOKEN
from eaglet.target_model.footprint import TARGET_MEMORY_SHARE, target_weight_bytes

# Beside the shards: token counts (int64 per target id) and manifests, a few MB at most.
COUNTS_BYTES_PER_ID = 8
BF16 = 2
# The bound window training is advised to take when the disk allows: all of it but a margin for the rest of the
# machine's files, never more than the whole folder would take.
WINDOW_DISK_SHARE = 0.9
MODES = ("shards", "online", "window")


@dataclass(frozen=True)
class ModeEstimate:
    mode: str  # one of MODES
    disk_bytes: float  # the most the data takes on disk at once
    seconds: float  # regeneration, extraction and training
    problem: str | None = None  # why it cannot run on this machine
    max_disk_gb: float | None = None  # window: the extract.max_disk_gb to pass
    # training's rate on the whole machine (online: the target's forward as well)
    train_tokens_per_second: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class ModeChoice:
    mode: str | None  # None: none of them can run here
    reason: str


def estimate_modes(
    model: ModelConfig,
    hardware: HardwareConfig,
    trainer: TrainerConfig,
    plan: PlanConfig,
    data: DataSize,
    *,
    placement: Placement,
    stored: DiskEstimate,
    shard_tokens: int,
    regeneration_seconds: float,
    extraction_seconds: float,
    training: TrainingEstimate,
) -> list[ModeEstimate]:
    """Each mode on `hardware`; `stored` sizes the shards in extract.dtype."""
    disk = hardware.disk_tb * 1e12
    no_target = None if placement.group is not None else "the target does not fit the machine for extraction"
    counts = COUNTS_BYTES_PER_ID * model.vocab_size

    def too_big(need: float, what: str) -> str | None:
        if disk <= 0 or need <= disk:
            return None
        return f"{what} need {_size(need)}, the disk holds {_size(disk)}"

    offline_seconds = regeneration_seconds + extraction_seconds + training.seconds
    offline_disk = stored.total_bytes + counts
    shards = ModeEstimate(
        "shards",
        offline_disk,
        offline_seconds,
        no_target or too_big(offline_disk, f"{stored.dtype} shards"),
        train_tokens_per_second=training.tokens_per_second,
    )

    world = hardware.devices * hardware.num_nodes
    forward, _ = prefill_seconds_per_token(model, hardware, 1, data.mean_context, plan)
    trained = data.tokens * (1.0 - trainer.val_fraction) * trainer.train_fraction
    online_seconds = regeneration_seconds + training.seconds + trainer.max_epochs * trained * forward / world
    online_disk = TOKEN_BYTES_PER_TOKEN * data.tokens + counts
    weights = target_weight_bytes(model, BF16)
    memory = hardware.memory_gb_per_device * 1e9
    replica = (
        None
        if memory <= 0 or weights <= TARGET_MEMORY_SHARE * memory
        else f"the target ({_size(weights)} in bf16) does not fit beside the head on one "
        f"{hardware.gpu} (at most {TARGET_MEMORY_SHARE:.0%} of {_size(memory)})"
    )
    online = ModeEstimate(
        "online",
        online_disk,
        online_seconds,
        replica or too_big(online_disk, "token streams"),
        train_tokens_per_second=1 / (1 / training.tokens_per_second + forward / world),
    )

    window_shards = (trainer.window_shards or trainer.max_epochs) + int(trainer.val_fraction > 0) + 1
    shard = shard_tokens * shard_bytes_per_token(model, stored.dtype)
    least = stored.target_head_bytes + counts + window_shards * shard
    advised = max(least, min(WINDOW_DISK_SHARE * disk, offline_disk)) if disk > 0 else least
    window = ModeEstimate(
        "window",
        advised,
        offline_seconds,
        no_target or too_big(least, f"the head and {window_shards} shards of {shard_tokens:,} tokens"),
        max_disk_gb=advised / 1e9,
        train_tokens_per_second=training.tokens_per_second,
    )
    return [shards, online, window]


def choose_mode(modes: list[ModeEstimate]) -> ModeChoice:
    by_name = {m.mode: m for m in modes}
    shards, online, window = by_name["shards"], by_name["online"], by_name["window"]
    if shards.feasible:
        return ModeChoice("shards", f"the shards fit the disk ({_size(shards.disk_bytes)})")
    if online.feasible:
        return ModeChoice("online", f"{shards.problem}; the target fits beside the head on one device")
    if window.feasible:
        return ModeChoice(
            "window",
            f"{shards.problem}, and {online.problem}: extract with extract.max_disk_gb={gb(window.max_disk_gb)} "
            "and train beside it with trainer.features=window",
        )
    return ModeChoice(None, f"{shards.problem}; {online.problem}; {window.problem}")


def gb(value: float | None) -> str:
    """A GB value as an override takes it: no thousands separator, no exponent."""
    if value is None:
        return "null"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _size(n: float) -> str:
    return f"{n / 1e12:,.2f} TB" if n >= 1e11 else f"{n / 1e9:,.2f} GB"
