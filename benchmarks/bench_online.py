"""Online training (trainer.features=online) against training from shards, on the same micro-batches.

    python benchmarks/bench_online.py model=tiny_llama                  # tiny random target on this CPU (smoke)
    python benchmarks/bench_online.py model=smollm2_135m hardware=h200_x1 bench.batch_tokens=16384 \
        bench.steps=40 trainer.ttt_steps=5 draft.vocab_size=8192           # one GPU: the issue's SmolLM2 goal

Random documents (bench.min_len..bench.max_len tokens, the first bench.prompt_percent % of each a prompt with
loss mask 0) are written twice by the real writers: hidden-state shards through extraction's own shard loop
(`transformers_backend.write_shards`) and a token store (`write_token_shard`). Both are read back through the
training data path (ShardDataModule / TokenDataModule: memory maps, packing into bench.batch_tokens-token
micro-batches, bench.loader_threads loader threads, side-stream copies to the GPU), in the same order, and
trained for bench.warmup + bench.steps micro-batches each with the real module (forward, backward, AdamW;
bf16 autocast on GPUs), from the same initial head. Online, the module runs the frozen target on every
micro-batch inside the step, then again with the loader running it on its copy stream, one micro-batch
ahead (trainer.online_overlap). The row gives tokens/s of each (wall clock over the measured steps), their
ratio, the target's packed forward alone on the same micro-batches, and the disk each needed per token.
With bench.repeats=N the three runs take turns N times and each rate is the median of its N; with
trainer.compile=true an untimed offline run first compiles every graph and shape the timed runs meet. With
trainer.online_compile=true the target's forward is timed eager first, then with its layers compiled, and both
online runs train with the compiled target.

Options: bench.batch_tokens, bench.steps, bench.warmup, bench.min_len, bench.max_len, bench.prompt_percent,
bench.loader_threads, bench.seed, bench.repeats, bench.record (0: print the row only). Other arguments are
Hydra overrides (model=..., trainer.ttt_steps=..., trainer.compile=true, draft.vocab_size=...).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
from bench_common import machine, parse_bench_options  # noqa: E402
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

import eaglet.config
from eaglet.config import check_config
from eaglet.data.templating import TokenizedConversation
from eaglet.extract.plan import plan_shards
from eaglet.extract.transformers_backend import write_shards
from eaglet.shards import (
    MANIFEST_VERSION,
    STORED_DTYPES,
    TARGET_HEAD_FILE,
    Manifest,
    build_vocab_mapping,
    count_tokens,
    save_token_counts,
    write_manifest,
)
from eaglet.shards.tokens import TOKEN_FEATURES, write_token_shard
from eaglet.target_model import head_weights, load_target, resolve_aux_layer_ids
from eaglet.train.datamodule import ShardDataModule
from eaglet.train.online import OnlineTarget, TokenDataModule
from eaglet.train.run import build_module

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS: dict[str, int] = {
    "batch_tokens": 1024,
    "steps": 4,
    "warmup": 1,
    "min_len": 64,
    "max_len": 512,
    "prompt_percent": 25,
    "loader_threads": 2,
    "seed": 0,
    "repeats": 1,
    "record": 1,
}


def parse(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    """bench.* options (integers) and the Hydra overrides."""
    return parse_bench_options(argv, DEFAULTS)


def make_samples(vocab: int, tokens: int, opts: dict[str, int]) -> list[TokenizedConversation]:
    """Random documents until `tokens` tokens, each a prompt (loss mask 0) then an answer (loss mask 1)."""
    gen = torch.Generator().manual_seed(opts["seed"])
    samples: list[TokenizedConversation] = []
    while sum(s.num_tokens for s in samples) < tokens:
        n = int(torch.randint(opts["min_len"], opts["max_len"] + 1, (1,), generator=gen))
        ids = torch.randint(0, vocab, (n,), generator=gen).numpy().astype(np.int32)
        mask = (np.arange(n) >= n * opts["prompt_percent"] // 100).astype(np.uint8)
        samples.append(TokenizedConversation(str(len(samples)), ids, mask, truncated=False))
    return samples


def write_folders(cfg, target, samples: list[TokenizedConversation], root: Path) -> dict[str, Path]:
    """The same samples as hidden-state shards (extraction's loop) and as a token store."""
    aux_ids = resolve_aux_layer_ids(cfg.model)
    lengths = [s.num_tokens for s in samples]
    shard_tokens = cfg.extract.shard_tokens
    counts = count_tokens(
        np.concatenate([s.input_ids for s in samples]), np.concatenate([s.loss_mask for s in samples]),
        cfg.model.vocab_size,
    )  # fmt: skip
    folders = {"shards": root / "shards", "tokens": root / "tokens"}
    for name, folder in folders.items():
        folder.mkdir(parents=True)
        manifest = Manifest(
            version=MANIFEST_VERSION, status="in_progress", target={"name": cfg.model.name},
            aux_layer_ids=aux_ids, last_layer_id=cfg.model.num_layers, last_hidden_pre_norm=True,
            hidden_size=cfg.model.hidden_size, vocab_size=cfg.model.vocab_size, dtype=cfg.extract.dtype,
            inputs_fingerprint="bench", settings={"features": TOKEN_FEATURES} if name == "tokens" else {},
        )  # fmt: skip
        if name == "shards":
            write_shards(
                target, samples, aux_ids, manifest, folder, shard_tokens=shard_tokens,
                batch_tokens=cfg.extract.batch_tokens, dtype=STORED_DTYPES[cfg.extract.dtype],
            )  # fmt: skip
            save_file(head_weights(target.parts), folder / TARGET_HEAD_FILE)
        else:
            for index, members in enumerate(plan_shards(lengths, shard_tokens)):
                manifest.shards.append(
                    write_token_shard(
                        folder,
                        index,
                        list(members),
                        [samples[i].input_ids for i in members],
                        [samples[i].loss_mask for i in members],
                    )  # fmt: skip
                )
        save_token_counts(folder, counts + 1)  # every id counted: any draft vocab size is valid
        manifest.status = "complete"
        write_manifest(folder, manifest)
    return folders


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    cfg,
    folder: Path,
    online: OnlineTarget | None,
    device: torch.device,
    opts: dict[str, int],
    overlap: bool = False,
) -> float:
    """Tokens per second of bench.steps training micro-batches after bench.warmup, read from `folder`; with
    `overlap`, the loader runs the target on its copy stream (trainer.online_overlap)."""
    kind = TokenDataModule if online is not None else ShardDataModule
    datamodule = kind(
        folder, tokens_per_batch=opts["batch_tokens"], val_fraction=0.0, seed=opts["seed"], num_workers=0,
        loader_threads=opts["loader_threads"],
    )  # fmt: skip
    datamodule.batch_device = device
    if overlap:
        datamodule.batch_transform = online.features
    datamodule.setup()
    torch.manual_seed(opts["seed"])
    module = build_module(
        cfg.draft, cfg.trainer, datamodule.manifest, target_norm_eps=cfg.model.rms_norm_eps, total_steps=1000
    )
    d2t, t2d = build_vocab_mapping(torch.ones(cfg.model.vocab_size, dtype=torch.int64), cfg.draft.vocab_size)
    weights = online.head_weights() if online is not None else load_file(folder / TARGET_HEAD_FILE)
    module.init_from_target(weights, d2t, t2d)
    module.to(device)
    if online is not None:
        module.attach_target(online)
    optimizer = module.configure_optimizers()["optimizer"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    total = opts["warmup"] + opts["steps"]
    loader = iter(datamodule.train_dataloader())
    tokens, start = 0, 0.0
    for step in range(total):
        if step == opts["warmup"]:
            sync(device)
            start = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}
        with autocast:
            out = module._run(batch, noise=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch["input_ids"].numel() if step >= opts["warmup"] else 0
    sync(device)
    return tokens / (time.perf_counter() - start)


def forward_rate(folder: Path, online: OnlineTarget, device: torch.device, opts: dict[str, int]) -> float:
    """Tokens per second of the target's packed forward (features only) over the same micro-batches."""
    datamodule = TokenDataModule(
        folder, tokens_per_batch=opts["batch_tokens"], val_fraction=0.0, seed=opts["seed"], num_workers=0,
        loader_threads=0,
    )  # fmt: skip
    datamodule.setup()
    batches = [
        {k: v.to(device) for k, v in batch.items()}
        for _, batch in zip(
            range(opts["warmup"] + opts["steps"]), datamodule.train_dataloader(), strict=False
        )
    ]
    for batch in batches[: opts["warmup"]]:
        online.features(batch)
    sync(device)
    start = time.perf_counter()
    for batch in batches[opts["warmup"] :]:
        online.features(batch)
    sync(device)
    return sum(b["input_ids"].numel() for b in batches[opts["warmup"] :]) / (time.perf_counter() - start)


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def main(argv: list[str]) -> None:
    opts, overrides = parse(argv)
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        # Online: the trainer options of online training apply (trainer.online_compile); it times shards too.
        cfg = compose("config", overrides=["trainer.features=online", *overrides])
    check_config(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(cfg.model, device=str(device), cache_dir=Path(cfg.paths.cache_dir))
    # Enough documents for every measured micro-batch of one epoch (packing leaves some room in each).
    samples = make_samples(
        min(cfg.model.vocab_size, len(target.tokenizer)),
        (opts["warmup"] + opts["steps"] + 2) * opts["batch_tokens"],
        opts,
    )
    root = Path(tempfile.mkdtemp(prefix="bench-online-"))
    try:
        folders = write_folders(cfg, target, samples, root)  # before the target switches to packed attention
        online = OnlineTarget(
            target, resolve_aux_layer_ids(cfg.model), cfg.model.head_dim, STORED_DTYPES[cfg.extract.dtype]
        )
        forward_tps = {"eager": forward_rate(folders["tokens"], online, device, opts)}
        if cfg.trainer.online_compile:  # its warm-up compiles the target's layers before the runs below
            online.compile_layers()
            forward_tps["compiled"] = forward_rate(folders["tokens"], online, device, opts)
        if cfg.trainer.compile:  # untimed: compiles every graph (and shape) the timed passes meet
            train(cfg, folders["shards"], None, device, opts)
        rates: dict[str, list[float]] = {"offline": [], "online": [], "overlap": []}
        for _ in range(opts["repeats"]):  # interleaved, so that a drift of the clock touches all three alike
            rates["offline"].append(train(cfg, folders["shards"], None, device, opts))
            rates["online"].append(train(cfg, folders["tokens"], online, device, opts))
            rates["overlap"].append(train(cfg, folders["tokens"], online, device, opts, overlap=True))
        offline_tps, online_tps, overlap_tps = (
            statistics.median(rates[k]) for k in ("offline", "online", "overlap")
        )
        per_token = {
            name: sum(p.stat().st_size for p in folder.glob("shard-*")) / sum(s.num_tokens for s in samples)
            for name, folder in folders.items()
        }
    finally:
        shutil.rmtree(root)
    tr = cfg.trainer
    header = (
        "| date | machine | target | K | draft vocab | compiled: head, target | micro-batch tokens | steps "
        "| offline tok/s | online tok/s | online / offline | online, overlapped tok/s | overlapped / offline "
        "| target forward tok/s: eager, compiled | disk B/token: shards, tokens |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    steps = f"{opts['steps']} x {opts['repeats']}" if opts["repeats"] > 1 else str(opts["steps"])
    row = (
        f"| {date.today()} | {machine()} | {cfg.model.name} ({cfg.model.source}, {target.dtype}) | {tr.ttt_steps} "
        f"| {cfg.draft.vocab_size:,} | {yes(tr.compile)}, {yes(tr.online_compile)} | {opts['batch_tokens']:,} "
        f"| {steps} | {offline_tps:,.0f} | {online_tps:,.0f} | {online_tps / offline_tps:.2f}x "
        f"| {overlap_tps:,.0f} | {overlap_tps / offline_tps:.2f}x "
        f"| {', '.join(f'{forward_tps[k]:,.0f}' if k in forward_tps else '—' for k in ('eager', 'compiled'))} "
        f"| {per_token['shards']:,.0f}, {per_token['tokens']:,.1f} |"
    )
    print(header)
    print(row)
    if opts["record"]:
        command = "python benchmarks/bench_online.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(f"\n### Online training against shards — `{command.strip()}`\n\n{header}\n{row}\n")
        print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
