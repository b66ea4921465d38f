"""The printed summary of a training run."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from eaglet.train.run import TrainSummary


def print_summary(summary: TrainSummary, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"training: {summary.run_dir}", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    accuracy = "  ".join(f"acc_{k}={a:.3f}" for k, a in enumerate(summary.step_accuracy))
    rows = [
        ("val tau_sim", f"{summary.tau_sim:.3f}"),
        ("val per-step accuracy", accuracy),
        ("val loss", f"{summary.val_loss:.4f}"),
        ("steps (epochs)", f"{summary.steps} ({summary.epochs})"),
        (
            "tokens per epoch / per step",
            f"{summary.train_tokens_per_epoch:,} / {summary.global_batch_tokens:,}",
        ),
        ("wall time", f"{summary.seconds:.0f} s"),
        ("best checkpoint", summary.best_checkpoint),
        ("serving export (EAGLE format)", summary.export_dir),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
