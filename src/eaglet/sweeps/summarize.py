"""Summarise a sweep: table, heatmap PNG, the recommended setting and its vLLM command.

python -m eaglet.sweeps.summarize outputs/multirun/draft_length_vocab-<time>
python -m eaglet.sweeps.summarize outputs/multirun/optuna_tau-<time> --model kimi_k2_5 --hardware b200_nvl8
python -m eaglet.sweeps.summarize                      # the newest sweep under outputs/multirun

Speedups are predicted for the deployment the trials recorded (sweep.serve_model / sweep.serve_hardware),
or for --model / --hardware (names under conf/model, conf/hardware) from the same measured τ curves.
Writes <sweep>/summary.json and <sweep>/heatmap.png, and the same into the sweep's W&B run (group: the sweep
folder's name, as its trials'; offline unless wandb has credentials, WANDB_MODE=disabled for none).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

import eaglet.config  # noqa: F401  (registers the schemas and resolvers)
from eaglet.config import project_root
from eaglet.errors import DataError, EagletError
from eaglet.fsutil import atomic_write_json
from eaglet.run_dir import RunDir
from eaglet.sweeps.collect import Trial, load_trials, newest_sweep
from eaglet.sweeps.plot import plot_heatmaps
from eaglet.sweeps.record import track_sweep
from eaglet.sweeps.report import Recommendation, Row, build_rows, recommend, rich_table, summary_dict
from eaglet.sweeps.serving import Deployment, resolve_deployment

SUMMARY_FILE, HEATMAP_FILE = "summary.json", "heatmap.png"


@dataclass
class SweepSummary:
    sweep_dir: Path
    deployment: Deployment
    rows: list[Row]
    recommendation: Recommendation | None
    summary_path: Path
    heatmap_path: Path


def _deployment(trials: list[Trial], model: str | None, hardware: str | None) -> Deployment:
    """--model / --hardware over what the trials predicted for (their composed config if none finished)."""
    recorded = next((Deployment.from_dict(t.data["serve"]) for t in trials if t.ok), None)
    if recorded is None:
        cfg = next((RunDir(t.folder).settings() for t in trials), None)
        if cfg is None:
            raise DataError(
                f"{trials[0].folder}: no finished trial and no .hydra/config.yaml to read the target from"
            )
        recorded = Deployment(cfg.model, cfg.draft, cfg.hardware)
    return resolve_deployment(recorded.model, recorded.draft, recorded.hardware, model, hardware)


def summarize(sweep_dir: Path, model: str | None = None, hardware: str | None = None) -> SweepSummary:
    trials = load_trials(sweep_dir)
    deployment = _deployment(trials, model, hardware)
    rows = build_rows(trials, deployment)
    rec = recommend(rows, deployment)
    summary_path = sweep_dir / SUMMARY_FILE
    atomic_write_json(summary_path, summary_dict(rows, rec, deployment))
    title = f"{sweep_dir.name}\nspeedup predicted for {deployment.model.name} on {deployment.hardware.name}"
    heatmap = plot_heatmaps(rows, rec, sweep_dir / HEATMAP_FILE, title)
    track_sweep(sweep_dir, trials, rows, rec, heatmap)
    return SweepSummary(sweep_dir, deployment, rows, rec, summary_path, heatmap)


def print_report(result: SweepSummary, console: Console) -> None:
    console.print(rich_table(result.rows, result.deployment))
    failed = [r for r in result.rows if r.status != "ok"]
    if failed:
        console.print(f"{len(failed)} of {len(result.rows)} trials did not finish: see the error column")
    rec = result.recommendation
    if rec is None:
        console.print("no trial finished: nothing to recommend")
    else:
        console.print(
            f"\nrecommended for {result.deployment.model.name} on {result.deployment.hardware.name}: "
            f"trainer.ttt_steps={rec.row.ttt_steps} draft.vocab_size={rec.row.draft_vocab_size}, "
            f"serve {rec.draft_length} draft tokens: τ {rec.tau:.3f}, predicted speedup {rec.speedup:.3f}x "
            f"(trial {rec.row.trial}, {rec.row.folder})"
        )
        if rec.best_share is not None:
            console.print(how_sure(rec))
        console.print(rec.command, soft_wrap=True, markup=False, highlight=False)
        if rec.speedup <= 1.0:
            console.print(
                "no setting is predicted to beat plain decoding there: train on more data (EAGLE3.md section 6) "
                "or serve without speculation"
            )
    console.print(f"\nsummary: {result.summary_path}\nheatmap: {result.heatmap_path}")


def how_sure(rec: Recommendation) -> str:
    """One line: how often the recommended setting stays the best when the evaluation prompts are resampled."""
    line = f"best in {rec.best_share:.0%} of resamples of the evaluation prompts"
    shown = [f"trial {t} at {k} draft tokens in {share:.0%}" for t, k, share in rec.rivals if share >= 0.05]
    if rec.best_share >= 0.95 or not shown:
        return line
    return (
        f"{line}, {', '.join(shown)}: on these prompts they cannot be told apart; more prompts "
        "(eval.prompts_per_set) would tell"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eaglet.sweeps.summarize", description=__doc__.split("\n")[0]
    )
    parser.add_argument("sweep_dir", nargs="?", type=Path, help="the sweep folder; default: the newest one")
    parser.add_argument("--model", help="target to predict the speedup for (a name under conf/model)")
    parser.add_argument("--hardware", help="hardware to predict the speedup on (a name under conf/hardware)")
    args = parser.parse_args(argv)
    try:
        sweep_dir = args.sweep_dir or newest_sweep(project_root() / "outputs")
        result = summarize(sweep_dir, args.model, args.hardware)
    except EagletError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(result, Console(width=200))
    return 0


if __name__ == "__main__":
    sys.exit(main())
