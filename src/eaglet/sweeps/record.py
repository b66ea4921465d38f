"""A sweep's summary in W&B: a run of its own in the trials' group (the sweep folder's name), with the
recommended setting, a table of the trials and the heatmap. Its id is kept in the sweep folder, so summarising
again (for other hardware, after more trials) updates the same run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.run_dir import RunDir
from eaglet.sweeps.collect import Trial
from eaglet.sweeps.report import Recommendation, Row
from eaglet.tracking import log_results


def summary_values(rows: list[Row], rec: Recommendation | None) -> dict[str, Any]:
    values: dict[str, Any] = {
        "sweep/trials": len(rows),
        "sweep/finished": sum(r.status == "ok" for r in rows),
    }
    if rec is not None:
        values.update({
            "sweep/best_trial": Path(rec.row.folder).name,
            "sweep/best_ttt_steps": rec.row.ttt_steps,
            "sweep/best_draft_vocab_size": rec.row.draft_vocab_size,
            "sweep/best_draft_length": rec.draft_length,
            "sweep/best_tau": rec.tau,
            "sweep/best_speedup": rec.speedup,
            "sweep/vllm": rec.command,
        })  # fmt: skip
        # τ decoded in process: how often the pick stays best over resampled prompts
        if rec.best_share is not None:
            values["sweep/best_share"] = rec.best_share
    return values


def trials_table(rows: list[Row]) -> tuple[list[str], list[list[Any]]]:
    k_max = max((len(r.tau) for r in rows), default=0)
    columns = [
        "trial",
        "name",
        "status",
        "ttt_steps",
        "draft_vocab_size",
        "vocab_coverage",
        "best_draft_length",
    ]
    columns += [f"tau@{k}" for k in range(1, k_max + 1)] + [f"speedup@{k}" for k in range(1, k_max + 1)]
    columns.append("error")
    pad = [None] * k_max
    table = [
        [r.trial, Path(r.folder).name, r.status, r.ttt_steps, r.draft_vocab_size, r.vocab_coverage,
         r.best_draft_length, *(r.tau + pad)[:k_max], *(r.speedup + pad)[:k_max], r.error]
        for r in rows
    ]  # fmt: skip
    return columns, table


def track_sweep(
    sweep_dir: Path, trials: list[Trial], rows: list[Row], rec: Recommendation | None, heatmap: Path
) -> str | None:
    """Write the summary into the sweep's W&B run (project and entity of the trials' config)."""
    settings = next((s for s in (RunDir(t.folder).settings() for t in trials) if s is not None), None)
    wandb_cfg = settings.get("wandb", {}) if settings is not None else {}
    return log_results(
        sweep_dir,
        summary=summary_values(rows, rec),
        images={"sweep/heatmap": heatmap},
        tables={"sweep/trials": trials_table(rows)},
        project=wandb_cfg.get("project") or "eaglet",
        entity=wandb_cfg.get("entity"),
        group=sweep_dir.name,  # the trials' group (eaglet.train.tracking.sweep_group)
        name=f"{sweep_dir.name}-summary",
        job_type="sweep-summary",
    )
