"""Bootstrap intervals of τ over prompts: against a plain loop over the same draws, and what they must show."""

from __future__ import annotations

import numpy as np
import pytest

from eaglet.evaluate.intervals import difference_interval, ratio_interval, same_prompts, tau_intervals


def _loop_reference(per_proposer: dict, samples: int, seed: int) -> dict:
    """The same resamples, one at a time: τ = 1 + Σ accepted / Σ steps over the prompts drawn."""
    names = list(per_proposer)
    prompts = len(per_proposer[names[0]]["accepted"])
    picks = np.random.default_rng(seed).integers(0, prompts, size=(samples, prompts))
    taus = {name: [] for name in names}
    for draw in picks:
        for name in names:
            accepted = sum(per_proposer[name]["accepted"][i] for i in draw)
            steps = sum(per_proposer[name]["steps"][i] for i in draw)
            taus[name].append(1.0 + accepted / steps if steps else 1.0)
    quantiles = {name: np.quantile(np.array(t), [0.025, 0.975]) for name, t in taus.items()}
    ratios = {
        (a, b): np.quantile(np.array(taus[a]) / np.array(taus[b]), [0.025, 0.975])
        for a in names
        for b in names
        if a != b
    }
    return {"tau": quantiles, "ratio": ratios}


def _counts(seed: int, prompts: int) -> dict:
    rng = np.random.default_rng(seed)
    steps = rng.integers(5, 40, size=prompts)
    difficulty = rng.uniform(0.1, 0.9, size=prompts)  # what makes a prompt easy for both proposers
    head = np.minimum(steps * 4, np.round(steps * 4 * difficulty * rng.uniform(0.8, 1.0, size=prompts)))
    ngram = np.round(head * rng.uniform(0.3, 0.6, size=prompts))
    return {
        "eaglet": {"accepted": head.astype(int).tolist(), "steps": steps.tolist()},
        "ngram": {"accepted": ngram.astype(int).tolist(), "steps": (steps + 3).tolist()},
    }


def test_intervals_equal_a_plain_loop_over_the_same_draws() -> None:
    counts = _counts(0, prompts=12)
    found = tau_intervals(counts, samples=300, seed=7)
    reference = _loop_reference(counts, samples=300, seed=7)
    for name in counts:
        np.testing.assert_allclose(found[name]["tau_ci95"], reference["tau"][name], rtol=1e-12)
    np.testing.assert_allclose(
        found["eaglet"]["ratio_ci95"]["ngram"], reference["ratio"][("eaglet", "ngram")]
    )
    np.testing.assert_allclose(
        found["ngram"]["ratio_ci95"]["eaglet"], reference["ratio"][("ngram", "eaglet")]
    )


def test_the_interval_holds_the_sets_tau_and_narrows_with_more_prompts() -> None:
    few = _counts(1, prompts=10)
    tau = 1 + sum(few["eaglet"]["accepted"]) / sum(few["eaglet"]["steps"])
    low, high = tau_intervals(few)["eaglet"]["tau_ci95"]
    assert low < tau < high
    # The same ten prompts, each ten times: the same τ, a tighter interval (about 1/sqrt(10) of the width).
    many = {name: {k: v * 10 for k, v in c.items()} for name, c in few.items()}
    low_many, high_many = tau_intervals(many)["eaglet"]["tau_ci95"]
    assert low < low_many < tau < high_many < high
    assert (high_many - low_many) < 0.5 * (high - low)


def test_prompts_alike_give_a_point() -> None:
    same = {
        "eaglet": {"accepted": [6] * 8, "steps": [4] * 8},
        "ngram": {"accepted": [2] * 8, "steps": [4] * 8},
    }
    found = tau_intervals(same)
    assert found["eaglet"]["tau_ci95"] == pytest.approx([2.5, 2.5])
    assert found["eaglet"]["ratio_ci95"]["ngram"] == pytest.approx([2.5 / 1.5, 2.5 / 1.5])


def test_resampling_in_pairs_is_tighter_than_apart_when_prompts_differ_in_difficulty() -> None:
    """Both proposers find the same prompts easy: drawn together, the ratio moves less than either τ."""
    counts = _counts(2, prompts=20)
    paired = tau_intervals(counts)["eaglet"]["ratio_ci95"]["ngram"]
    apart = ratio_interval(counts["eaglet"], counts["ngram"])
    assert paired[1] - paired[0] < 0.8 * (apart[1] - apart[0])


def test_the_difference_of_two_runs_centres_on_the_difference_of_their_taus() -> None:
    a, b = _counts(3, prompts=15)["eaglet"], _counts(4, prompts=15)["eaglet"]
    delta = (sum(a["accepted"]) / sum(a["steps"])) - (sum(b["accepted"]) / sum(b["steps"]))
    low, high = difference_interval(a, b)
    assert low < delta < high
    low_self, high_self = difference_interval(a, a)  # independent draws: not a point even against itself
    assert low_self < 0 < high_self


def test_counts_of_other_lengths_are_refused_and_empty_sets_give_nothing() -> None:
    with pytest.raises(ValueError, match="ngram: 2 accepted and 2 step counts for 3 prompts"):
        tau_intervals(
            {
                "eaglet": {"accepted": [1, 2, 3], "steps": [1, 1, 1]},
                "ngram": {"accepted": [1, 2], "steps": [1, 1]},
            }
        )
    assert tau_intervals({"eaglet": {"accepted": [], "steps": []}}) == {}
    assert difference_interval({"accepted": [], "steps": []}, {"accepted": [1], "steps": [1]}) is None


def test_two_runs_on_the_same_prompts_are_drawn_in_pairs_whatever_their_order() -> None:
    """Another run's evaluation of the same prompts (keys equal, order shuffled): its difference from this one is
    drawn prompt by prompt, so a run against itself differs by exactly 0, and a head better on every prompt is
    told apart where independent draws could not."""
    counts = _counts(5, prompts=12)["eaglet"]
    keyed = {**counts, "prompts": [f"p{i}" for i in range(12)]}
    order = np.random.default_rng(0).permutation(12)
    shuffled = {k: [v[i] for i in order] for k, v in keyed.items()}
    assert same_prompts(keyed, shuffled) and not same_prompts(keyed, counts)
    assert difference_interval(keyed, shuffled) == pytest.approx([0.0, 0.0])
    better = {
        **keyed,
        "accepted": [a + max(1, s // 10) for a, s in zip(keyed["accepted"], keyed["steps"], strict=True)],
    }
    low, high = difference_interval(better, keyed)
    apart_low, apart_high = difference_interval({**better, "prompts": None}, counts)
    assert 0 < low < high and apart_low < 0 < apart_high  # paired: clearly better; apart: cannot tell
    assert ratio_interval(keyed, shuffled) == pytest.approx([1.0, 1.0])
