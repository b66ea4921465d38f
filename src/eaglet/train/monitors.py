"""What conf/callbacks/default.yaml measures a training run with, beside Lightning's own callbacks.

Tokens per second come from Lightning's ThroughputMonitor, told what a packed micro-batch holds: one row of
documents back to back (its samples) and their tokens, padding included, as the step computes them.
Memory is this module's PeakMemory: ThroughputMonitor measures no memory, and DeviceStatsMonitor logs about
seventy allocator counters every step (and needs psutil on CPUs) where one number is wanted.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor


def packed_documents(batch: dict[str, torch.Tensor]) -> int:
    """The documents packed into a micro-batch (padding, where there is any, is one more document id)."""
    real = int(batch["num_real_tokens"])
    return int(batch["document_ids"][real - 1]) + 1 if real else 1


def packed_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens of a micro-batch, padding included: what the step computes."""
    return int(batch["input_ids"].numel())


class StepThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor, with its validation rows logged at the training step they follow.

    Lightning logs them at the validation batch's own index (1, 2, ...): rows out of step order in metrics.csv,
    where a resumed run continues the file from the first step it logs, and would drop every earlier row.
    """

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        super()._compute(trainer, None)  # None: the loggers' own step, the optimizer step


class PeakMemory(L.Callback):
    """train/peak_mem_gib: the most memory the device's allocator has held so far (CUDA only)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if pl_module.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
            pl_module.log("train/peak_mem_gib", peak, on_step=True, on_epoch=False)
