"""A sweep's results for one deployment: a row per trial, the recommended setting, and the table."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from eaglet.evaluate.intervals import prompt_draws, resampled_taus
from eaglet.sweeps.collect import Trial
from eaglet.sweeps.serving import Deployment, predicted_speedups, vllm_command


@dataclass
class Row:
    trial: int | None
    status: str
    ttt_steps: int | None
    draft_vocab_size: int | None
    vocab_coverage: float | None
    tau: list[float]  # τ at draft lengths 1..K_max (empty for a failed trial)
    speedup: list[float]  # predicted for the deployment, same lengths
    folder: str
    draft_dir: str | None
    error: str
    # Per draft length, each prompt's accepted and step counts, when τ was decoded in process (not from
    # validation or a server): what `best_shares` resamples.
    per_prompt: list[dict[str, list[int]]] | None = None

    @property
    def best_draft_length(self) -> int | None:
        return max(range(len(self.speedup)), key=self.speedup.__getitem__) + 1 if self.speedup else None


@dataclass
class Recommendation:
    row: Row
    draft_length: int
    tau: float
    speedup: float
    command: str
    # How often this setting stays the best when the prompts are resampled, and the settings that win the
    # rest of the time: (trial, draft length, share). None when the trials' τ cannot be resampled.
    best_share: float | None = None
    rivals: list[tuple[int | None, int, float]] = field(default_factory=list)


def build_rows(trials: list[Trial], deployment: Deployment) -> list[Row]:
    rows = []
    for t in trials:
        d = t.data
        tau = list(d.get("tau", [])) if t.ok else []
        rows.append(
            Row(
                trial=t.number,
                status=t.status,
                ttt_steps=d.get("ttt_steps"),
                draft_vocab_size=d.get("draft_vocab_size"),
                vocab_coverage=d.get("vocab_coverage"),
                tau=tau,
                speedup=predicted_speedups(deployment, d["draft_vocab_size"], tau) if tau else [],
                folder=str(t.folder),
                draft_dir=d.get("draft_dir"),
                error=t.error,
                per_prompt=(d.get("decode") or {}).get("per_prompt") if t.ok else None,
            )
        )
    return rows


def recommend(rows: list[Row], deployment: Deployment) -> Recommendation | None:
    """The (trial, draft length) of the highest predicted speedup; None when no trial succeeded."""
    candidates = [(s, i, k) for i, row in enumerate(rows) for k, s in enumerate(row.speedup, start=1)]
    if not candidates:
        return None
    speedup, index, k = max(candidates, key=lambda c: c[0])
    row = rows[index]
    command = vllm_command(row.draft_dir or f"{row.folder}/draft", k, deployment.tensor_parallel_size)
    rec = Recommendation(row=row, draft_length=k, tau=row.tau[k - 1], speedup=speedup, command=command)
    shares = best_shares(rows)
    if shares is not None:
        rec.best_share = shares.pop((index, k), 0.0)
        rivals = [(rows[i].trial, length, share) for (i, length), share in shares.items()]
        rec.rivals = sorted(rivals, key=lambda rival: -rival[2])
    return rec


def best_shares(rows: list[Row], samples: int = 1000, seed: int = 0) -> dict[tuple[int, int], float] | None:
    """How often each (row index, draft length) predicts the highest speedup when the prompts are resampled;
    only those that win at least once. Every trial decoded the same prompts, so each resample draws the same
    prompts for all. None when a finished trial has no per-prompt counts (τ from validation or a server) or
    the trials counted different numbers of prompts."""
    finished = [(i, r) for i, r in enumerate(rows) if r.speedup]
    if not finished or any(r.per_prompt is None for _, r in finished):
        return None
    prompts = {len(counts["accepted"]) for _, r in finished for counts in r.per_prompt}
    if len(prompts) != 1 or 0 in prompts:
        return None
    draws = prompt_draws(prompts.pop(), samples, seed)
    keys, speedups = [], []
    for i, row in finished:
        for k, (tau, speedup) in enumerate(zip(row.tau, row.speedup, strict=True), start=1):
            # The predicted step costs do not depend on τ: the speedup is τ times a rate per draft length.
            keys.append((i, k))
            speedups.append(resampled_taus(draws, row.per_prompt[k - 1]) * (speedup / tau))
    wins = np.bincount(np.argmax(np.stack(speedups), axis=0), minlength=len(keys))
    return {keys[j]: float(wins[j]) / samples for j in np.flatnonzero(wins)}


def summary_dict(rows: list[Row], rec: Recommendation | None, deployment: Deployment) -> dict[str, Any]:
    return {
        "deployment": {"model": deployment.model.name, "hardware": deployment.hardware.name},
        "rows": [
            {
                **{k: v for k, v in row.__dict__.items() if k != "per_prompt"},
                "best_draft_length": row.best_draft_length,
            }
            for row in rows
        ],
        "recommendation": None
        if rec is None
        else {
            "trial": rec.row.trial,
            "ttt_steps": rec.row.ttt_steps,
            "draft_vocab_size": rec.row.draft_vocab_size,
            "draft_length": rec.draft_length,
            "tau": rec.tau,
            "speedup": rec.speedup,
            "draft_dir": rec.row.draft_dir,
            "vllm": rec.command,
            "best_share": rec.best_share,
            "rivals": [{"trial": t, "draft_length": k, "share": share} for t, k, share in rec.rivals],
        },
    }


def rich_table(rows: list[Row], deployment: Deployment) -> Table:
    k_max = max((len(r.tau) for r in rows), default=0)
    table = Table(
        title=f"τ per draft length; speedup predicted for {deployment.model.name} on {deployment.hardware.name}"
    )
    table.add_column("trial", justify="right")
    table.add_column("name")
    for name in ("status", "ttt", "vocab", "coverage", *(f"τ@{k}" for k in range(1, k_max + 1))):
        table.add_column(name, justify="right")
    table.add_column("best K", justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("error")
    for r in rows:
        best = r.best_draft_length
        taus = [f"{t:.3f}" for t in r.tau] + [""] * (k_max - len(r.tau))
        table.add_row(
            "" if r.trial is None else str(r.trial),
            Path(r.folder).name,
            r.status,
            "" if r.ttt_steps is None else str(r.ttt_steps),
            "" if r.draft_vocab_size is None else str(r.draft_vocab_size),
            "" if r.vocab_coverage is None else f"{r.vocab_coverage:.1%}",
            *taus,
            "" if best is None else str(best),
            "" if best is None else f"{r.speedup[best - 1]:.3f}x",
            r.error[:80],
        )
    return table
