"""A sweep's results for one deployment: a row per trial, the recommended setting, and the table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

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
            )
        )
    return rows


def recommend(rows: list[Row], deployment: Deployment) -> Recommendation | None:
    """The (trial, draft length) of the highest predicted speedup; None when no trial succeeded."""
    candidates = [(s, row, k) for row in rows for k, s in enumerate(row.speedup, start=1)]
    if not candidates:
        return None
    speedup, row, k = max(candidates, key=lambda c: c[0])
    command = vllm_command(row.draft_dir or f"{row.folder}/draft", k, deployment.tensor_parallel_size)
    return Recommendation(row=row, draft_length=k, tau=row.tau[k - 1], speedup=speedup, command=command)


def summary_dict(rows: list[Row], rec: Recommendation | None, deployment: Deployment) -> dict[str, Any]:
    return {
        "deployment": {"model": deployment.model.name, "hardware": deployment.hardware.name},
        "rows": [{**row.__dict__, "best_draft_length": row.best_draft_length} for row in rows],
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
