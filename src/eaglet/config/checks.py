"""Checks across keys and value ranges, run once on the composed config by every entry point.

Types, unknown keys and closed choices fail earlier, at composition (eaglet.config.schema). What is left
needs no data, no files and no device: a wrong setting fails here, naming its key, before any work starts.
Checks that depend on one stage's inputs stay in that stage (the shards' manifest, the machine's GPUs, the
training batch on the training hardware, the planner's datasheet numbers).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from eaglet.config.choices import STRATEGIES
from eaglet.config.schema import (
    DraftConfig,
    EagletConfig,
    HardwareConfig,
    ModelConfig,
    PlanConfig,
    TrainerConfig,
)
from eaglet.errors import ConfigError


def check_config(cfg: EagletConfig) -> None:
    """Raise ConfigError, naming the key, at the first setting no stage can run with."""
    check_trainer(cfg.trainer)
    check_hardware(cfg.hardware, cfg.trainer)
    check_draft(cfg.draft, cfg.model)
    check_plan(cfg.plan)


def _at_least(section: str, values: dict[str, Any], minimum: int) -> None:
    for key, value in values.items():
        if value < minimum:
            raise ConfigError(f"{section}.{key} must be >= {minimum}, got {value}")


def check_trainer(tr: TrainerConfig) -> None:
    _at_least("trainer", {"ttt_steps": tr.ttt_steps, "loss_chunk_tokens": tr.loss_chunk_tokens}, 1)
    _at_least("trainer", {"num_workers": tr.num_workers, "loader_threads": tr.loader_threads}, 0)
    if tr.step_loss_decay <= 0:
        raise ConfigError(f"trainer.step_loss_decay must be > 0, got {tr.step_loss_decay}")
    if not 0.0 <= tr.val_fraction < 1.0:
        raise ConfigError(f"trainer.val_fraction must be in [0, 1), got {tr.val_fraction}")


def check_hardware(hw: HardwareConfig, tr: TrainerConfig) -> None:
    _at_least("hardware", {"devices": hw.devices, "num_nodes": hw.num_nodes}, 1)
    if hw.strategy not in STRATEGIES:
        raise ConfigError(
            f"strategy={hw.strategy!r} is not one of {', '.join(STRATEGIES)} (hardware.strategy)"
        )
    if hw.strategy == "fsdp" and tr.embed_dtype is not None:
        raise ConfigError(
            f"trainer.embed_dtype={tr.embed_dtype} cannot be combined with hardware.strategy=fsdp (FSDP flattens "
            "each unit into one dtype); leave trainer.embed_dtype=null"
        )
    if hw.strategy == "fsdp" and hw.accelerator != "gpu":
        raise ConfigError(
            f"hardware.strategy=fsdp needs GPUs (Lightning's FSDP has no CPU backend); hardware={hw.name} is "
            f"accelerator={hw.accelerator}: use hardware.strategy=ddp there"
        )


def check_draft(draft: DraftConfig, model: ModelConfig) -> None:
    unset = sorted(OmegaConf.missing_keys(draft)) if OmegaConf.is_config(draft) else []
    if unset:
        raise ConfigError(
            f"model={model.name} has no draft head ({', '.join(f'draft.{key}' for key in unset)} unset): add "
            f"conf/draft/{model.name}.yaml, or take a shipped shape with draft=<name> (conf/draft/)"
        )
    dims = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    _at_least("draft", {key: getattr(draft, key) for key in dims}, 1)
    _at_least("draft", {"vocab_size": draft.vocab_size}, 1)
    if draft.num_attention_heads % draft.num_key_value_heads:
        raise ConfigError(
            f"draft.num_attention_heads={draft.num_attention_heads} is not a multiple of "
            f"draft.num_key_value_heads={draft.num_key_value_heads}; pick a divisor"
        )
    if draft.head_dim % 2:
        raise ConfigError(f"draft.head_dim={draft.head_dim} must be even for rotary embeddings")
    if draft.hidden_size != model.hidden_size:
        raise ConfigError(
            f"draft.hidden_size={draft.hidden_size} must equal the target's hidden size "
            f"model.hidden_size={model.hidden_size}: the head reuses the target's embeddings and lm_head rows"
        )


def check_plan(plan: PlanConfig) -> None:
    positive = {
        "tokens": plan.tokens,
        "conversations": plan.conversations,
        "tokens_per_conversation": plan.tokens_per_conversation,
        "chars_per_token": plan.chars_per_token,
        "deadline_hours": plan.deadline_hours,
    }
    for key, value in positive.items():
        if value is not None and value <= 0:
            raise ConfigError(f"plan.{key} must be > 0, got {value}")
    twice = sorted({name for name in plan.compare if list(plan.compare).count(name) > 1})
    if twice:
        raise ConfigError(f"plan.compare lists {twice} more than once; list each hardware once")
    serving = plan.serving
    if serving.batch_size < 1 or serving.context_tokens < 0:
        raise ConfigError("plan.serving.batch_size must be >= 1 and plan.serving.context_tokens >= 0")
    assumed = list(serving.acceptance)
    if not serving.acceptance_from and (not assumed or any(not 0.0 <= a <= 1.0 for a in assumed)):
        raise ConfigError(
            f"plan.serving.acceptance must be a non-empty list of values in [0, 1], got {assumed}"
        )
    cal = plan.calibration
    shares = ("training_efficiency", "training_efficiency_compiled", "training_bandwidth_efficiency")
    for key in shares:
        if not 0 < getattr(cal, key) <= 1:
            raise ConfigError(f"plan.calibration.{key} must lie in (0, 1], got {getattr(cal, key)}")
    if not 0.0 <= cal.pcie_allreduce_share < 1.0:
        raise ConfigError(
            f"plan.calibration.pcie_allreduce_share must lie in [0, 1), got {cal.pcie_allreduce_share}"
        )
