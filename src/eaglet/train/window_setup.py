"""What train.py needs before window training starts: the folder's plan (waited for), the schedule it implies,
and the checks that extraction and training can share the folder's disk bound."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from eaglet.config.schema import EagletConfig
from eaglet.config.window import window_size
from eaglet.errors import ConfigError
from eaglet.fsutil import human_bytes
from eaglet.shards import Manifest, read_manifest
from eaglet.shards.window import StreamPlan
from eaglet.train.hardware import TrainerPlan
from eaglet.train.window_folder import WindowFolder
from eaglet.train.window_schedule import WindowSchedule


@dataclass(frozen=True)
class WindowPlan:
    folder: WindowFolder
    stream: StreamPlan
    schedule: WindowSchedule
    manifest: Manifest  # as extraction had written it when training started

    @property
    def train_tokens(self) -> int:
        """Tokens of the training shards, as planned (each is read schedule.epochs times)."""
        return sum(self.stream.shard_tokens[self.schedule.first :])

    def optimizer_steps(self, plan: TrainerPlan) -> int:
        """About the run's optimizer steps, for the learning-rate schedule: every training token read
        schedule.epochs times, in full global batches (packing leaves a little room in each micro-batch)."""
        return max(1, math.ceil(self.schedule.epochs * self.train_tokens / plan.global_batch_tokens))


def open_window(cfg: EagletConfig, directory: Path) -> WindowPlan:
    """The folder extraction writes under extract.max_disk_gb, once it has started (waited for)."""
    folder = WindowFolder(directory, cfg.trainer.window_timeout_s)
    stream = folder.stream_plan()
    asked = cfg.extract.max_disk_gb
    if asked is not None and abs(asked * 1e9 - stream.max_disk_bytes) > 1e6:
        print(
            f"window: {directory} is bounded by the extract.max_disk_gb={stream.max_disk_bytes / 1e9:g} its "
            f"extraction was given, not {asked:g}: extraction enforces its own"
        )
    schedule = WindowSchedule(
        shards=stream.shards,
        window=window_size(cfg),
        epochs=cfg.trainer.max_epochs,
        validation=cfg.trainer.val_fraction > 0,
        seed=cfg.seed,
    )
    check_room(stream, schedule)
    return WindowPlan(folder, stream, schedule, read_manifest(directory))


def check_room(stream: StreamPlan, schedule: WindowSchedule) -> None:
    """The folder's bound must hold its fixed part, the window's shards, the validation shard and the shard
    extraction writes meanwhile (else each waits for the other for ever).

    Lightning takes one micro-batch ahead of the one it trains (to know which is the last), so the last
    micro-batch of a round is trained once the next round's newest shard is there: that is the shard extraction
    writes meanwhile. A round that read nothing would make it look one more shard ahead: with window_shards >
    max_epochs, every shard but the last must hold window_shards sequences, so that none does.
    """
    if schedule.window > schedule.epochs:
        fewest = min(stream.shard_sequences[:-1], default=schedule.window)
        if fewest < schedule.window:
            raise ConfigError(
                f"trainer.window_shards={schedule.window} spreads each shard's sequences over {schedule.window} "
                f"rounds, and a shard of this folder holds only {fewest}: lower trainer.window_shards, or raise "
                "extract.shard_tokens (re-extract into a new folder)"
            )
    shards = schedule.window + schedule.first + 1
    need = stream.fixed_bytes + shards * max(stream.shard_bytes)
    if stream.max_disk_bytes < need:
        val = " + the validation shard" if schedule.validation else ""
        raise ConfigError(
            f"the folder's extract.max_disk_gb={stream.max_disk_bytes / 1e9:g} cannot hold window training: its "
            f"fixed part ({human_bytes(stream.fixed_bytes)}) and {shards} shards of up to "
            f"{human_bytes(max(stream.shard_bytes))} (a window of {schedule.window}{val} + the one being "
            f"extracted) need {need / 1e9:.3g} GB: re-run extraction with a larger extract.max_disk_gb (it "
            "resumes), or lower trainer.window_shards / trainer.max_epochs"
        )
