"""Evaluation wall clock against eval.workers: the same prompts, decoded by 1, 2, ... processes side by side.

    python benchmarks/bench_eval_workers.py experiments=smollm2_scale eval.run=<run> model.dtype=float32 \
        eval.prompts_per_set=8 bench.workers=1,4,8          # one GPU
    python benchmarks/bench_eval_workers.py experiments=smollm2_scale eval.run=<run> eval.device=cpu \
        eval.prompts_per_set=2 eval.sets=[mt_bench_like] bench.workers=1,2

Runs `evaluate.py`'s stage (eaglet.evaluate.stage.run_evaluation) once per workers value on a copy of the run's
head (the run's own eval.json is left alone), times it start to end (process start-up and target loading
included; the weights are read once before, untimed), checks that every value counts the same acceptance as the first, and appends a row to
experiments/BENCHMARKS.md with the command, machine and date.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from bench_common import machine, parse_bench_options
from hydra import compose, initialize_config_dir

import eaglet.config
from eaglet.config import check_config
from eaglet.evaluate.stage import run_evaluation
from eaglet.run_dir import RunDir
from eaglet.target_model import load_target

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS = {"workers": "1,2", "record": 1}


def counts(results: dict) -> dict:
    """(set, proposer) -> what decoding counted: the same whatever the number of processes."""
    keys = ("steps", "accepted", "proposed", "new_tokens", "target_forwards", "near_ties")
    return {
        (name, proposer): tuple(r[k] for k in keys)
        for name, entry in results["sets"].items()
        for proposer, r in entry["results"].items()
    }


def main(argv: list[str]) -> None:
    opts, overrides = parse_bench_options(argv, DEFAULTS, paths=("workers",))
    workers = [int(w) for w in str(opts["workers"]).split(",")]
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        base = compose("config", overrides=overrides)
    run = RunDir.resolve(base.eval.run, Path(base.paths.output_dir), key="eval.run")
    # Untimed: the first load reads the weights from disk (or converts them) and imports the libraries; the
    # timed runs then start alike (a cold first run once read as a 1.34x gain of two CPU processes over one).
    load_target(base.model, device="cpu", cache_dir=Path(base.paths.cache_dir))
    rows, first = [], None
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / run.path.name
        shutil.copytree(run.draft_dir, copy / RunDir.DRAFT_DIR)
        shutil.copytree(run.path / ".hydra", copy / ".hydra")
        for n in workers:
            with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
                cfg = compose("config", overrides=[*overrides, f"eval.run={copy}", f"eval.workers={n}"])
            check_config(cfg)
            start = time.perf_counter()
            results = run_evaluation(cfg)
            seconds = time.perf_counter() - start
            if first is None:
                first = results
            elif counts(results) != counts(first):
                raise SystemExit(f"eval.workers={n} counted otherwise than eval.workers={workers[0]}: a bug")
            prompts = sum(e["prompts"] for e in results["sets"].values())
            taus = " / ".join(f"{e['results']['eaglet']['tau']:.2f}" for e in results["sets"].values())
            rows.append((n, prompts, seconds, taus))
    sets = ", ".join(first["sets"])
    header = (
        f"| date | machine | target | workers | prompts | seconds | prompts/s | vs {workers[0]} | eaglet τ ({sets}) |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {date.today()} | {machine()} | {base.model.name} ({base.model.dtype}, {base.eval.device}) | {n} | "
        f"{prompts} | {seconds:,.1f} | {prompts / seconds:.2f} | {rows[0][2] / seconds:.2f}x | {taus} |"
        for n, prompts, seconds, taus in rows
    ]
    table = header + "\n" + "\n".join(lines)
    print(table)
    if opts["record"]:
        command = "python benchmarks/bench_eval_workers.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(f"\n### Evaluation in worker processes — `{command.strip()}`\n\n{table}\n")
        print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
