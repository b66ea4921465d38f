"""Train an EAGLE-3 draft head on extracted shards (KD + training-time test).

python train.py                                     # embedded default on this CPU (run extract.py first)
python train.py hardware=b200_nvl8 model=kimi_k2_5 trainer.ttt_steps=7 draft.vocab_size=32000
python train.py ckpt_path=last                      # resume the newest run, in its own folder
python train.py trainer.features=online             # the target runs in each step (extract.features=tokens first)
python train.py trainer.features=window extract.max_disk_gb=200   # beside `python extract.py extract.max_disk_gb=200`
python train.py sweeps=draft_length_vocab           # a sweep (sweeps/*.yaml); each trial returns its objective
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.utilities.rank_zero import rank_zero_only

from eaglet.cli import user_errors
from eaglet.config import check_config  # (importing eaglet.config registers the schemas)
from eaglet.config.schema import EagletConfig
from eaglet.run_dir import RunDir
from eaglet.train.report import print_summary
from eaglet.train.run import run_training


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
@user_errors
def main(cfg: EagletConfig) -> float | None:
    if cfg.sweep.enabled:  # a sweep trial: never raises (it checks the config itself), returns the objective
        from eaglet.sweeps.trial import run_trial

        return run_trial(cfg, Path(HydraConfig.get().runtime.output_dir))
    started_in = RunDir(Path(HydraConfig.get().runtime.output_dir))
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
