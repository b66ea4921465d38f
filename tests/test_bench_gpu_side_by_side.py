"""benchmarks/bench_gpu_side_by_side.py: its CPU smoke mode end to end, and a failing variant's row."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu_side_by_side as bench  # noqa: E402


@pytest.mark.e2e
def test_smoke_run_prints_and_records_every_table(tmp_path: Path) -> None:
    bench_file = tmp_path / "BENCH.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu_side_by_side.py"), "--smoke", "--check",
         "--bench-file", str(bench_file), "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for variant in ("speculators", "eaglet", "eaglet_trainable"):
        row = next(line for line in out.splitlines() if line.startswith(f"| tiny | 2 | {variant} |"))
        assert "error" not in row, row
    assert "| sdpa fp32 |" in out and "FAIL" not in out and "error:" not in out
    assert "| tiny | loader alone | threads=2 |" in out and "training fed by the loader" in out
    recorded = bench_file.read_text()
    assert "Side by side with speculators on one device" in recorded and "| tiny | 2 | eaglet |" in recorded
    assert not list(tmp_path.glob("bench-data-*"))  # the data-path shards are removed


def test_a_failing_variant_gives_an_error_row_and_frees_its_memory(monkeypatch) -> None:
    opts = bench.parse(["--smoke"])
    device = torch.device("cpu")
    shape = bench.SHAPES["tiny"]
    batches = bench.make_batches(shape, opts, device, seed=0)
    target = bench.make_target(shape, opts.draft_vocab, device)

    def broken(*args, **kwargs):
        raise RuntimeError("compilation failed\nwith a long trace | and a pipe")

    monkeypatch.setattr(bench, "build_eaglet", broken)
    row = bench.run_row("eaglet", "tiny", 2, batches, target, opts, device)
    assert row.error == "RuntimeError: compilation failed" and row.tps != row.tps  # nan
    ok = bench.run_row("speculators", "tiny", 2, batches, target, opts, device)
    assert not ok.error and ok.tps > 0


def test_batches_hold_documents_with_a_prompt_share_between_30_and_50_percent() -> None:
    opts = bench.parse(["--smoke"])
    batch = bench.make_batches(bench.SHAPES["tiny"], opts, torch.device("cpu"), seed=0)[0]
    docs = batch["document_ids"].unique_consecutive(return_counts=True)[1]
    assert docs.tolist() == [opts.doc_tokens] * (opts.batch_tokens // opts.doc_tokens)
    prompt = 1 - batch["loss_mask"].view(-1, opts.doc_tokens).float().mean(1)
    assert ((prompt >= 0.29) & (prompt <= 0.51)).all() and prompt.std() > 0
    assert torch.equal(batch["position_ids"].view(-1, opts.doc_tokens)[1], torch.arange(opts.doc_tokens))


def test_profile_lists_the_busiest_kernels_of_a_variant(capsys) -> None:
    opts = bench.parse(["--smoke", "--profile", "1", "--profile-rows", "3"])
    device = torch.device("cpu")
    shape = bench.SHAPES["tiny"]
    batches = bench.make_batches(shape, opts, device, seed=0)
    target = bench.make_target(shape, opts.draft_vocab, device)
    row = bench.run_row("speculators", "tiny", 2, batches, target, opts, device)
    assert not row.error
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("profile tiny K=2 speculators:"))
    listed = lines[start + 1 : start + 4]
    assert len(listed) == 3 and all(" ms " in line and "%" in line for line in listed)
