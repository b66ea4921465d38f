"""The training stage: shards (or token streams and the target, online; or shards while extraction writes
them, window) in, a trained head (checkpoints + serving export + report) out."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import lightning as L
from omegaconf import OmegaConf
from safetensors.torch import load_file

from eaglet.config.choices import TrainFeatures
from eaglet.config.schema import DraftConfig, EagletConfig, ModelConfig, TrainerConfig
from eaglet.errors import DataError, DiskFullError
from eaglet.formats.writer import export_eagle
from eaglet.fsutil import atomic_write_json, is_disk_full, remove_temporaries
from eaglet.run_dir import RunDir, resolve_ckpt_path
from eaglet.shards import Manifest, build_vocab_mapping, load_token_counts, read_manifest
from eaglet.shards.layout import TARGET_HEAD_FILE, shard_dir
from eaglet.shards.tokens import is_token_store
from eaglet.shards.window import read_retired, read_stream_plan
from eaglet.target_model.capture import resolve_aux_layer_ids
from eaglet.train.checkpoints import (
    CheckpointFiles,
    StepCheckpoint,
    check_checkpoint,
    read_checkpoint,
    select_head,
)
from eaglet.train.datamodule import ShardDataModule
from eaglet.train.disk_full import disk_full, said_if_disk_full
from eaglet.train.extensions import build_extensions, check_extensions
from eaglet.train.hardware import TrainerPlan, check_machine, plan_trainer
from eaglet.train.module import DraftHeadModule
from eaglet.train.online import TokenDataModule, check_token_store, load_online_target, token_store_dir
from eaglet.train.strategy import build_strategy
from eaglet.train.time_fit import FitStepsToTime
from eaglet.train.tracking import finish_wandb
from eaglet.train.warm_start import check_init_from, start_from_head
from eaglet.train.window import WindowDataModule
from eaglet.train.window_checkpoint import WindowCheckpoint
from eaglet.train.window_setup import WindowPlan, open_window


@dataclass
class TrainSummary:
    run_dir: str
    shard_dir: str
    steps: int
    epochs: int
    train_tokens_per_epoch: int
    global_batch_tokens: int
    tau_sim: float
    step_accuracy: list[float]
    val_loss: float
    best_checkpoint: str
    export_dir: str
    seconds: float


def check_manifest(model: ModelConfig, manifest: Manifest, directory: Path) -> None:
    """The shards must hold features, of this target, at these layers and this hidden size."""
    if is_token_store(manifest):
        raise DataError(
            f"{directory} holds token streams only (python extract.py extract.features=tokens), no hidden "
            "states: train on it with trainer.features=online, or extract hidden states for "
            "trainer.features=shards"
        )
    aux_ids = resolve_aux_layer_ids(model)
    t = manifest.target
    checks = [
        ("model.name", model.name, t.get("name")),
        ("model.num_layers", model.num_layers, t.get("num_layers")),
        ("model.hidden_size", model.hidden_size, manifest.hidden_size),
        ("model.vocab_size", model.vocab_size, manifest.vocab_size),
        ("model.aux_layer_ids", aux_ids, manifest.aux_layer_ids),
    ]
    for key, want, have in checks:
        if want != have:
            raise DataError(
                f"{directory} holds features of another target: {key}={want} in the config, {have} in its "
                "manifest; extract for this model (python extract.py model=...) or point "
                "extract.output_dir at the matching shards"
            )


def check_whole(manifest: Manifest, directory: Path) -> None:
    """Training from shards or online reads a complete folder whose shards are all there."""
    if not manifest.complete:
        beside = (
            "; or train beside it with trainer.features=window (it was started with extract.max_disk_gb)"
            if read_stream_plan(directory) is not None
            else ""
        )
        raise DataError(
            f"{directory}: extraction is not complete; re-run `python extract.py` (it resumes){beside}"
        )
    retired = read_retired(directory)
    if retired:
        raise DataError(
            f"{directory}: window training deleted shards {retired[:5]}{' ...' if len(retired) > 5 else ''} once "
            "it had trained on them (trainer.features=window): resume that run with trainer.features=window "
            "ckpt_path=last, or extract again into a new folder (extract.output_dir=..., or extract.overwrite=true)"
        )


def training_seed(cfg: EagletConfig) -> int:
    """The seed of the head's initialisation and its training batches' order: trainer.seed, else the top-level one."""
    return cfg.seed if cfg.trainer.seed is None else cfg.trainer.seed


def optimizer_steps(tr: TrainerConfig, datamodule: ShardDataModule, plan: TrainerPlan) -> int:
    """The run's optimizer steps: trainer.max_steps if set, else max_epochs x the steps of one epoch per rank."""
    if tr.max_steps > 0:
        return tr.max_steps
    micro_batches = datamodule.train_batches_per_rank(plan.world_size)
    # Lightning steps the optimizer on an epoch's last micro-batches too, however few are left: ceil, not floor
    # (which ended a run of many small epochs early, its learning-rate schedule with it).
    return tr.max_epochs * max(1, math.ceil(micro_batches / plan.accumulate_grad_batches))


