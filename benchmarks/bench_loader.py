"""The training data path alone: tokens/s the ShardDataModule's train loader delivers from shards on local disk.

    python benchmarks/bench_loader.py                                   # Kimi-K2.5 shapes, several loader settings
    python benchmarks/bench_loader.py --loaders threads=0,threads=2,workers=4 --docs 48 --train-tps 38289

Shards of random bf16 features at a target's shapes (bench_train.py SHAPES, three aux layers) are written by
the real writer to --dir (default: TMPDIR), read once so that they sit in the page cache, then read back by the
train loader, as training reads them (check_finite on, pinned batches on a CUDA machine), for each setting:
`threads=N` builds batches on N background threads of this process (`threads=0`: in the loop itself),
`workers=N` in N DataLoader worker processes. A row gives tokens/s and GB/s of features in the first epoch
(after --warmup batches: start-up; every sequence checked for inf and NaN, every page mapped for the first
time), tokens/s in the later epochs (no check: a sequence is checked once per process), and the first
epoch's ratio to --train-tps (the rate training consumes, from bench_gpu_side_by_side.py) when given. The
table is appended to experiments/BENCHMARKS.md.

On a CUDA machine batches are pinned by torch's caching host allocator, which hands a freed batch's block to
a later batch: its pages are never faulted in again. Without CUDA every batch is fresh memory, and faulting
in its pages costs about as much as filling them. --recycle emulates the CUDA case on a CPU-only machine: the
rows `(recycled)` reuse a few buffers round robin (safe here only: this loop drops each batch at once).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import SHAPES  # noqa: E402

from eaglet.shards import (  # noqa: E402
    MANIFEST_VERSION,
    Manifest,
    SequenceFeatures,
    count_tokens,
    save_token_counts,
    write_manifest,
    write_shard,
)
from eaglet.train import packing  # noqa: E402
from eaglet.train.datamodule import ShardDataModule  # noqa: E402

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
GIB = 2**30


def write_feature_shards(
    directory: Path, shape: tuple, docs: int, doc_tokens: int, device: torch.device
) -> int:
    """`docs` documents of `doc_tokens` tokens (random bf16 features, 30-50% prompt), 8 per shard; returns tokens."""
    hidden, *_, vocab = shape
    gen = torch.Generator(device=device).manual_seed(2)
    n, infos, ids_all, masks_all, seqs = doc_tokens, [], [], [], []
    for i in range(docs):
        ids = torch.randint(0, vocab, (n,), generator=gen, device=device).cpu()
        mask = torch.arange(n) >= int((0.3 + 0.2 * (i % 5) / 4) * n)
        aux = torch.randn(n, 3, hidden, generator=gen, device=device, dtype=torch.bfloat16).cpu()
        last = torch.randn(n, hidden, generator=gen, device=device, dtype=torch.bfloat16).cpu()
        seqs.append(SequenceFeatures(i, ids, mask, aux, last))
        ids_all.append(ids)
        masks_all.append(mask)
        if len(seqs) == 8 or i == docs - 1:
            infos.append(write_shard(directory, len(infos), seqs, torch.bfloat16))
            seqs = []
    save_token_counts(directory, count_tokens(torch.cat(ids_all), torch.cat(masks_all), vocab))
    manifest = Manifest(
        version=MANIFEST_VERSION, status="complete", target={"name": "synthetic"}, aux_layer_ids=[2, 3, 4],
        last_layer_id=5, last_hidden_pre_norm=True, hidden_size=hidden, vocab_size=vocab, dtype="bfloat16",
        inputs_fingerprint="synthetic", shards=infos, token_counts_file="token_counts.safetensors",
    )  # fmt: skip
    write_manifest(directory, manifest)
    return docs * n


def warm_page_cache(directory: Path) -> float:
    """Read every file of `directory` once; returns GiB read."""
    size = 0
    for path in sorted(directory.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(1 << 24):
                size += len(chunk)
    return size / GIB


def parse_loader(setting: str) -> tuple[int, int]:
    """'threads=N' or 'workers=N' -> (num_workers, loader_threads)."""
    kind, _, count = setting.partition("=")
    if kind not in ("threads", "workers") or not count.isdigit():
        raise ValueError(f"loader setting {setting!r} is not threads=N or workers=N")
    return (int(count), 0) if kind == "workers" else (0, int(count))


def data_module(directory: Path, setting: str, batch_tokens: int) -> ShardDataModule:
    """The train-side data module as training builds it (check_finite on), for one loader setting."""
    workers, threads = parse_loader(setting)
    kwargs = {"num_workers": workers, "check_finite": True}
    if "loader_threads" in inspect.signature(ShardDataModule).parameters:
        kwargs["loader_threads"] = threads
    elif threads:  # a version of eaglet from before the threaded loader: worker processes only
        raise ValueError(f"{setting}: this version of ShardDataModule has no loader_threads")
    dm = ShardDataModule(directory, tokens_per_batch=batch_tokens, val_fraction=0.0, seed=0, **kwargs)
    dm.setup()
    return dm


def loader_rate(
    directory: Path, setting: str, batch_tokens: int, epochs: int = 2, warmup: int = 4
) -> tuple[float, float]:
    """Tokens/s the train loader delivers in its first epoch, after `warmup` batches (start-up: threads or
    workers, the first pinned blocks), and in the later ones (nan with one epoch): the first epoch checks every
    sequence for inf and NaN, later ones do not."""
    dm = data_module(directory, setting, batch_tokens)
    loader = dm.train_dataloader()  # one loader for all epochs, as Lightning keeps it
    spans = []  # (tokens, seconds) per epoch
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(min(warmup, len(loader) - 1) if epoch == 0 else 0):
            next(batches)
        tokens, start = 0, time.perf_counter()
        for batch in batches:
            tokens += batch["input_ids"].numel()
        spans.append((tokens, time.perf_counter() - start))
    later = spans[1:]
    later_tps = sum(t for t, _ in later) / sum(s for _, s in later) if later else float("nan")
    return spans[0][0] / spans[0][1], later_tps


@contextlib.contextmanager
def recycled_buffers(buffers: int) -> Iterator[None]:
    """Inside: packed rows reuse `buffers` buffers per size, round robin (see --recycle)."""
    fresh = packing._allocate
    pools: dict[int, list[torch.Tensor]] = {}
    turn = itertools.count()

    def allocate(nbytes: int, *, pin_memory: bool, shared: bool) -> torch.Tensor:
        if shared:  # rows of worker processes: not emulated
            return fresh(nbytes, pin_memory=pin_memory, shared=shared)
        pool = pools.setdefault(nbytes, [])
        if len(pool) < buffers:
            pool.append(fresh(nbytes, pin_memory=pin_memory, shared=shared))
            return pool[-1]
        return pool[next(turn) % buffers]

    packing._allocate = allocate
    try:
        yield
    finally:
        packing._allocate = fresh


def bytes_per_token(shape: tuple) -> int:
    """Feature bytes per token: three aux layers and the last hidden state in bf16."""
    return 4 * shape[0] * 2


def machine() -> str:
    cores = len(os.sched_getaffinity(0))
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} host, {cores} cores, torch {torch.__version__}"
    return f"{platform.machine()} CPU, {cores} cores, torch {torch.__version__}"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="kimi_k2_5", choices=list(SHAPES))
    p.add_argument("--docs", type=int, default=40)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--loaders", default="threads=0,threads=1,threads=2,threads=4,workers=2,workers=4")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--warmup", type=int, default=4, help="batches of the first epoch not timed")
    p.add_argument(
        "--recycle", action="store_true", help="also measure each threads=N setting with reused buffers"
    )
    p.add_argument("--train-tps", type=float, default=float("nan"), help="training tokens/s, for the ratio")
    p.add_argument("--label", default="this tree", help="names the code measured, in the table")
    p.add_argument("--dir", default=None, help="where shards are written (local disk); default: TMPDIR")
    p.add_argument("--bench-file", default=str(BENCH_FILE))
    p.add_argument("--no-append", action="store_true")
    opts = p.parse_args(argv)
    settings = opts.loaders.split(",")
    for setting in settings:
        parse_loader(setting)  # a typo fails before the shards are written

    shape = SHAPES[opts.shape]
    command = "python benchmarks/bench_loader.py " + " ".join(argv)
    print(f"{machine()}\n{command.strip()}\n", flush=True)
    directory = Path(tempfile.mkdtemp(prefix="bench-loader-", dir=opts.dir))
    header = (
        "| shape | code | loader | tokens/s, epoch 1 | GB/s, epoch 1 | tokens/s, epochs 2+ | epoch 1 vs training "
        "rate |\n|---|---|---|---|---|---|---|"
    )
    lines = []
    try:
        start = time.perf_counter()
        tokens = write_feature_shards(directory, shape, opts.docs, opts.doc_tokens, torch.device("cpu"))
        size = warm_page_cache(directory)
        print(f"wrote and read {tokens:,} tokens ({size:.1f} GiB) in {time.perf_counter() - start:.0f} s\n")
        print(header, flush=True)
        runs = [(setting, False) for setting in settings]
        if opts.recycle:
            runs += [(setting, True) for setting in settings if parse_loader(setting)[0] == 0]
        for setting, recycle in runs:
            # Enough buffers for every batch in flight: threads + 1 queued, one handed out, one spare.
            with recycled_buffers(parse_loader(setting)[1] + 3) if recycle else contextlib.nullcontext():
                tps, later = loader_rate(directory, setting, opts.batch_tokens, opts.epochs, opts.warmup)
            ratio = f"{tps / opts.train_tps:.2f}x" if opts.train_tps == opts.train_tps else "n/a"
            gbs = tps * bytes_per_token(shape) / 1e9
            name = f"{setting} (recycled)" if recycle else setting
            lines.append(
                f"| {opts.shape} | {opts.label} | {name} | {tps:,.0f} | {gbs:.2f} | {later:,.0f} | {ratio} |"
            )
            print(lines[-1], flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if not opts.no_append:
        with open(opts.bench_file, "a") as fh:
            fh.write(f"\n### Data path alone — `{command.strip()}`\n\n")
            fh.write(
                f"{date.today()}, {machine()}. {tokens:,} tokens in {opts.doc_tokens:,}-token documents, "
                f"{opts.batch_tokens:,}-token micro-batches, read from the page cache, check_finite on.\n\n"
            )
            fh.write(header + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
