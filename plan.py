"""Plan a run before paying for it: disk, regeneration, extraction, training time and serving speedup.

python plan.py model=kimi_k2_5 dataset=sharegpt plan.conversations=600000 hardware=rtx_pro6000_x8
python plan.py model=kimi_k2_5 dataset=sharegpt plan.conversations=600000 \
    plan.compare=[rtx_pro6000_x8,b200_nvl8,b300_nvl8]
python plan.py model=llama3_1_8b plan.tokens=2000000000 plan.serving.acceptance_from=outputs/train/<time>/eval.json

The same command is installed as `eaglet-plan` (eaglet.cli.plan).
"""

from eaglet.cli.plan import main

if __name__ == "__main__":
    main()
