"""The planner's three ways to train (shards, online, window): disk and time of each against hand-computed values,
the one it says to use, and plan.py's table."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.config.schema import TrainerConfig
from eaglet.plan.acceptance import AcceptanceCurve
from eaglet.plan.configs import default_plan, load_draft, load_hardware, load_model
from eaglet.plan.data_size import DataSize
from eaglet.plan.disk import shard_bytes_per_token, target_head_bytes
from eaglet.plan.extraction import prefill_seconds_per_token
from eaglet.plan.modes import choose_mode, estimate_modes
from eaglet.plan.planner import PlannedRun, plan_hardware

ROOT = Path(__file__).resolve().parents[1]
CURVE = AcceptanceCurve([0.7], "assumed")


def planned(model: str, hardware: str, tokens: float, **trainer) -> tuple:
    """plan_hardware for `tokens` tokens of 1,000-token conversations, half in the loss."""
    data = DataSize(conversations=int(tokens // 1000), tokens=tokens, loss_fraction=0.5, mean_context=500.0,
                    generated_tokens=0.0, prefill_tokens=0.0, source="test")  # fmt: skip
    run = PlannedRun(
        model=load_model(model),
        draft=load_draft(model),
        trainer=dataclasses.replace(TrainerConfig(max_epochs=2, val_fraction=0.05), **trainer),
        plan=default_plan(),
        shard_dtype="bfloat16",
        regenerate=False,
        shard_tokens=65536,
    )
    hw = load_hardware(hardware)
    return plan_hardware(run, hw, data, CURVE), run, hw, data


def by_mode(p) -> dict:
    return {m.mode: m for m in p.modes}


def test_shards_when_the_folder_fits_the_disk() -> None:
    # 1M tokens of Llama-3.1-8B: 32.8 GB of shards on the H200 box's 64 GB disk.
    p, run, hw, data = planned("llama3_1_8b", "h200_x1", 1e6)
    modes = by_mode(p)
    per_token = shard_bytes_per_token(run.model, "bfloat16")
    counts = 8 * run.model.vocab_size
    assert modes["shards"].disk_bytes == pytest.approx(
        per_token * 1e6 + 16 * 1000 + target_head_bytes(run.model) + counts
    )
    assert modes["shards"].seconds == pytest.approx(p.extraction_seconds + p.training.seconds)
    assert p.choice.mode == "shards" and p.seconds == modes["shards"].seconds
    assert all(m.feasible for m in p.modes)


def test_online_when_the_shards_do_not_fit_and_the_target_fits_one_device() -> None:
    # 100M tokens: 3.3 TB of shards against 64 GB; 16 GB of bf16 weights within 60% of 141 GB.
    p, run, hw, data = planned("llama3_1_8b", "h200_x1", 1e8)
    modes = by_mode(p)
    assert not modes["shards"].feasible and "the disk holds 64.00 GB" in modes["shards"].problem
    online = modes["online"]
    forward, _ = prefill_seconds_per_token(run.model, hw, 1, data.mean_context, run.plan)
    # Every epoch runs the target over the trained tokens, beside the head's training.
    assert online.seconds == pytest.approx(p.training.seconds + 2 * 0.95 * 1e8 * forward)
    assert online.disk_bytes == pytest.approx(5 * 1e8 + 8 * run.model.vocab_size)
    assert p.choice.mode == "online" and p.seconds == online.seconds and p.feasible
    # The training rate of each way: online, a token costs the head's step and the target's forward
    assert online.train_tokens_per_second == pytest.approx(1 / (1 / p.training.tokens_per_second + forward))
    assert modes["shards"].train_tokens_per_second == modes["window"].train_tokens_per_second
    assert modes["shards"].train_tokens_per_second == p.training.tokens_per_second


def test_window_when_neither_fits_with_the_bound_to_pass() -> None:
    # Kimi-K2.5 on 8 PCIe GPUs: 28.7 TB of shards on a 15 TB disk, and 2 TB of bf16 weights on no one GPU.
    p, run, hw, data = planned("kimi_k2_5", "rtx_pro6000_x8", 5e8)
    modes = by_mode(p)
    assert not modes["shards"].feasible and not modes["online"].feasible
    assert "does not fit beside the head on one RTX PRO 6000" in modes["online"].problem
    window = modes["window"]
    assert window.feasible and p.choice.mode == "window"
    assert window.max_disk_gb == pytest.approx(0.9 * 15e3)  # most of the disk: more overlap, never all of it
    assert window.seconds == pytest.approx(modes["shards"].seconds)
    assert "extract.max_disk_gb=13500" in p.choice.reason and "trainer.features=window" in p.choice.reason


def test_the_least_bound_is_the_window_the_validation_shard_and_one_more() -> None:
    p, run, hw, data = planned("llama3_1_8b", "h200_x1", 1e8, window_shards=3)
    assert by_mode(p)["window"].max_disk_gb == pytest.approx(0.9 * 64)  # the disk allows more than the least
    # On a 10 GB disk, Llama shards of 65,536 tokens (2.1 GB each) leave no room for a window of three.
    small = dataclasses.replace(hw, disk_tb=0.01)
    modes = estimate_modes(
        run.model, small, run.trainer, run.plan, data, placement=p.placement,
        stored=p.disk[0], shard_tokens=65536, regeneration_seconds=0.0,
        extraction_seconds=p.extraction_seconds, training=p.training,
    )  # fmt: skip
    shard = 65536 * shard_bytes_per_token(run.model, "bfloat16")
    least = target_head_bytes(run.model) + 8 * run.model.vocab_size + (3 + 1 + 1) * shard
    tight = {m.mode: m for m in modes}["window"]
    assert not tight.feasible and f"need {least / 1e9:,.2f} GB" in tight.problem
    assert "the head and 5 shards of 65,536 tokens" in tight.problem
    assert choose_mode(modes).mode == "online"  # the 8B target still fits one device


def test_plan_py_prints_the_ways_to_train_and_the_one_to_use(tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled", "COLUMNS": "240"}
    command = [
        sys.executable, str(ROOT / "plan.py"), "model=kimi_k2_5", "dataset=sharegpt", "plan.conversations=600000",
        "plan.compare=[rtx_pro6000_x8,b200_nvl8]", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    for text in ("ways to train", "shards (extract, then train)", "online (the target in each step)",
                 "window (extract.max_disk_gb, side by side)", "use"):  # fmt: skip
        assert text in out, text
    assert "trainer.features=window" in out and "shards: the shards fit the disk" in out
    verdict = proc.stdout.strip().splitlines()[-1]
    assert "trainer.features=" in verdict


def test_the_quality_table_times_the_goal_the_way_the_run_trains() -> None:
    from eaglet.plan.quality import MeasuredHead, QualityFit, fit_sets
    from eaglet.plan.report import _hours, quality_table

    p, run, hw, data = planned("llama3_1_8b", "h200_x1", 1e8)
    # τ 1 at 1M tokens, 2 at 2M: the goal 1.5 × 2.0 = 3 lies at 4M tokens
    heads = [MeasuredHead("a", 1e6, {"s": 1.0}, {"s": 2.0}), MeasuredHead("b", 2e6, {"s": 2.0}, {"s": 2.0})]
    quality = QualityFit(heads, fit_sets(heads), [], 1.5, "ngram")
    small = dataclasses.replace(data, tokens=1e5)
    for features in ("shards", "online"):
        table = quality_table(quality, small, [p], features)
        assert table.columns[-1].header == f"time to the goal, h200_x1 ({features}, estimated)"
        assert table.columns[-1]._cells == [_hours(4e6 / by_mode(p)[features].train_tokens_per_second)]
    # online, each token also runs the target: a slower rate than from shards
    assert by_mode(p)["online"].train_tokens_per_second < 0.9 * by_mode(p)["shards"].train_tokens_per_second
