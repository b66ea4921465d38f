"""recipes/scale_report.py: ratios and differences with their intervals over prompts, and what the verdicts say."""

from __future__ import annotations

import importlib
import sys

import pytest

from eaglet.config import REPO_ROOT
from eaglet.evaluate.intervals import tau_intervals


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(REPO_ROOT / "recipes"))
    try:
        yield importlib.import_module("scale_report")
    finally:
        sys.path.remove(str(REPO_ROOT / "recipes"))


def _results(per_proposer: dict[str, tuple[list[int], list[int]]], keep_counts: bool = True) -> dict:
    """An eval.json set's results as `summarize` writes them (the figures the report reads)."""
    counts = {name: {"accepted": a, "steps": s} for name, (a, s) in per_proposer.items()}
    intervals = tau_intervals(counts) if keep_counts else {}
    results = {}
    for name, c in counts.items():
        r = {"tau": 1 + sum(c["accepted"]) / sum(c["steps"]), "acceptance_rates": [0.5, 0.3], "near_ties": 0}
        if keep_counts:
            r |= {**intervals[name], "per_prompt": c}
        results[name] = r
    return results


NGRAM = ([2, 3, 2, 4, 3, 2, 3, 2], [4] * 8)
CLEARLY_TWICE = ([12, 13, 12, 13, 12, 12, 13, 12], [4] * 8)  # τ 4.09 against n-gram's 1.66: 2.47×
NEAR_GOAL = ([2, 12, 3, 14, 1, 11, 2, 13], [4] * 8)  # 2.81 against 1.66: 1.70× on these prompts, spread wide


def _row(sets: dict, against: str | None = None, **extra) -> dict:
    return {"question": "q", "store": "main", "overrides": [], "against": against, "steps": 10,
            "tokens_seen": 100, "train_s": 5.0, "tau_sim": 2.0, "sets": sets, **extra}  # fmt: skip


def _set(results: dict) -> dict:
    return {"prompts": 8, "results": results}


def test_the_goal_says_whether_the_interval_clears_it(report) -> None:
    main = _row({
        "code": _set(_results({"eaglet": CLEARLY_TWICE, "ngram": NGRAM})),
        "math": _set(_results({"eaglet": NEAR_GOAL, "ngram": NGRAM})),
    })  # fmt: skip
    text = report.format_report({"stores": {}, "rows": {"main": main}}, {"main": "done"})
    code = next(line for line in text.splitlines() if "main vs n-gram lookup, code" in line)
    maths = next(line for line in text.splitlines() if "main vs n-gram lookup, maths" in line)
    assert "95% CI" in code and code.endswith("goal ≥ 1.5×: met")
    assert "95% CI" in maths and "met on these prompts, but the interval spans the goal" in maths


@pytest.mark.parametrize(
    ("ratio", "bounds", "verdict"),
    [
        (1.6, [1.52, 1.7], "met"),
        (1.6, [1.3, 1.9], "met on these prompts, but the interval spans the goal (more prompts would tell)"),
        (
            1.4,
            [1.2, 1.6],
            "not met on these prompts, but the interval spans the goal (more prompts would tell)",
        ),
        (1.4, [1.3, 1.45], "not met"),
        (1.6, None, "met"),
        (1.4, None, "not met"),
    ],
)
def test_verdicts(report, ratio: float, bounds, verdict: str) -> None:
    assert report.verdict_against(ratio, bounds, 1.5) == verdict


def test_ablations_and_the_speculators_column_carry_intervals(report) -> None:
    small_results = _results({"eaglet": NEAR_GOAL, "ngram": NGRAM, "baseline": NGRAM})
    small = _row({"code": _set(small_results)})
    ablation = _row(
        {"code": _set(_results({"eaglet": CLEARLY_TWICE, "ngram": NGRAM}))}, against="scale_small"
    )
    spec = _row(
        {
            "code": {
                **small["sets"]["code"],
                "results": {"eaglet": small_results["baseline"], "ngram": small_results["ngram"]},
            }
        },
        against="scale_small",
    )
    rows = {"main": small, "scale_small": small, "shared_only": ablation, "speculators": spec}
    text = report.format_report({"stores": {}, "rows": rows}, {})
    delta = next(line for line in text.splitlines() if line.startswith("- shared_only"))
    assert "Δτ code +1.28 (+" in delta and " to +" in delta  # 4.09 - 2.81, the interval above zero
    paired = small["sets"]["code"]["results"]["eaglet"]["ratio_ci95"]["baseline"]
    beside = next(line for line in text.splitlines() if "scale_small vs the speculators head" in line)
    assert f"code 1.70× ({paired[0]:.2f}-{paired[1]:.2f})" in beside  # 2.81 / 1.66


