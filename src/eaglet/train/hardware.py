"""From a hardware config to Lightning trainer settings, with the same global batch on every machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglet.config.schema import HardwareConfig, TrainerConfig
from eaglet.errors import ConfigError
from eaglet.train.strategy import STRATEGIES


@dataclass(frozen=True)
class TrainerPlan:
    accelerator: str
    devices: int
    num_nodes: int
    precision: str
    strategy: str
    tokens_per_device: int
    accumulate_grad_batches: int

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def global_batch_tokens(self) -> int:
        return self.tokens_per_device * self.world_size * self.accumulate_grad_batches


def plan_trainer(hw: HardwareConfig, tr: TrainerConfig) -> TrainerPlan:
    """Resolve devices/strategy (trainer.* overrides win) and the gradient accumulation."""
    devices = tr.devices if tr.devices is not None else hw.devices
    strategy = tr.strategy if tr.strategy is not None else hw.strategy
    if devices < 1:
        raise ConfigError(f"trainer.devices must be >= 1, got {devices}")
    if strategy == "auto" and devices * hw.num_nodes > 1:
        strategy = "ddp"
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"strategy={strategy!r} is not one of {', '.join(STRATEGIES)} (set by trainer.strategy or hardware.strategy)"
        )
    if strategy == "fsdp" and tr.embed_dtype is not None:
        raise ConfigError(
            f"trainer.embed_dtype={tr.embed_dtype} cannot be combined with trainer.strategy=fsdp (FSDP flattens "
            "each unit into one dtype); leave trainer.embed_dtype=null"
        )
    if strategy == "fsdp" and hw.accelerator != "gpu":
        raise ConfigError(
            f"trainer.strategy=fsdp needs GPUs (Lightning's FSDP has no CPU backend); hardware={hw.name} is "
            f"accelerator={hw.accelerator}: use trainer.strategy=ddp there"
        )
    world = devices * hw.num_nodes
    per_step = hw.tokens_per_device * world
    if tr.global_batch_tokens % per_step:
        raise ConfigError(
            f"trainer.global_batch_tokens={tr.global_batch_tokens} is not a multiple of "
            f"hardware.tokens_per_device x devices = {hw.tokens_per_device} x {world} = {per_step}; "
            "set trainer.global_batch_tokens to a multiple of it"
        )
    return TrainerPlan(
        accelerator=hw.accelerator,
        devices=devices,
        num_nodes=hw.num_nodes,
        precision=hw.precision,
        strategy=strategy,
        tokens_per_device=hw.tokens_per_device,
        accumulate_grad_batches=tr.global_batch_tokens // per_step,
    )


def check_machine(hw: HardwareConfig, plan: TrainerPlan) -> None:
    """Stop at once when this machine cannot run the chosen hardware config."""
    if plan.accelerator != "gpu":
        return
    have = torch.cuda.device_count()
    if have < plan.devices:
        this = f"{have} CUDA GPU(s)" if have else "no CUDA GPU"
        raise ConfigError(
            f"hardware={hw.name} needs {plan.devices} x {hw.gpu} GPU(s) per node ({plan.num_nodes} node(s)); "
            f"this machine has {this}. Choose a config that fits, e.g. hardware=cpu"
            + (f" or hardware={hw.name} trainer.devices={have}" if have else "")
            + " (configs live in conf/hardware/)"
        )
