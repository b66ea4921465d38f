"""Extract the target's hidden states into memory-mapped shards.

python extract.py                                   # embedded default: SmolLM2-135M-Instruct on CPU
python extract.py model=llama3_1_8b model.path=/models/Llama-3.1-8B-Instruct dataset=sharegpt hardware=h200_x1
python extract.py extract.features=tokens           # token streams and counts only, for trainer.features=online
python extract.py extract.max_disk_gb=200           # the folder never above 200 GB: train.py trainer.features=window
                                                    # beside it deletes the shards it is done with

The same command is installed as `eaglet-extract` (eaglet.cli.extract).
"""

from eaglet.cli.extract import main

if __name__ == "__main__":
    main()