def test_a_row_from_an_earlier_run_is_named_with_its_file(report) -> None:
    mid = _row(
        {"code": _set(_results({"eaglet": NEAR_GOAL, "ngram": NGRAM}))},
        earlier="smollm2_scale.2026-12-07.json",
    )
    ttt7 = _row({"code": _set(_results({"eaglet": CLEARLY_TWICE, "ngram": NGRAM}))}, against="scale_mid")
    text = report.format_report({"stores": {}, "rows": {"ttt7": ttt7, "scale_mid": mid}}, {})
    assert "| scale_mid (from smollm2_scale.2026-12-07.json) | q |" in text
    assert (
        "| scale_mid (from smollm2_scale.2026-12-07.json) | code | 0.50 |" in text
    )  # acceptance per position
    delta = next(line for line in text.splitlines() if line.startswith("- ttt7"))
    assert "against scale_mid (from smollm2_scale.2026-12-07.json), equal tokens: Δτ code +1.28 (+" in delta


def test_results_without_per_prompt_counts_still_report(report) -> None:
    """eval.json written before the intervals: the figures, without intervals."""
    main = _row({"code": _set(_results({"eaglet": CLEARLY_TWICE, "ngram": NGRAM}, keep_counts=False))})
    text = report.format_report({"stores": {}, "rows": {"main": main}}, {"main": "done"})
    line = next(line for line in text.splitlines() if "main vs n-gram lookup, code" in line)
    assert line == "- main vs n-gram lookup, code: 2.47×; goal ≥ 1.5×: met"


def test_data_scaling_fits_the_rows_at_the_experiments_own_settings(report) -> None:
    small = _row({"code": _set(_results({"eaglet": NEAR_GOAL, "ngram": NGRAM}))}, tokens_seen=1_000_000)
    mid = _row({"code": _set(_results({"eaglet": CLEARLY_TWICE, "ngram": NGRAM}))}, tokens_seen=4_000_000)
    continued = _row(small["sets"], tokens_seen=9_000_000, overrides=["trainer.init_from=/heads/earlier"])
    ttt7 = _row(small["sets"], against="scale_mid", tokens_seen=2_000_000, overrides=["trainer.ttt_steps=7"])
    rows = {"main": continued, "scale_small": small, "scale_mid": mid, "ttt7": ttt7}
    text = report.format_report({"stores": {}, "rows": rows}, {})
    assert "## Data scaling: τ against log2 of tokens seen (scale_small, scale_mid)" in text
    line = next(line for line in text.splitlines() if line.startswith("| code | +"))
    assert line.startswith("| code | +0.64 |")  # (4.09 - 2.81) over two doublings
    # 1.5 × n-gram's 1.66 = 2.48 lies below the smaller head's 2.81: reached before 1M tokens
    assert line.endswith("K (1.5×) |") and float(line.split("|")[3].split("K")[0]) < 1000
    # A row taken from an earlier run (`earlier=`) is a point of this report's curve.
    copied = {**rows, "scale_mid": {**mid, "earlier": "smollm2_scale.2026-12-07.json"}}
    assert "| code | +0.64 |" in report.format_report({"stores": {}, "rows": copied}, {})
    only_one = report.format_report({"stores": {}, "rows": {"scale_small": small}}, {})
    assert "Data scaling" not in only_one  # one token count: no line


def test_ablations_are_read_against_the_training_seed_spread(report) -> None:
    def row(code: tuple, math: tuple, against: str | None = None) -> dict:
        sets = {
            "code": _set(_results({"eaglet": code, "ngram": NGRAM})),
            "math": _set(_results({"eaglet": math, "ngram": NGRAM})),
        }
        return _row(sets, against=against)

    base = ([6] * 8, [4] * 8)  # τ 2.50
    one_more, one_less = ([7] + [6] * 7, [4] * 8), ([6] * 7 + [5], [4] * 8)  # τ 2.53, 2.47
    mid = row(base, base)
    seed = row(one_more, one_less, against="scale_mid")  # ±0.03
    ttt7 = row(CLEARLY_TWICE, one_more, against="scale_mid")  # code +1.59, maths +0.03
    rows = {"scale_mid": mid, "seed_mid": seed, "ttt7": ttt7}
    text = report.format_report({"stores": {}, "rows": rows}, {})
    line = next(line for line in text.splitlines() if line.startswith("- ttt7"))
    assert line.endswith("; within seed_mid's: maths")
    assert "within" not in next(line for line in text.splitlines() if line.startswith("- seed_mid"))
    assert "seed_mid differs from scale_mid only by the training seed" in text
    alone = report.format_report({"stores": {}, "rows": {"scale_mid": mid, "ttt7": ttt7}}, {})
    assert "within seed_mid" not in alone and "training seed" not in alone
