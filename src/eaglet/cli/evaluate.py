"""Evaluate a trained head by speculative decoding against the real target (in this process, or through vLLM or
SGLang servers), beside n-gram lookup.

eaglet-evaluate                                            # the newest run, embedded default
eaglet-evaluate eval.run=outputs/train/<time> eval.sets=[mt_bench_like,code,math] eval.num_spec_tokens=5
eaglet-evaluate +eval.set_defs.mine.path=/data/prompts.jsonl +eval.set_defs.mine.count=50 eval.sets=[mine]
eaglet-evaluate eval.backend=vllm_server model=kimi_k2_5 model.path=/models/Kimi-K2.5 hardware=b200_nvl8
eaglet-evaluate eval.backend=sglang_server eval.server.url=http://host:30000   # a server you started
"""

from pathlib import Path

import hydra

from eaglet.cli import user_errors
from eaglet.config import CONF_DIR, check_config  # (importing eaglet.config registers the schemas)
from eaglet.config.schema import EagletConfig


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@user_errors
def main(cfg: EagletConfig) -> None:
    check_config(cfg)
    from eaglet.evaluate.record import track_evaluation
    from eaglet.evaluate.stage import plot_acceptance, run_evaluation, serve_commands
    from eaglet.run_dir import RunDir

    results = run_evaluation(cfg)
    run = Path(results["run"])
    plot = plot_acceptance(results, run / "acceptance.png")
    track_evaluation(cfg, results, plot)  # into the training run's W&B record
    print(f"\nper-position acceptance: {plot}\nresults: {RunDir(run).results_file}\nserve the head:\n")
    print(serve_commands(run, cfg.eval.num_spec_tokens))


if __name__ == "__main__":
    main()