def build_module(
    draft: DraftConfig,
    tr: TrainerConfig,
    manifest: Manifest,
    *,
    target_norm_eps: float,
    total_steps: int,
    num_aux: int | None = None,
) -> DraftHeadModule:
    """The LightningModule for these shards; its hyperparameters are plain values (weights_only checkpoints).

    num_aux: the aux states per token (None: the manifest's layers; online training computes its own)."""
    return DraftHeadModule(
        draft=OmegaConf.to_container(OmegaConf.structured(draft), resolve=True),
        target_hidden_size=manifest.hidden_size,
        vocab_size=manifest.vocab_size,
        draft_vocab_size=draft.vocab_size,
        num_aux=len(manifest.aux_layer_ids) if num_aux is None else num_aux,
        target_norm_eps=target_norm_eps,
        ttt_steps=tr.ttt_steps,
        step_loss_decay=tr.step_loss_decay,
        lr=tr.lr,
        weight_decay=tr.weight_decay,
        warmup_ratio=tr.warmup_ratio,
        total_steps=total_steps,
        lm_head_trainable=tr.lm_head_trainable,
        mask_outside_draft_vocab=tr.mask_outside_draft_vocab,
        feature_noise_std=tr.feature_noise_std,
        loss_chunk_tokens=tr.loss_chunk_tokens,
        attention=str(tr.attention),
        compile=tr.compile,
        full_vocab_train_accuracy=tr.full_vocab_train_accuracy,
        embed_dtype=None if tr.embed_dtype is None else str(tr.embed_dtype),
    )


def run_folder(cfg: EagletConfig, new_run: Path) -> tuple[RunDir, str | None]:
    """Where this run trains, and the checkpoint it resumes (None: a new run, in `new_run`).

    A run resumed from a checkpoint of a run folder continues in that folder: there its checkpoint callbacks
    find their own folder in the checkpoint and restore the best score and file so far (Lightning restores
    them only into the folder they were saved from).
    """
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, Path(cfg.paths.output_dir))
    run = RunDir(new_run)
    if ckpt_path is not None:
        check_checkpoint(ckpt_path)
        resumed = RunDir.of_checkpoint(ckpt_path)
        if resumed is not None and resumed.path != run.path.resolve():
            run.discard_if_unused()  # made for this command (Hydra's), now left empty: gone before any kill
            run = resumed
        warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        # ShardDataModule saves and restores the sampler's position itself; Lightning looks at the loader only.
        warnings.filterwarnings(
            "ignore", message="You're resuming from a checkpoint that ended before the epoch"
        )
    for folder in (run.path, run.checkpoints_dir, run.draft_dir):
        remove_temporaries(folder)  # of a run killed while writing there
    return run, ckpt_path


