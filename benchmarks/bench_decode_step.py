"""The generation engine's decode step alone, at full occupancy: what the GPU allows before any scheduling.

    python benchmarks/bench_decode_step.py                              # SmolLM2 shape, random bf16 weights
    python benchmarks/bench_decode_step.py bench.rows=1024,2048 bench.sampling=greedy,0.7/0.95,0.7/1.0

Every row of the engine decodes (eaglet.generation.engine), its cache filled with random keys and values and
each row's context drawn uniformly from [bench.min_context, bench.max_context): one CUDA graph replay is one
step of every row. The step's time over many replays gives the rate, new tokens per second, that regeneration
could reach if no row ever waited; benchmarks/bench_regenerate.py measures what the whole loop reaches. The
attention kernel's bandwidth (the keys and values read per second) is printed beside it. Needs a CUDA GPU;
the rows are appended to experiments/BENCHMARKS.md.
"""

from __future__ import annotations

import sys
import time
from datetime import date
from pathlib import Path

import torch
from bench_common import cuda_milliseconds  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM

from eaglet.generation.decode_attention import decode_attention
from eaglet.generation.engine import _Engine
from eaglet.generation.work import DecodeSettings

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS = {"rows": "1024", "sampling": "greedy,0.7/0.95,0.7/1.0", "compile": "1", "min_context": "100",
            "max_context": "1300", "replays": "30", "record": "1"}  # fmt: skip
# SmolLM2-135M-Instruct's shape (conf/model/smollm2_135m.yaml).
SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "max_position_embeddings": 8192}  # fmt: skip


@torch.inference_mode()
def measure(model, rows: int, temperature: float, top_p: float, opts: dict) -> tuple[float, float, float]:
    """(step ms, engine set-up s, attention GB/s) for one setting."""
    settings = DecodeSettings(
        max_new_tokens=640, stop_ids=frozenset({SMOLLM2["vocab_size"] - 1}), pad_id=0, max_rows=rows,
        refill_every=16, engine="engine", max_context=2048, temperature=temperature, top_p=top_p,
        compile=opts["compile"] == "1",
    )  # fmt: skip
    start = time.perf_counter()
    engine = _Engine(model, settings)
    torch.cuda.synchronize()
    setup = time.perf_counter() - start
    for cache in (*engine.decoder.keys, *engine.decoder.values):
        cache.normal_()
    low, high = int(opts["min_context"]), int(opts["max_context"])
    contexts = torch.randint(low, high, (rows,), device="cuda")
    engine.positions.copy_(contexts)  # inactive rows: every step reads the same contexts
    step = cuda_milliseconds(engine.graph.replay, int(opts["replays"]))
    query = torch.randn(rows, SMOLLM2["num_attention_heads"], SMOLLM2["head_dim"], device="cuda")
    query = query.to(torch.bfloat16)
    keys, values = engine.decoder.keys[0], engine.decoder.values[0]
    layer = cuda_milliseconds(lambda: decode_attention(query, keys, values, contexts, 0.125), 50)
    kv_bytes = contexts.sum().item() * SMOLLM2["num_key_value_heads"] * SMOLLM2["head_dim"] * 2 * 2
    return step, setup, kv_bytes / (layer * 1e-3) / 1e9


def main(argv: list[str]) -> None:
    opts = dict(DEFAULTS)
    for arg in argv:
        key, _, value = arg.partition("=")
        name = key.removeprefix("bench.")
        if not key.startswith("bench.") or name not in DEFAULTS:
            sys.exit(f"unknown option {key}; the options are {', '.join('bench.' + k for k in DEFAULTS)}")
        opts[name] = value
    if not torch.cuda.is_available():
        sys.exit("bench_decode_step.py needs a CUDA GPU (the engine's step is a CUDA graph)")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to("cuda", torch.bfloat16).eval()
    header = (
        "| date | machine | shape | rows | context | sampling | compiled | set-up s | ms/step | new tokens/s "
        "| attention GB/s |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = []
    for rows in (int(r) for r in opts["rows"].split(",")):
        for sampling in opts["sampling"].split(","):
            temperature, top_p = (0.0, 1.0) if sampling == "greedy" else map(float, sampling.split("/"))
            step, setup, bandwidth = measure(model, rows, temperature, top_p, opts)
            torch.cuda.empty_cache()  # the engine's cache is gone with measure's frame
            lines.append(
                f"| {date.today()} | {torch.cuda.get_device_name()} (torch {torch.__version__}) | SmolLM2-135M "
                f"(random, bf16) | {rows} | {opts['min_context']}-{opts['max_context']} | {sampling} "
                f"| {opts['compile'] == '1'} | {setup:.1f} | {step:.2f} | {rows / step * 1e3:,.0f} | {bandwidth:,.0f} |"
            )
            print(lines[-1], flush=True)
    print(header + "\n" + "\n".join(lines))
    if opts["record"] == "1":
        command = "python benchmarks/bench_decode_step.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(f"\n### Decode step of the generation engine — `{command.strip()}`\n\n{header}\n")
            fh.write("\n".join(lines) + "\n")
        print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
