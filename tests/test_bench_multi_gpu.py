"""benchmarks/bench_multi_gpu.py on CPU: one process and DDP over gloo, same losses, rows for every run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eaglet.config import REPO_ROOT


@pytest.mark.e2e
def test_one_device_and_ddp_rows_with_equal_losses() -> None:
    cmd = [
        sys.executable, str(REPO_ROOT / "benchmarks" / "bench_multi_gpu.py"), "model=tiny_llama", "hardware=cpu",
        "devices=2", "strategies=ddp,fsdp", "steps=4", "warmup=1", "docs=20", "doc_tokens=256", "draft_vocab=64",
        "append=0", "run_timeout=300",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "docs=20 -> 32" in out  # rounded to whole micro-batches on every device
    rows = {line.split("|")[5].strip(): line for line in out.splitlines() if line.startswith("| 20")}
    assert set(rows) == {"1 device", "ddp x2", "fsdp x2"}
    assert rows["ddp x2"].rstrip().endswith("| 0.0e+00 (4) |")  # the same global loss at every step
    assert "failed: error: hardware.strategy=fsdp needs GPUs" in rows["fsdp x2"]  # a failed run is a row
