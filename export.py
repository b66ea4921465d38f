"""Export a trained head for serving, checked against the format's tensor-name contract.

python export.py                                           # the newest run, EAGLE format (vLLM, SGLang)
python export.py export.run=outputs/train/<time> export.format=speculators export.out_dir=/models/draft

The same command is installed as `eaglet-export` (eaglet.cli.export).
"""

from eaglet.cli.export import main

if __name__ == "__main__":
    main()
