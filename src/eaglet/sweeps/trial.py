"""One sweep trial: train, measure the head at serving draft lengths 1..K_max, write sweep_trial.json.

A trial that raises (out of memory at a large vocab, a setting the data cannot meet, ...) is recorded as
failed in its folder and in its W&B run, and returns None: the study goes on (the optuna sweeper marks a
value that is not a number as a failed trial; a NaN would trip it) and the summary lists it.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from eaglet.config import check_config
from eaglet.config.schema import EagletConfig
from eaglet.errors import ConfigError
from eaglet.fsutil import atomic_write_json
from eaglet.run_dir import RunDir
from eaglet.shards import build_vocab_mapping, load_token_counts
from eaglet.shards.layout import shard_dir
from eaglet.sweeps.launch import adopt_submitit_local_tasks, check_one_process_per_rank, link_trial_logs
from eaglet.sweeps.serving import Deployment, predicted_speedups, resolve_deployment
from eaglet.sweeps.simulated import simulated_curve
from eaglet.sweeps.tau_source import DECODE, SERVER, TauChoice, choose_tau_source
from eaglet.train.hardware import plan_trainer
from eaglet.train.report import print_summary
from eaglet.train.run import run_training
from eaglet.train.tracking import finish_wandb, trial_run_name

TRIAL_FILE = "sweep_trial.json"

log = logging.getLogger(__name__)


def check_sweep_settings(cfg: EagletConfig) -> None:
    sw = cfg.sweep
    if sw.max_draft_length < 1:
        raise ConfigError(f"sweep.max_draft_length must be >= 1, got {sw.max_draft_length}")
    if cfg.trainer.features != "shards":
        # Each trial measures its head's τ_sim at every draft length on the validation shards' features, and
        # trains on the whole data (window training deletes each shard once trained on: one trial's worth).
        raise ConfigError(
            f"sweeps read the target's features from shards (each trial's τ_sim curve, every trial on the same "
            f"data), not with trainer.features={cfg.trainer.features}: extract hidden states and sweep with "
            "trainer.features=shards"
        )


def vocab_coverage(shards: Path, draft_vocab_size: int) -> float:
    """Share of the loss-masked training tokens that the draft vocab holds (from the stored counts)."""
    counts = load_token_counts(shards)
    _, t2d = build_vocab_mapping(counts, draft_vocab_size)
    return float(counts[t2d].sum() / counts.sum())


def objective_value(objective: str, taus: list[float], speedups: list[float]) -> float:
    return max(speedups) if objective == "speedup" else taus[-1]


def measure(
    cfg: EagletConfig, run_dir: Path, shards: Path, deployment: Deployment, source: str
) -> dict[str, Any]:
    """The simulated τ curve of the exported head and, by `source`, a decoded one (in this process or through a
    server), and the predicted speedups of the chosen one."""
    sw, tr = cfg.sweep, cfg.trainer
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sim = simulated_curve(
        RunDir(run_dir).draft_dir,
        shards,
        k_max=sw.max_draft_length,
        target_norm_eps=cfg.model.rms_norm_eps,
        tokens_per_batch=plan_trainer(cfg.hardware, tr).tokens_per_device,
        val_fraction=tr.val_fraction,
        seed=cfg.seed,
        chunk_tokens=tr.loss_chunk_tokens,
        device=device,
    )
    decode = served = None
    if source == DECODE:
        from eaglet.sweeps.decode import decode_curve

        decode = decode_curve(cfg, RunDir(run_dir).draft_dir, sw.max_draft_length)
    elif source == SERVER:
        from eaglet.sweeps.served import server_curve

        served = server_curve(cfg, RunDir(run_dir).draft_dir, sw.max_draft_length)
    taus = (decode or served or sim)["tau"]
    speedups = predicted_speedups(deployment, cfg.draft.vocab_size, taus)
    best = max(range(len(speedups)), key=speedups.__getitem__)
    return {
        "tau": taus,
        "speedup": speedups,
        "best_draft_length": best + 1,
        "best_speedup": speedups[best],
        "objective_value": objective_value(sw.objective, taus, speedups),
        "sim": sim,
        "decode": decode,
        "server": served,
    }


def _say(choice: TauChoice) -> None:
    """One line, before training, on where this trial's τ will come from."""
    if rank_zero_only.rank == 0:
        log.info(choice.line())


