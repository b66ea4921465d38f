"""Weights & Biases as the record of a run: whether it runs online, which W&B run a folder is, and results
written into that run by the stages after training (evaluation, sweep summaries)."""

from eaglet.tracking.mode import wandb_logged_in, wandb_mode
from eaglet.tracking.record import WandbRecord, forget_record, read_record, record_for
from eaglet.tracking.results import log_results

__all__ = [
    "WandbRecord",
    "forget_record",
    "log_results",
    "read_record",
    "record_for",
    "wandb_logged_in",
    "wandb_mode",
]
