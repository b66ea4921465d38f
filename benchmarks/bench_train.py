"""Draft-head training throughput, peak memory and model-FLOP utilisation on synthetic shards.

    python benchmarks/bench_train.py                              # tiny shapes on this CPU (smoke)
    python benchmarks/bench_train.py shapes=llama3_1_8b,kimi_k2_5 ttt=3,7   # on a GPU
    python benchmarks/bench_train.py shapes=kimi_k2_5 ttt=3 compile=1 embed_bf16=1   # compiled layer, bf16 embeddings

Shards are written by the real writer (documents of `doc_tokens` tokens, the first ~40% of each a prompt
with loss mask 0), read back through the real data module (memory maps, packing into `batch_tokens`-token
micro-batches), and trained with the real module: forward + backward + AdamW step, bf16 autocast on GPUs.
MFU divides model FLOPs (6 x params touched per token per step + attention) by the measured bf16 matmul rate.
"""

from __future__ import annotations

import platform
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglet.fsutil import atomic_output
from eaglet.shards import (
    MANIFEST_VERSION,
    Manifest,
    SequenceFeatures,
    build_vocab_mapping,
    count_tokens,
    load_token_counts,
    save_token_counts,
    write_manifest,
    write_shard,
)
from eaglet.train.datamodule import ShardDataModule
from eaglet.train.module import DraftHeadModule

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
# (hidden, heads, kv heads, head_dim, intermediate, vocab) of the draft heads shipped in conf/draft, with the
# target's vocab (conf/model).
SHAPES = {
    "tiny": (64, 4, 2, 16, 128, 4096),
    "smollm2_135m": (576, 9, 3, 64, 1536, 49152),
    "llama3_1_8b": (4096, 32, 8, 128, 14336, 128256),
    "kimi_k2_5": (7168, 64, 64, 128, 18432, 163840),
}
OPTS = {"shapes": "tiny", "ttt": "3", "draft_vocab": 32000, "batch_tokens": 8192, "doc_tokens": 2048, "docs": 16,
        "steps": 12, "warmup": 3, "lm_head_trainable": 0, "compile": 0, "embed_bf16": 0}  # fmt: skip


def write_synthetic_shards(directory: Path, shape: tuple, opts: dict, device: torch.device) -> None:
    hidden, *_, vocab = shape
    gen = torch.Generator().manual_seed(0)
    n, prompt = opts["doc_tokens"], int(0.4 * opts["doc_tokens"])
    seqs = []
    for i in range(opts["docs"]):
        ids = torch.randint(0, vocab, (n,), generator=gen)
        mask = torch.arange(n) >= prompt
        aux = torch.randn(n, 3, hidden, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        seqs.append(SequenceFeatures(i, ids, mask, aux, aux[:, 2].clone()))
    info = write_shard(directory, 0, seqs, torch.bfloat16)
    ids = torch.cat([s.input_ids for s in seqs])
    masks = torch.cat([s.loss_mask for s in seqs])
    save_token_counts(directory, count_tokens(ids, masks, vocab) + 1)  # every id seen: any draft vocab size
    scale = hidden**-0.5
    head = {
        "embed_tokens.weight": torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * scale).to(torch.bfloat16),
    }
    with atomic_output(directory / "target_head.safetensors") as tmp:
        save_file(head, tmp)
    manifest = Manifest(
        version=MANIFEST_VERSION, status="complete", target={"name": "synthetic"}, aux_layer_ids=[2, 3, 4],
        last_layer_id=5, last_hidden_pre_norm=True, hidden_size=hidden, vocab_size=vocab, dtype="bfloat16",
        inputs_fingerprint="synthetic", shards=[info], token_counts_file="token_counts.safetensors",
    )  # fmt: skip
    write_manifest(directory, manifest)


