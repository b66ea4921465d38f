"""benchmarks/bench_sampling.py: the rejection rule its kernel follows, checked on the CPU against the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_sampling import rejection_picks  # noqa: E402

from eaglet.generation.sampling import pick_next  # noqa: E402


@pytest.mark.parametrize("top_p", [0.95, 0.8, 0.3])
@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
def test_rejection_picks_what_the_sorted_nucleus_picks(top_p: float, scale: float) -> None:
    torch.manual_seed(int(scale * 10))
    logits = torch.randn(64, 500) * scale
    seeds, steps = torch.randint(0, 2**31, (64,)), torch.randint(0, 600, (64,))
    picks, tried = rejection_picks(logits, 0.7, top_p, seeds, steps)
    assert torch.equal(picks, pick_next(logits, temperature=0.7, top_p=top_p, seeds=seeds, steps=steps))
    assert tried >= 1.0


def test_a_flat_row_takes_more_candidates_than_a_peaked_one() -> None:
    seeds, steps = torch.arange(32), torch.zeros(32, dtype=torch.long)
    _, flat = rejection_picks(torch.randn(32, 400) * 0.1, 1.0, 0.5, seeds, steps)
    _, peaked = rejection_picks(torch.randn(32, 400) * 20.0, 1.0, 0.5, seeds, steps)
    assert flat > peaked >= 1.0
