"""Multi-device training: throughput per device, scaling efficiency, peak memory and loss curves, 1 device vs
DDP vs FSDP, each run being `python train.py` itself on synthetic shards at a target's true shapes.

    python benchmarks/bench_multi_gpu.py model=llama3_1_8b hardware=h200_x2 steps=30     # on 2 GPUs
    python benchmarks/bench_multi_gpu.py model=tiny_llama hardware=cpu devices=2 strategies=ddp   # CPU smoke

Every run has the same global batch (hardware.tokens_per_device x devices tokens): the one-device run
accumulates gradients over as many micro-batches as the others have devices, so with the rank-aware sampler
all runs take the same optimizer steps on the same tokens, and their per-step global loss
(train/loss_global) must agree. Scaling efficiency = tokens/s per device with N devices / tokens/s on one.
Rows are appended to experiments/BENCHMARKS.md.
"""

from __future__ import annotations

import csv
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from eaglet.config import CONF_DIR  # noqa: E402  (importing it registers the schemas)
from eaglet.shards.synthetic import write_synthetic_shards  # noqa: E402

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
OPTS = {"model": "llama3_1_8b", "hardware": "h200_x2", "devices": "", "strategies": "ddp,fsdp", "steps": "30",
        "warmup": "5", "docs": "96", "doc_tokens": "2048", "ttt": "3", "draft_vocab": "32000", "workers": "0",
        "threads": "2", "append": "1", "run_timeout": "0"}  # fmt: skip
# append=0: print the table without appending it to BENCHMARKS.md.
# workers/threads: the loader (worker processes, or threads of the training process: the default).
# run_timeout: seconds one training run may take (0: no limit); a run past it becomes a "failed" row.
# NVLink multicast stays off on shared hosts.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def composed(model: str, hardware: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[f"model={model}", f"hardware={hardware}"])


def train(run_dir: Path, shards: Path, opts: dict, devices: int, strategy: str, global_tokens: int) -> Path:
    cmd = [
        sys.executable, str(ROOT / "train.py"), f"model={opts['model']}", f"hardware={opts['hardware']}",
        f"extract.output_dir={shards}", f"hardware.devices={devices}", f"hardware.strategy={strategy}",
        f"trainer.max_steps={opts['steps']}", f"trainer.global_batch_tokens={global_tokens}",
        f"trainer.ttt_steps={opts['ttt']}", f"draft.vocab_size={opts['draft_vocab']}",
        "trainer.val_fraction=0", f"trainer.checkpoint_every_n_steps={10**6}", "trainer.lr=1e-4",
        "trainer.warmup_ratio=0", f"trainer.num_workers={opts['workers']}", f"trainer.loader_threads={opts['threads']}",
        # Each step's rate: tokens of one micro-batch over the time since the one before.
        "callbacks.throughput.window_size=2", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, **SAFE_ENV, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    limit = float(opts["run_timeout"]) or None
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{strategy} x{devices} failed:\nran past run_timeout={limit:.0f} s") from err
    print(
        f"{strategy} x{devices}: exit {proc.returncode} after {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} x{devices} failed:\n{proc.stderr[-4000:]}")
    return run_dir / "metrics.csv"


def read_metrics(path: Path, warmup: int, devices: int) -> dict:
    rows = list(csv.DictReader(open(path)))

    def series(key: str) -> dict[int, float]:
        return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}

    # ThroughputMonitor's tokens per second of one device, times the devices.
    tps = [v * devices for step, v in series("train/device/items_per_sec").items() if step >= warmup]
    peak = series("train/peak_mem_gib")
    return {
        "tps": statistics.median(tps),
        "peak_gib": max(peak.values()) if peak else float("nan"),
        "loss": series("train/loss_global"),
    }


def main(argv: list[str]) -> None:
    opts = dict(OPTS)
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in opts:
            raise SystemExit(f"unknown option {key!r}; options: {', '.join(opts)}")
        opts[key] = value
    cfg = composed(opts["model"], opts["hardware"])
    devices = int(opts["devices"] or cfg.hardware.devices)
    global_tokens = cfg.hardware.tokens_per_device * devices
    # Whole rounds of bins on every rank: otherwise the last bins are split to balance the ranks, the runs see
    # different micro-batches and their losses differ for that reason alone.
    per_round = max(1, cfg.hardware.tokens_per_device // int(opts["doc_tokens"])) * devices
    docs = -(-int(opts["docs"]) // per_round) * per_round
    if docs != int(opts["docs"]):
        print(f"docs={opts['docs']} -> {docs}: whole micro-batches on every device", flush=True)
        opts["docs"] = str(docs)
    work = Path(tempfile.mkdtemp(prefix="bench-multi-"))
    shards = work / "shards"
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    write_synthetic_shards(
        shards, cfg.model, docs=int(opts["docs"]), doc_tokens=int(opts["doc_tokens"]), device=gen_device
    )
    warmup = int(opts["warmup"])
    runs, failed = {}, {}
    for name, strategy, world in [("1 device", "auto", 1)] + [
        (f"{strategy} x{devices}", strategy, devices) for strategy in opts["strategies"].split(",")
    ]:
        try:
            runs[name] = read_metrics(
                train(work / strategy, shards, opts, world, strategy, global_tokens), warmup, world
            )
            print(
                f"{name}: {runs[name]['tps']:,.0f} tokens/s, peak {runs[name]['peak_gib']:.1f} GiB",
                flush=True,
            )
        except RuntimeError as err:  # the other runs still make their rows
            print(err, file=sys.stderr, flush=True)
            failed[name] = str(err).strip().splitlines()[-1][:120]
    if "1 device" not in runs:
        raise SystemExit(f"the one-device run failed ({failed['1 device']}): no baseline to compare with")

    if torch.cuda.is_available():
        where = f"{devices}x {torch.cuda.get_device_name()}, torch {torch.__version__}"
    else:
        where = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}"
    header = (
        "| date | machine | model shapes | K | run | global batch tokens | tokens/s | tokens/s per device "
        "| scaling efficiency | peak GiB per device | max rel. loss diff vs 1 device (steps) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    base = runs["1 device"]
    rows = []
    for name, r in runs.items():
        world = 1 if name == "1 device" else devices
        per_device = r["tps"] / world
        steps = sorted(set(r["loss"]) & set(base["loss"]))
        diff = max(abs(r["loss"][s] - base["loss"][s]) / abs(base["loss"][s]) for s in steps)
        rows.append(
            f"| {date.today()} | {where} | {opts['model']} | {opts['ttt']} | {name} | {global_tokens:,} "
            f"| {r['tps']:,.0f} | {per_device:,.0f} | {per_device / base['tps']:.0%} | {r['peak_gib']:.1f} "
            f"| {diff:.1e} ({len(steps)}) |"
        )
    for name, reason in failed.items():
        rows.append(f"| {date.today()} | {where} | {opts['model']} | {opts['ttt']} | {name} | {global_tokens:,} "
                    f"| failed: {reason.replace('|', '/')} | | | | |")  # fmt: skip
    print(header)
    print("\n".join(rows))
    for name, r in runs.items():
        print(name, "loss_global:", " ".join(f"{r['loss'][s]:.4f}" for s in sorted(r["loss"])[:12]))
    if opts["append"] == "0":
        return
    command = "python benchmarks/bench_multi_gpu.py " + " ".join(argv)
    with open(BENCH_FILE, "a") as fh:
        fh.write(f"\n### Multi-device training — `{command.strip()}`\n\n{header}\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
