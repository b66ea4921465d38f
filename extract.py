"""Extract the target's hidden states into memory-mapped shards.

python extract.py                                   # embedded default: SmolLM2-135M-Instruct on CPU
python extract.py model=llama3_1_8b model.path=/models/Llama-3.1-8B-Instruct dataset=sharegpt hardware=h200_x1
python extract.py extract.features=tokens           # token streams and counts only, for trainer.features=online
python extract.py extract.max_disk_gb=200           # the folder never above 200 GB: train.py trainer.features=window
                                                    # beside it deletes the shards it is done with
"""

import hydra

from eaglet.cli import user_errors
from eaglet.config import check_config  # (importing eaglet.config registers the schemas)
from eaglet.config.schema import EagletConfig
from eaglet.extract.report import print_summary
from eaglet.extract.stage import run_extraction


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
@user_errors
def main(cfg: EagletConfig) -> None:
    check_config(cfg)
    print_summary(run_extraction(cfg))


if __name__ == "__main__":
    main()