def run_training(cfg: EagletConfig, run_dir: Path, *, finish_tracking: bool = True) -> TrainSummary | None:
    """Train, select by val/tau_sim, export; the summary on rank 0 (None on other ranks).

    A new run trains in `run_dir`; a resumed one continues in the folder of its checkpoint (`run_folder`) and
    selects and exports the head the uninterrupted run would have.

    finish_tracking=False leaves a successful run's W&B run open for the caller (a sweep trial logs its
    measurements there, then closes it); a failed run is closed as failed either way.
    """
    start = time.perf_counter()
    check_extensions(cfg)
    check_machine(cfg.hardware)
    tr = cfg.trainer
    check_init_from(tr.init_from)
    online = tr.features == TrainFeatures.online
    window: WindowPlan | None = None
    if online:
        shards = token_store_dir(cfg)
    else:
        shards = shard_dir(cfg.paths.data_dir, cfg.model.name, cfg.dataset.name, cfg.extract.output_dir)
    if tr.features == TrainFeatures.window:
        window = open_window(cfg, shards)  # waits for the extraction beside it to start
        manifest = window.manifest
    else:
        manifest = read_manifest(shards)
        check_whole(manifest, shards)
    if online:
        check_token_store(cfg.model, manifest, shards)
    else:
        check_manifest(cfg.model, manifest, shards)
    d2t, t2d = build_vocab_mapping(load_token_counts(shards), cfg.draft.vocab_size)

    plan = plan_trainer(cfg.hardware, tr)
    target = load_online_target(cfg, plan, manifest, shards) if online else None
    aux_layer_ids = target.aux_layer_ids if target is not None else manifest.aux_layer_ids
    run, ckpt_path = run_folder(cfg, run_dir)
    L.seed_everything(training_seed(cfg), workers=True, verbose=False)

    if window is not None:
        datamodule = WindowDataModule(
            window.folder,
            window.schedule,
            plan.tokens_per_device,
            cfg.seed,
            loader_threads=tr.loader_threads,
            check_finite=True,
        )
        datamodule.setup()  # waits for the validation shard
        total_steps = window.optimizer_steps(plan)
        # One epoch of unknown length (the stream of rounds): validation every val_every_n_steps steps.
        val_interval = tr.val_every_n_steps * plan.accumulate_grad_batches
        # last.ckpt is what lets shards go: the window's own, in place of callbacks.last_checkpoint.
        window_checkpoint = WindowCheckpoint(
            run.checkpoints_dir, tr.checkpoint_every_n_steps, datamodule, str(run.path)
        )
    else:
        datamodule = (TokenDataModule if online else ShardDataModule)(
            shards,
            tokens_per_batch=plan.tokens_per_device,
            val_fraction=tr.val_fraction,
            train_fraction=tr.train_fraction,
            seed=cfg.seed,
            order_seed=training_seed(cfg),
            num_workers=tr.num_workers,
            check_finite=True,
            loader_threads=tr.loader_threads,
        )
        datamodule.setup()
        micro_batches = datamodule.train_batches_per_rank(plan.world_size)
        total_steps = optimizer_steps(tr, datamodule, plan)
        val_interval = min(micro_batches, tr.val_every_n_steps * plan.accumulate_grad_batches)
        window_checkpoint = None

    module = build_module(
        cfg.draft,
        tr,
        manifest,
        target_norm_eps=cfg.model.rms_norm_eps,
        total_steps=total_steps,
        num_aux=len(aux_layer_ids),
    )
    if target is None:
        module.init_from_target(load_file(shards / TARGET_HEAD_FILE), d2t, t2d)
    else:
        module.init_from_target(target.head_weights(), d2t, t2d)
        module.attach_target(target)
        if tr.online_overlap:
            datamodule.batch_transform = target.features
    if tr.init_from and ckpt_path is None:  # a resumed run's checkpoint holds the head as it was
        start_from_head(module.head, tr.init_from, module.hparams.draft, aux_layer_ids)

    failed = True
    try:
        # Inside the try: building the W&B logger starts its run, which a failure must close as failed.
        extensions = build_extensions(cfg, run.path, resumed=ckpt_path is not None)
        checkpoint = extensions.best_checkpoint
        callbacks = extensions.callbacks
        if window_checkpoint is not None:
            callbacks = [c for c in callbacks if not isinstance(c, StepCheckpoint)] + [window_checkpoint]
        if tr.fit_steps_to_time:
            callbacks = [*callbacks, FitStepsToTime()]
        trainer = L.Trainer(
            accelerator=plan.accelerator,
            devices=plan.devices,
            num_nodes=plan.num_nodes,
            precision=plan.precision,
            strategy=build_strategy(plan.strategy, plan.world_size),
            max_epochs=1 if window else tr.max_epochs if tr.max_steps <= 0 else -1,
            max_steps=-1 if window else total_steps,
            max_time=None if tr.max_time_s is None else timedelta(seconds=tr.max_time_s),
            accumulate_grad_batches=plan.accumulate_grad_batches,
            gradient_clip_val=tr.grad_clip,
            val_check_interval=val_interval,
            check_val_every_n_epoch=None if window else 1,
            logger=extensions.loggers or False,
            callbacks=callbacks,
            enable_progress_bar=extensions.progress_bar,
            plugins=[CheckpointFiles()],
            default_root_dir=run.path,
            use_distributed_sampler=False,
            log_every_n_steps=1,
            num_sanity_val_steps=0,
            enable_model_summary=False,
        )
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        last = run.last_checkpoint
        trainer.save_checkpoint(last, weights_only=False)  # the final state, whatever the periodic interval
        if window is not None and trainer.is_global_zero:  # every round done, and checkpointed
            datamodule.retire_done(window.schedule.rounds, str(run.path))
        best, metrics = select_head(
            trainer, module, datamodule, checkpoint, last, validate=tr.val_fraction > 0
        )
        failed = False
    except OSError as exc:  # checkpoints, head and the atomic writer say so themselves; this is the rest
        if not is_disk_full(exc):
            raise
        raise disk_full(run.path, "training", run.last_checkpoint) from None
    finally:
        if failed or finish_tracking:
            finish_wandb(failed)

    if trainer.global_rank != 0:
        return None
    # Exported from a plain copy of the selected checkpoint, whatever strategy trained it.
    selected = build_module(
        cfg.draft,
        tr,
        manifest,
        target_norm_eps=cfg.model.rms_norm_eps,
        total_steps=total_steps,
        num_aux=len(aux_layer_ids),
    )
    selected.load_state_dict(read_checkpoint(best, map_location="cpu")["state_dict"])
    try:
        export_dir = export_eagle(
            selected.head,
            DraftConfig(**OmegaConf.to_container(cfg.draft, resolve=True)),
            run.draft_dir,
            aux_layer_ids=aux_layer_ids,
            overwrite=True,  # a run trained again into its folder (a pinned hydra.run.dir) replaces its head
        )
    except DiskFullError:  # the writer's message says to export elsewhere; a run finishes in its folder
        raise disk_full(run.draft_dir, "exporting the head", run.last_checkpoint) from None
    summary = TrainSummary(
        run_dir=str(run.path),
        shard_dir=str(shards),
        steps=int(trainer.global_step),
        epochs=tr.max_epochs if window else int(trainer.current_epoch),
        train_tokens_per_epoch=window.train_tokens if window else datamodule.train_tokens,
        global_batch_tokens=plan.global_batch_tokens,
        tau_sim=float(metrics.get("val/tau_sim", float("nan"))),
        step_accuracy=[float(metrics.get(f"val/acc_{k}", float("nan"))) for k in range(tr.ttt_steps)],
        val_loss=float(metrics.get("val/loss", float("nan"))),
        best_checkpoint=str(best),
        export_dir=str(export_dir),
        seconds=time.perf_counter() - start,
    )
    with said_if_disk_full(run.path, f"writing {run.report_file.name}", run.last_checkpoint):
        atomic_write_json(run.report_file, asdict(summary))
    return summary
