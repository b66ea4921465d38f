"""Evaluate a trained head by speculative decoding against the real target, beside n-gram lookup.

python evaluate.py                                         # the newest run, embedded default
python evaluate.py eval.run=outputs/train/<time> eval.sets=[mt_bench_like,code,math] eval.num_spec_tokens=5
python evaluate.py +eval.set_defs.mine.path=/data/prompts.jsonl +eval.set_defs.mine.count=50 eval.sets=[mine]
"""

from pathlib import Path

import hydra

from eaglet.cli import user_errors
from eaglet.config import check_config  # (importing eaglet.config registers the schemas)
from eaglet.config.schema import EagletConfig
from eaglet.evaluate.record import track_evaluation
from eaglet.evaluate.stage import plot_acceptance, run_evaluation, serve_commands
from eaglet.run_dir import RunDir


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
@user_errors
def main(cfg: EagletConfig) -> None:
    check_config(cfg)
    results = run_evaluation(cfg)
    run = Path(results["run"])
    plot = plot_acceptance(results, run / "acceptance.png")
    track_evaluation(cfg, results, plot)  # into the training run's W&B record
    print(f"\nper-position acceptance: {plot}\nresults: {RunDir(run).results_file}\nserve the head:\n")
    print(serve_commands(run, cfg.eval.num_spec_tokens))


if __name__ == "__main__":
    main()
