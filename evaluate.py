"""Evaluate a trained head by speculative decoding against the real target (in this process, or through vLLM or
SGLang servers), beside n-gram lookup.

python evaluate.py                                         # the newest run, embedded default
python evaluate.py eval.run=outputs/train/<time> eval.sets=[mt_bench_like,code,math] eval.num_spec_tokens=5
python evaluate.py +eval.set_defs.mine.path=/data/prompts.jsonl +eval.set_defs.mine.count=50 eval.sets=[mine]
python evaluate.py eval.backend=vllm_server model=kimi_k2_5 model.path=/models/Kimi-K2.5 hardware=b200_nvl8
python evaluate.py eval.backend=sglang_server eval.server.url=http://host:30000   # a server you started

The same command is installed as `eaglet-evaluate` (eaglet.cli.evaluate).
"""

from eaglet.cli.evaluate import main

if __name__ == "__main__":
    main()
