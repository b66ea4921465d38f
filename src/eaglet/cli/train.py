"""Train an EAGLE-3 draft head on extracted shards (KD + training-time test).

eaglet-train                                        # embedded default on this CPU (run eaglet-extract first)
eaglet-train hardware=b200_nvl8 model=kimi_k2_5 trainer.ttt_steps=7 draft.vocab_size=32000
eaglet-train ckpt_path=last                         # resume the newest run, in its own folder
eaglet-train trainer.features=online                # the target runs in each step (extract.features=tokens first)
eaglet-train trainer.features=window extract.max_disk_gb=200   # beside `eaglet-extract extract.max_disk_gb=200`
eaglet-train sweeps=draft_length_vocab              # a sweep (conf/sweeps/*.yaml); each trial returns its objective
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from eaglet.cli import user_errors
from eaglet.config import CONF_DIR, check_config  # (importing eaglet.config registers the schemas)
from eaglet.config.schema import EagletConfig


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@user_errors
def main(cfg: EagletConfig) -> float | None:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.sweep.enabled:  # a sweep trial: never raises (it checks the config itself), returns the objective
        from eaglet.sweeps.trial import run_trial

        return run_trial(cfg, output_dir)
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from eaglet.run_dir import RunDir
    from eaglet.train.report import print_summary
    from eaglet.train.run import run_training

    started_in = RunDir(output_dir)
    try:
        check_config(cfg)
        summary = run_training(cfg, started_in.path)
    finally:
        # Left empty by a run that failed before training, or that continued in the run it resumed.
        if rank_zero_only.rank == 0:
            started_in.discard_if_unused()
    if summary is None:  # not rank 0
        return None
    print_summary(summary)
    return summary.tau_sim


if __name__ == "__main__":
    main()
