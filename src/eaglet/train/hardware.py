"""From a hardware config to Lightning trainer settings, with the same global batch on every machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaglet.config.schema import HardwareConfig, TrainerConfig
from eaglet.errors import ConfigError


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
    """Resolve the strategy (auto = ddp on several devices) and the gradient accumulation.

    hardware.strategy, hardware.devices and FSDP's requirements are checked after composition
    (eaglet.config.checks); the global batch is checked here, against the hardware that trains.
    """
    world = hw.devices * hw.num_nodes
    strategy = "ddp" if hw.strategy == "auto" and world > 1 else hw.strategy
    per_step = hw.tokens_per_device * world
    if tr.global_batch_tokens % per_step:
        raise ConfigError(
            f"trainer.global_batch_tokens={tr.global_batch_tokens} is not a multiple of "
            f"hardware.tokens_per_device x devices = {hw.tokens_per_device} x {world} = {per_step}; "
            "set trainer.global_batch_tokens to a multiple of it"
        )
    return TrainerPlan(
        accelerator=str(hw.accelerator),
        devices=hw.devices,
        num_nodes=hw.num_nodes,
        precision=hw.precision,
        strategy=strategy,
        tokens_per_device=hw.tokens_per_device,
        accumulate_grad_batches=tr.global_batch_tokens // per_step,
    )


def check_machine(hw: HardwareConfig) -> None:
    """Stop at once when this machine lacks the GPUs of the chosen hardware config.

    The training stage calls it first, before reading shards or checking the batch: on the wrong machine
    the missing GPUs are the one thing to fix.
    """
    if hw.accelerator != "gpu":
        return
    have = torch.cuda.device_count()
    if have < hw.devices:
        this = f"{have} CUDA GPU(s)" if have else "no CUDA GPU"
        raise ConfigError(
            f"hardware={hw.name} needs {hw.devices} x {hw.gpu} GPU(s) per node ({hw.num_nodes} node(s)); "
            f"this machine has {this}. Choose a config that fits, e.g. hardware=cpu"
            + (f" or hardware={hw.name} hardware.devices={have}" if have else "")
            + " (configs live in conf/hardware/)"
        )