def model_flops_per_token(shape: tuple, draft_vocab: int, ttt: int, doc_tokens: int) -> float:
    hidden, heads, kv, hd, inter, _ = shape
    per_step = 2 * hidden * heads * hd + 2 * 2 * hidden * kv * hd + heads * hd * hidden + 3 * hidden * inter
    per_step += hidden * draft_vocab
    attention = 2 * 2 * heads * hd * (doc_tokens / 2)  # QK^T and PV over the mean causal context
    return 6 * 3 * hidden * hidden + ttt * (6 * per_step + 3 * attention)


def matmul_rate(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start)


def run_case(name: str, ttt: int, opts: dict, device: torch.device, work: Path) -> dict:
    shape = SHAPES[name]
    hidden, heads, kv, hd, inter, vocab = shape
    draft_vocab = min(opts["draft_vocab"], vocab)
    directory = work / name
    if not (directory / "manifest.json").exists():
        directory.mkdir(parents=True)
        write_synthetic_shards(directory, shape, opts, device)
    dm = ShardDataModule(
        directory, tokens_per_batch=opts["batch_tokens"], val_fraction=0.0, seed=0, num_workers=2
    )
    dm.setup()
    module = DraftHeadModule(
        draft={"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
               "intermediate_size": inter},
        target_hidden_size=hidden, vocab_size=vocab, draft_vocab_size=draft_vocab, num_aux=3, target_norm_eps=1e-5,
        ttt_steps=ttt, step_loss_decay=1.0, lr=1e-4, weight_decay=0.0, warmup_ratio=0.0, total_steps=100,
        lm_head_trainable=bool(opts["lm_head_trainable"]), mask_outside_draft_vocab=False, feature_noise_std=0.0,
        loss_chunk_tokens=2048, compile=bool(opts["compile"]),
        embed_dtype="bfloat16" if opts["embed_bf16"] else None,
    )  # fmt: skip
    d2t, t2d = build_vocab_mapping(load_token_counts(directory), draft_vocab)
    module.init_from_target(load_file(directory / "target_head.safetensors"), d2t, t2d)
    module.to(device)
    optimizer = module.configure_optimizers()["optimizer"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    loader = dm.train_dataloader()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, tokens = [], 0
    step = 0
    while step < opts["steps"]:
        for batch in loader:
            if step >= opts["steps"]:
                break
            batch = {
                k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
            }
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with autocast:
                out = module._run(batch, noise=False)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= opts["warmup"]:
                times.append(time.perf_counter() - start)
                tokens += batch["input_ids"].numel()
            step += 1
    tps = tokens / sum(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    flops = model_flops_per_token(shape, draft_vocab, ttt, opts["doc_tokens"])
    return {"shape": name, "ttt": ttt, "tps": tps, "peak_gib": peak, "tflops": tps * flops / 1e12}


def main(argv: list[str]) -> None:
    opts = dict(OPTS)
    for arg in argv:
        key, _, value = arg.partition("=")
        opts[key] = value if key in ("shapes", "ttt") else int(value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    ceiling = matmul_rate(device)
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 matmul {ceiling / 1e12:.0f} TFLOP/s"
    else:
        where = f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"
    header = (
        "| date | machine | shapes | K | lm_head | micro-batch tokens | tokens/s | peak GiB | model TFLOP/s | MFU |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    print(header)
    for name in opts["shapes"].split(","):
        for ttt in (int(k) for k in opts["ttt"].split(",")):
            r = run_case(name, ttt, opts, device, work)
            mfu = f"{r['tflops'] * 1e12 / ceiling:.0%}" if ceiling == ceiling else "n/a"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] == r["peak_gib"] else "n/a"
            head = "trainable" if opts["lm_head_trainable"] else "frozen"
            row = (
                f"| {date.today()} | {where} | {name} | {ttt} | {head} | {opts['batch_tokens']:,} | {r['tps']:,.0f} "
                f"| {peak} | {r['tflops']:.1f} | {mfu} |"
            )
            print(row, flush=True)
            rows.append(row)
    shutil.rmtree(work)
    command = "python benchmarks/bench_train.py " + " ".join(argv)
    with open(BENCH_FILE, "a") as fh:
        fh.write(f"\n### Training throughput — `{command.strip()}`\n\n{header}\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
