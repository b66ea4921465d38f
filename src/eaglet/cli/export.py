"""Export a trained head for serving, checked against the format's tensor-name contract.

eaglet-export                                              # the newest run, EAGLE format (vLLM, SGLang)
eaglet-export export.run=outputs/train/<time> export.format=speculators export.out_dir=/models/draft
"""

import hydra

from eaglet.cli import user_errors
from eaglet.config import CONF_DIR, check_config  # (importing eaglet.config registers the schemas)
from eaglet.config.schema import EagletConfig


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@user_errors
def main(cfg: EagletConfig) -> None:
    check_config(cfg)
    from eaglet.export.stage import run_export

    out = run_export(cfg)
    print(f"exported ({cfg.export.format} format, names and shapes checked): {out}")


if __name__ == "__main__":
    main()