def _log_to_wandb(result: dict[str, Any]) -> None:
    """The measurements as the trial's W&B summary (the run stays the training run of this trial)."""
    wandb = sys.modules.get("wandb")  # imported only when tracking is on
    if wandb is None or wandb.run is None:
        return
    summary: dict[str, Any] = {
        "sweep/objective": result["objective_value"],
        "sweep/best_draft_length": result["best_draft_length"],
        "sweep/best_speedup": result["best_speedup"],
    }
    for k, (tau, speedup) in enumerate(zip(result["tau"], result["speedup"], strict=True), start=1):
        summary[f"sweep/tau_{k}"] = tau
        summary[f"sweep/speedup_{k}"] = speedup
    wandb.run.summary.update(summary)


def _identity(cfg: EagletConfig, run_dir: Path) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    return {
        "trial": int(hydra_cfg.job.num)
        if hydra_cfg is not None and hydra_cfg.job.get("num") is not None
        else None,
        "overrides": list(hydra_cfg.overrides.task) if hydra_cfg is not None else [],
        "name": trial_run_name() or run_dir.name,  # the swept values, as the W&B run is named
        "run_dir": str(run_dir),
        "ttt_steps": int(cfg.trainer.ttt_steps),
        "draft_vocab_size": int(cfg.draft.vocab_size),
        "max_draft_length": int(cfg.sweep.max_draft_length),
        "tau_source": str(cfg.sweep.tau_source),
        "objective": str(cfg.sweep.objective),
    }


def run_trial(cfg: EagletConfig, run_dir: Path) -> float | None:
    """Train and measure; the objective value (None for a failed trial, and on ranks other than 0)."""
    start = time.perf_counter()
    adopt_submitit_local_tasks()
    record = _identity(cfg, run_dir)
    write = rank_zero_only.rank == 0
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        link_trial_logs(run_dir)
        atomic_write_json(run_dir / TRIAL_FILE, {**record, "status": "running"})
    try:
        check_config(cfg)
        check_sweep_settings(cfg)
        check_one_process_per_rank(plan_trainer(cfg.hardware, cfg.trainer).world_size)
        choice = choose_tau_source(cfg)
        record.update(tau_source=choice.source, tau_source_reason=choice.reason)
        _say(choice)
        deployment = resolve_deployment(
            cfg.model, cfg.draft, cfg.hardware, cfg.sweep.serve_model, cfg.sweep.serve_hardware
        )
        shards = shard_dir(cfg.paths.data_dir, cfg.model.name, cfg.dataset.name, cfg.extract.output_dir)
        summary = run_training(cfg, run_dir, finish_tracking=False)
        if summary is None:  # not rank 0: rank 0 measures and reports
            return None
        print_summary(summary)
        result = measure(cfg, run_dir, shards, deployment, choice.source)
        result["vocab_coverage"] = vocab_coverage(shards, cfg.draft.vocab_size)
        _log_to_wandb(result)
        finish_wandb(failed=False)
    except Exception as exc:  # any failure ends this trial only
        finish_wandb(failed=True)
        log.error("sweep trial failed: %s: %s", type(exc).__name__, exc)
        if write:
            atomic_write_json(
                run_dir / TRIAL_FILE,
                {
                    **record,
                    "status": "failed",
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=8),
                    "seconds": time.perf_counter() - start,
                },
            )
        return None
    atomic_write_json(
        run_dir / TRIAL_FILE,
        {
            **record,
            "status": "ok",
            **result,
            "serve": deployment.to_dict(),
            "draft_dir": summary.export_dir,
            "train": {k: v for k, v in asdict(summary).items() if k not in ("run_dir", "export_dir")},
            "seconds": time.perf_counter() - start,
        },
    )
    print(
        f"sweep trial: objective ({cfg.sweep.objective}) {result['objective_value']:.4g}, best draft length "
        f"{result['best_draft_length']}, τ {[round(t, 3) for t in result['tau']]}"
    )
    return float(result["objective_value"])
