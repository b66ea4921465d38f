"""python -m eaglet.evaluate.compare: two evaluated runs side by side, drawn in pairs when they share their prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglet.evaluate.compare import compare, main


def _eval(tmp_path: Path, name: str, accepted: list[int], keys: list[str] | None, sets=("code",)) -> Path:
    """A run folder with an eval.json as `python evaluate.py` writes it (the figures compare reads)."""
    steps = [10] * len(accepted)
    per_prompt = {"accepted": accepted, "steps": steps, **({"prompts": keys} if keys is not None else {})}
    result = {"tau": 1 + sum(accepted) / sum(steps), "per_prompt": per_prompt}
    run = tmp_path / name
    run.mkdir()
    sets_json = {s: {"prompts": len(accepted), "results": {"eaglet": result, "ngram": result}} for s in sets}
    (run / "eval.json").write_text(json.dumps({"sets": sets_json}))
    return run


# Prompts that differ a lot (τ 1.2 to 4.5 on their own; 2.44 together).
EASY_AND_HARD = [2, 35, 5, 30, 12, 3, 25, 8, 18, 6]
KEYS = [f"k{i}" for i in range(10)]


def test_runs_on_the_same_prompts_are_told_apart_where_independent_draws_cannot(
    tmp_path: Path, capsys
) -> None:
    better = _eval(tmp_path, "better", [a + 1 for a in EASY_AND_HARD], KEYS)
    base = _eval(tmp_path, "base", EASY_AND_HARD[::-1], KEYS[::-1])  # the same prompts, in another order
    (row,) = compare(
        json.loads((better / "eval.json").read_text()), json.loads((base / "eval.json").read_text())
    )
    assert row["paired"] and row["difference"] == pytest.approx(0.1)
    assert row["interval"] == pytest.approx([0.1, 0.1])  # one token more on every prompt: no doubt left
    assert main([str(better), str(base / "eval.json")]) == 0
    out = capsys.readouterr().out
    assert "| code | 10, 10 | 2.54 | 2.44 | +0.10 | +0.10 to +0.10 | in pairs |" in out
    assert "τ better | τ base" in out

    unkeyed = _eval(tmp_path, "unkeyed", EASY_AND_HARD, None)  # evaluated before prompts had keys
    (row,) = compare(
        json.loads((better / "eval.json").read_text()), json.loads((unkeyed / "eval.json").read_text())
    )
    assert not row["paired"] and row["interval"][0] < 0 < row["interval"][1]


def test_what_cannot_be_compared_says_why(tmp_path: Path, capsys) -> None:
    a = _eval(tmp_path, "a", EASY_AND_HARD, KEYS, sets=("code",))
    b = _eval(tmp_path, "b", EASY_AND_HARD, KEYS, sets=("math",))
    assert main([str(a), str(tmp_path / "missing")]) == 2
    assert "missing: no eval.json there; evaluate the run first" in capsys.readouterr().err
    assert main([str(a), str(b)]) == 2
    assert "no prompt set evaluated in both (['code'] and ['math'])" in capsys.readouterr().err
    assert main([str(a), str(a), "--proposer", "baseline"]) == 2
    assert "no proposer 'baseline' in both evaluations; pass --proposer" in capsys.readouterr().err
    results = json.loads((a / "eval.json").read_text())
    del results["sets"]["code"]["results"]["eaglet"]["per_prompt"]  # a server's results: totals only
    (a / "eval.json").write_text(json.dumps(results))
    assert main([str(a), str(a)]) == 0
    out = capsys.readouterr().out
    assert "| n/a | n/a |" in out and "n/a: an evaluation without per-prompt counts" in out
