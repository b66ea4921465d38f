"""Window training (trainer.features=window) against training from shards, on the same data, through the real
entry points: tokens/s and the most disk the shard folder took.

    python benchmarks/bench_window.py                                   # tiny random target on this CPU
    python benchmarks/bench_window.py model=smollm2_135m bench.bound_shards=8 dataset.max_records_per_file=200

Shards: `python extract.py`, then `python train.py`, one after the other. Window: `python train.py
trainer.features=window` and `python extract.py extract.max_disk_gb=...` started together, the bound being the
shard folder's fixed part (target head, token counts, manifests) plus bench.bound_shards of its largest shards
(as the shards run measured them). A thread reads the folder's bytes (temporaries included) every few ms. Training
tokens/s is the tokens trained (each training token max_epochs times) over train.py's own wall time (report.json);
window training's includes its waits for extraction, and its row also gives the side-by-side run's wall time
against extract + train one after the other.

Options: bench.bound_shards, bench.record (0: print the row only). Other arguments are Hydra overrides for both
commands (model=..., dataset=..., extract.*, trainer.*, hardware.*).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH_FILE = ROOT / "experiments" / "BENCHMARKS.md"
DEFAULTS = {"bound_shards": 5, "record": 1}
# The data and run of the CPU smoke: 30 conversations of a tiny random Llama, 15 shards of 512 tokens.
BASE = [
    "model=tiny_llama",
    "model.dtype=bfloat16",
    "dataset=oasst_en100",
    "dataset.max_records_per_file=30",
    "extract.regenerate.enabled=false",
    "extract.max_length=256",
    "extract.shard_tokens=512",
    "draft.vocab_size=256",
    "hardware.tokens_per_device=512",
    "trainer.global_batch_tokens=512",
    "trainer.max_epochs=2",
    "trainer.val_fraction=0.1",
    "trainer.val_every_n_steps=50",
    "trainer.checkpoint_every_n_steps=50",
]
from bench_common import parse_bench_options  # noqa: E402


def parse(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    return parse_bench_options(argv, DEFAULTS)


def machine() -> str:
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"


class Peak:
    """The most bytes a folder holds, read every few ms on a thread."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.most = folder, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            total = 0
            for root, _, names in os.walk(self.folder):
                for name in names:
                    try:
                        total += os.stat(os.path.join(root, name)).st_size
                    except FileNotFoundError:
                        pass
            self.most = max(self.most, total)
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


def start(script: str, overrides: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, str(ROOT / script), *overrides], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def finish(proc: subprocess.Popen, log: Path) -> None:
    if proc.wait() != 0:
        raise SystemExit(f"{proc.args[1]} failed:\n{log.read_text()[-3000:]}")


def main(argv: list[str]) -> None:
    opts, user = parse(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-window-"))
    try:
        common = [*BASE, *user, f"paths.data_dir={root / 'data'}", f"paths.output_dir={root / 'outputs'}"]
        if not any(o.startswith("paths.cache_dir=") for o in user):
            common.append(f"paths.cache_dir={ROOT / '.cache'}")
        whole, bounded = root / "whole", root / "bounded"

        peak = Peak(whole)
        began = time.perf_counter()
        finish(start("extract.py", [*common, f"extract.output_dir={whole}", f"hydra.run.dir={root / 'e1'}"],
                     root / "e1.log"), root / "e1.log")  # fmt: skip
        extract_s = time.perf_counter() - began
        finish(start("train.py", [*common, f"extract.output_dir={whole}", f"hydra.run.dir={root / 't1'}"],
                     root / "t1.log"), root / "t1.log")  # fmt: skip
        offline_wall = time.perf_counter() - began
        offline_peak = peak.stop()
        offline = json.loads((root / "t1" / "report.json").read_text())

        shard_files = sorted(whole.glob("shard-*"))
        fixed = sum(p.stat().st_size for p in whole.iterdir() if p.is_file() and p not in shard_files)
        largest = max(p.stat().st_size for p in shard_files)
        # The writer counts each shard at an upper bound of its file (header room): leave it that.
        bound_gb = (fixed + opts["bound_shards"] * (largest + 2048) + 8192) / 1e9

        window_args = [*common, f"extract.output_dir={bounded}", f"extract.max_disk_gb={bound_gb:.9f}"]
        peak = Peak(bounded)
        began = time.perf_counter()
        train = start("train.py", [*window_args, "trainer.features=window", f"hydra.run.dir={root / 't2'}"],
                      root / "t2.log")  # fmt: skip
        extract = start("extract.py", [*window_args, f"hydra.run.dir={root / 'e2'}"], root / "e2.log")
        finish(extract, root / "e2.log")
        finish(train, root / "t2.log")
        window_wall = time.perf_counter() - began
        window_peak = peak.stop()
        window = json.loads((root / "t2" / "report.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def rate(report: dict) -> float:
        return report["train_tokens_per_epoch"] * report["epochs"] / report["seconds"]

    model = next((o.split("=", 1)[1] for o in reversed([*BASE, *user]) if o.startswith("model=")), "?")
    epochs = window["epochs"]
    header = (
        "| date | machine | target | trained tokens (shards / window) | epochs | shards: extract + train s | shards: train tok/s "
        "| shards: peak disk | window: side-by-side s | window: train tok/s | window / shards | window: peak disk "
        "| extract.max_disk_gb |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    row = (
        f"| {date.today()} | {machine()} | {model} "
        f"| {offline['train_tokens_per_epoch'] * epochs:,} / {window['train_tokens_per_epoch'] * epochs:,} | {epochs} "
        f"| {extract_s:,.1f} + {offline_wall - extract_s:,.1f} "
        f"| {rate(offline):,.0f} | {offline_peak / 1e6:,.1f} MB | {window_wall:,.1f} | {rate(window):,.0f} "
        f"| {rate(window) / rate(offline):.2f}x | {window_peak / 1e6:,.1f} MB | {bound_gb:.4g} |"
    )
    print(header)
    print(row)
    if opts["record"]:
        command = "python benchmarks/bench_window.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(f"\n### Window training against shards — `{command.strip()}`\n\n{header}\n{row}\n")
        print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
