"""Extract the target's hidden states into memory-mapped shards.

eaglet-extract                                      # embedded default: SmolLM2-135M-Instruct on CPU
eaglet-extract model=llama3_1_8b model.path=/models/Llama-3.1-8B-Instruct dataset=sharegpt hardware=h200_x1
eaglet-extract extract.features=tokens              # token streams and counts only, for trainer.features=online
eaglet-extract extract.max_disk_gb=200              # the folder never above 200 GB: eaglet-train trainer.features=window
                                                    # beside it deletes the shards it is done with
"""

import hydra

from eaglet.cli import user_errors
from eaglet.config import CONF_DIR, check_config  # (importing eaglet.config registers the schemas)
from eaglet.config.schema import EagletConfig


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@user_errors
def main(cfg: EagletConfig) -> None:
    check_config(cfg)
    from eaglet.extract.report import print_summary
    from eaglet.extract.stage import run_extraction

    print_summary(run_extraction(cfg))


if __name__ == "__main__":
    main()
