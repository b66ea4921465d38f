"""Checkpoint files: written whole or not at all, read as plain tensors and values only, and taken where a
resumed run goes on exactly as the uninterrupted one would have.

Lightning's own writer moves a temporary file from the system's temp folder onto the final name, which on
another disk is a copy: a full disk then cuts `last.ckpt` short and the previous good one is gone. Here the
temporary file sits beside the final name and is renamed over it once complete.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from eaglet.errors import DataError
from eaglet.fsutil import atomic_output, human_bytes
from eaglet.run_dir import RunDir
from eaglet.train.disk_full import said_if_disk_full


def read_checkpoint(path: str | Path, **load_kwargs: Any) -> dict[str, Any]:
    """torch.load with weights_only=True, its refusals said as one message naming the file."""
    try:
        return torch.load(path, weights_only=True, **load_kwargs)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f" ({named.group(1)})" if named else ""
        raise DataError(
            f"{path} is not a plain-weights checkpoint: it names Python objects{what} that would run code "
            "when loaded, so it was not loaded. Resume only from checkpoints that train.py wrote "
            "(ckpt_path=last, or a run's checkpoints/*.ckpt)"
        ) from None
    except (RuntimeError, EOFError) as exc:  # not a zip archive, or one cut short
        raise DataError(
            f"{path} is not a readable checkpoint ({str(exc).splitlines()[0]}); pass another ckpt_path "
            "(a run's checkpoints/*.ckpt) or train from the start"
        ) from None


def check_checkpoint(path: str | Path) -> None:
    """Refuse a checkpoint that is not plain weights before any work starts (mapped: tensors stay unread)."""
    read_checkpoint(path, map_location="cpu", mmap=True)


class CheckpointFiles(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic writes, one message on a full disk, and weights-only reads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = Path(path)
        data = io.BytesIO()
        torch.save(checkpoint, data)  # torch's own file writer reports a full disk as an opaque RuntimeError
        doing = f"saving {path.name} ({human_bytes(data.tell())})"
        with said_if_disk_full(path.parent, doing, path.parent / RunDir.LAST_CHECKPOINT):
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_output(path) as tmp, open(tmp, "wb") as f:
                f.write(data.getbuffer())

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        # Weights only whatever the caller asks: a checkpoint to resume from may come from anywhere.
        return read_checkpoint(path, map_location=map_location or "cpu")


class StepCheckpoint(ModelCheckpoint):
    """last.ckpt every n optimizer steps, taken after that step's validation where one follows it.

    Lightning resumes a checkpoint taken at the end of a training batch past the validation due right after
    that batch (it fast-forwards the validation loop): a run killed between the two would never see that
    validation's score, and could select another head than the uninterrupted run. Taken after the
    validation, the checkpoint holds its outcome (the best score and file so far) and resumes after it.
    """

    def __init__(self, dirpath: Path, every_n_train_steps: int) -> None:
        super().__init__(
            dirpath=dirpath,
            save_last=True,
            save_top_k=0,
            every_n_train_steps=every_n_train_steps,
            save_on_train_epoch_end=False,  # the deferred save happens at validation end, always
            enable_version_counter=False,  # a step trained again after a resume rewrites its own file
        )

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        due = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if due and _validation_follows(trainer):
            # ModelCheckpoint's own deferral: on_validation_end saves it.
            self._defer_save_until_validation = True
            return
        super().on_train_batch_end(trainer, *args)


def _validation_follows(trainer: L.Trainer) -> bool:
    """Whether the fit loop validates right after the batch that just ended (its own test, Lightning 2.x)."""
    loop = trainer.fit_loop
    return loop.epoch_loop._should_check_val_fx(loop._data_fetcher)


def select_head(
    trainer: L.Trainer,
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    best: ModelCheckpoint | None,
    last: Path,
    *,
    validate: bool,
) -> tuple[str, dict[str, float]]:
    """(the checkpoint to export, its validation metrics) once training is done: the best val/tau_sim among the
    validations during training and the final state, last.ckpt.

    A run whose steps do not end on a validation (max_steps not a multiple of val_every_n_steps, a run stopped
    by max_time) would otherwise drop its last steps, those at the schedule's lowest learning rates. The final
    state is validated then, and wins only if strictly better, as the callback's own rule is.
    """
    if not validate:
        return str(last), {}
    chosen = (best.best_model_path if best is not None else "") or str(last)
    if chosen != str(last) and module.validated_at_step != trainer.global_step:
        # The module in hand holds the final state (under FSDP, its shards: the strategy validates them).
        final = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
        score = final.get("val/tau_sim")
        if score is not None and (best.best_model_score is None or score > float(best.best_model_score)):
            return str(last), final
    # The selected checkpoint's numbers, loaded by the strategy.
    return chosen, trainer.validate(
        module, datamodule=datamodule, ckpt_path=chosen, verbose=False, weights_only=True
    )[0]
