"""Plan a run before paying for it: disk, regeneration, extraction, training time and serving speedup.

eaglet-plan model=kimi_k2_5 dataset=sharegpt plan.conversations=600000 hardware=rtx_pro6000_x8
eaglet-plan model=kimi_k2_5 dataset=sharegpt plan.conversations=600000 \
    plan.compare=[rtx_pro6000_x8,b200_nvl8,b300_nvl8]
eaglet-plan model=llama3_1_8b plan.tokens=2000000000 plan.serving.acceptance_from=outputs/train/<time>/eval.json
"""

import hydra
from omegaconf import OmegaConf

from eaglet.cli import user_errors
from eaglet.config import CONF_DIR, check_config  # (importing eaglet.config registers the schemas)
from eaglet.config.schema import EagletConfig


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@user_errors
def main(cfg: EagletConfig) -> None:
    check_config(cfg)
    from eaglet.plan.stage import run_plan

    if OmegaConf.is_missing(cfg.dataset, "paths"):  # dataset=jsonl without files: sized from plan.* alone
        cfg.dataset.paths = []

    run_plan(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
