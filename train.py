"""Train an EAGLE-3 draft head on extracted shards (KD + training-time test).

python train.py                                     # embedded default on this CPU (run extract.py first)
python train.py hardware=b200_nvl8 model=kimi_k2_5 trainer.ttt_steps=7 draft.vocab_size=32000
python train.py ckpt_path=last                      # resume the newest run, in its own folder
python train.py trainer.features=online             # the target runs in each step (extract.features=tokens first)
python train.py trainer.features=window extract.max_disk_gb=200   # beside `python extract.py extract.max_disk_gb=200`
python train.py sweeps=draft_length_vocab           # a sweep (conf/sweeps/*.yaml); each trial returns its objective

The same command is installed as `eaglet-train` (eaglet.cli.train).
"""

from eaglet.cli.train import main

if __name__ == "__main__":
    main()
