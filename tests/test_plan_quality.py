"""plan.quality: τ of measured heads against log2 of their training tokens, read from scale.json and run folders."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.config.schema import PlanQualityConfig
from eaglet.errors import ConfigError, DataError
from eaglet.plan.quality import MeasuredHead, fit_sets, measure_quality, read_measured

ROOT = Path(__file__).resolve().parents[1]


def result(tau: float) -> dict:
    return {"tau": tau, "acceptance_rates": [0.5, 0.3], "steps": 10}


def sets(**taus: tuple[float, float]) -> dict:
    """{set: (eaglet τ, ngram τ)} -> the "sets" of an eval.json."""
    return {
        name: {"prompts": 2, "results": {"eaglet": result(e), "ngram": result(n)}}
        for name, (e, n) in taus.items()
    }


def write_run(
    folder: Path, steps: int, batch: int, seconds: float | None = None, **taus: tuple[float, float]
) -> Path:
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(
        json.dumps({"num_spec_tokens": 4, "run": str(folder), "sets": sets(**taus)})
    )
    (folder / "report.json").write_text(
        json.dumps({"steps": steps, "global_batch_tokens": batch, "epochs": 1, "seconds": seconds})
    )
    return folder


def write_scale(path: Path) -> Path:
    rows = {
        "main": {
            "store": "main",
            "overrides": [],
            "steps": 100,
            "tokens_seen": 3_276_800,
            "train_s": 32.768,
            "sets": sets(alpaca=(2.4, 1.8), code=(3.0, 1.9)),
            "num_spec_tokens": 4,
        },
        "half": {"steps": 50, "tokens_seen": 1_638_400, "sets": sets(alpaca=(2.1, 1.8))},
        "not_evaluated": {"steps": 100, "tokens_seen": 3_276_800},
        "ablation": {
            "steps": 50,
            "tokens_seen": 1_638_400,
            "overrides": ["trainer.ttt_steps=7"],
            "sets": sets(alpaca=(9.0, 1.0)),
        },
        "other_data": {
            "steps": 50,
            "tokens_seen": 1_638_400,
            "store": "shared_only",
            "sets": sets(alpaca=(9.0, 1.0)),
        },
        "not_trained": {"sets": sets(alpaca=(9.0, 1.0))},
        # a row the recipe copied from an earlier run's scale.json (`earlier=`): counted where it was measured
        "copied": {
            "steps": 50,
            "tokens_seen": 1_638_400,
            "sets": sets(alpaca=(9.0, 1.0)),
            "earlier": "scale.2026-12-07.json",
        },
    }
    path.write_text(json.dumps({"stores": {"main": {"tokens": 1000}}, "rows": rows}))
    return path


def line(tokens: float) -> float:
    return 1 + 0.4 * math.log2(tokens / 1e6)


# ---- the fit ---------------------------------------------------------------------------------------------


def test_fit_recovers_a_known_line():
    heads = [
        MeasuredHead(f"h{t}", t, {"a": line(t), "b": 2.0}, {"a": 1.0 + i / 10, "b": 1.5})
        for i, t in enumerate([1e6, 4e6, 32e6])
    ]
    heads.append(MeasuredHead("only_c", 1e6, {"c": 2.0}, {}))
    (a, b) = fit_sets(heads)  # "c" has one head: left out
    assert (a.name, a.points) == ("a", 3)
    assert a.slope_per_doubling == pytest.approx(0.4) and a.intercept == pytest.approx(
        1 - 0.4 * math.log2(1e6)
    )
    assert a.baseline_tau == pytest.approx(1.1) and (a.tau_min, a.tau_max) == (
        pytest.approx(1.0),
        pytest.approx(3.0),
    )
    assert a.tau_at(256e6) == pytest.approx(1 + 0.4 * 8)
    assert a.tokens_for(1 + 0.4 * 10) == pytest.approx(1024e6)
    assert b.slope_per_doubling == pytest.approx(0.0) and b.tokens_for(3.0) is None
    falling = fit_sets([MeasuredHead("x", 1e6, {"a": 2.0}, {}), MeasuredHead("y", 2e6, {"a": 1.9}, {})])[0]
    assert falling.slope_per_doubling == pytest.approx(-0.1) and falling.tokens_for(2.5) is None


def test_fit_needs_two_token_counts():
    same = [MeasuredHead("x", 1e6, {"a": 2.0}, {}), MeasuredHead("y", 1e6, {"a": 2.1}, {})]
    with pytest.raises(ConfigError, match="at least two heads .* trained on different token counts"):
        fit_sets(same)


# ---- reading -----------------------------------------------------------------------------------------------


def test_read_scale_json_skips_rows_not_evaluated_ablations_and_copies(tmp_path: Path):
    path = write_scale(tmp_path / "scale.json")
    heads = read_measured(str(path), PlanQualityConfig())
    assert [h.label for h in heads] == [f"{path}:main", f"{path}:half"]
    assert heads[0].tokens == 3_276_800 and heads[0].tau == {"alpaca": 2.4, "code": 3.0}
    assert heads[0].baseline_tau == {"alpaca": 1.8, "code": 1.9}
    assert [h.label for h in read_measured(str(tmp_path), PlanQualityConfig())] == [h.label for h in heads]
    assert heads[0].tokens_per_s == pytest.approx(100_000) and heads[1].tokens_per_s is None
    # K where the summary records it (summaries written before it was recorded lack it)
    assert heads[0].num_spec_tokens == 4 and heads[1].num_spec_tokens is None
    before = PlanQualityConfig(tokens_before=[f"{path}:half=1000"])
    assert read_measured(str(path), before)[1].tokens == 1_638_400 + 1000


def test_read_run_folder(tmp_path: Path):
    folder = write_run(tmp_path / "run", 10, 32768, alpaca=(2.5, 1.7))
    (head,) = read_measured(str(folder), PlanQualityConfig())
    assert head == MeasuredHead(str(folder), 327_680, {"alpaca": 2.5}, {"alpaca": 1.7}, num_spec_tokens=4)
    (more,) = read_measured(str(folder), PlanQualityConfig(tokens_before=[f"{folder}=1e6"]))
    assert more.tokens == 327_680 + 1e6


def test_measure_quality_off_and_on(tmp_path: Path):
    assert measure_quality(PlanQualityConfig()) is None
    scale = write_scale(tmp_path / "scale.json")
    run = write_run(tmp_path / "run", 10, 32768, alpaca=(1.8, 1.7), math=(2.0, 1.6))
    quality = measure_quality(PlanQualityConfig(measured=[str(scale), str(run)]))
    assert [f.name for f in quality.fits] == ["alpaca"] and quality.fits[0].points == 3
    assert quality.measured_tokens_per_s == pytest.approx(100_000)  # the one head whose seconds are known
    assert quality.unfitted == ["code", "math"] and quality.num_spec_tokens == 4
    # Several timed runs: the longest one's rate (a short run's start-up weighs on its rate the most)
    short = write_run(tmp_path / "short", 10, 32768, 32.768, alpaca=(1.8, 1.7))  # 10K tokens/s
    longer = write_run(tmp_path / "long", 1000, 32768, 163.84, alpaca=(2.8, 1.7))  # 200K tokens/s
    timed = measure_quality(PlanQualityConfig(measured=[str(short), str(scale), str(longer)]))
    assert timed.measured_tokens_per_s == pytest.approx(200_000)
    with pytest.raises(ConfigError, match="no measured head is labelled \\['nope'\\]"):
        measure_quality(PlanQualityConfig(measured=[str(scale)], tokens_before=["nope=5"]))


@pytest.mark.parametrize("entry", ["abc", "x=", "x=-3", "=5"])
def test_tokens_before_entries_are_checked(tmp_path: Path, entry: str):
    run = write_run(tmp_path / "run", 10, 32768, alpaca=(1.8, 1.7))
    with pytest.raises(ConfigError, match="expected 'label=tokens'"):
        read_measured(str(run), PlanQualityConfig(tokens_before=[entry]))


def test_read_errors(tmp_path: Path):
    cfg = PlanQualityConfig()
    with pytest.raises(ConfigError, match="does not exist .*evaluated run folder or a scale.json"):
        read_measured(str(tmp_path / "missing"), cfg)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "eval.json").write_text("{}")
    with pytest.raises(ConfigError, match="neither scale.json nor eval.json \\+ report.json"):
        read_measured(str(tmp_path / "empty"), cfg)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json: not JSON"):
        read_measured(str(tmp_path / "bad.json"), cfg)
    run = write_run(tmp_path / "run", 10, 32768, alpaca=(1.8, 1.7))
    with pytest.raises(
        DataError,
        match=r"eval.json: set 'alpaca' has no τ for proposer 'eagle3' \(has \['eaglet', 'ngram'\]\); "
        "set plan.quality.proposer",
    ):
        read_measured(str(run), PlanQualityConfig(proposer="eagle3"))
    (run / "report.json").write_text(json.dumps({"steps": 10}))
    with pytest.raises(DataError, match="report.json: needs 'steps' and 'global_batch_tokens'"):
        read_measured(str(run), cfg)


# ---- plan.py -----------------------------------------------------------------------------------------------


def run_plan(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "COLUMNS": "200"}
    command = [sys.executable, str(ROOT / "plan.py"), *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_cli_prints_what_more_training_buys(tmp_path: Path):
    small = write_run(tmp_path / "small", 100, 32768, 16.384, alpaca=(2.0, 1.8), code=(2.5, 1.9))
    large = write_run(tmp_path / "large", 400, 32768, alpaca=(2.4, 1.8), code=(2.9, 1.9))
    base = ["hardware=h200_x1", "dataset=jsonl", "plan.tokens=100000000"]
    proc = run_plan(tmp_path / "out", *base, f"plan.quality.measured=[{small},{large}]")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "What more training buys (τ at K=4 against log2 of tokens trained, 2 measured heads)" in out
    assert "alpaca" in out and "code" in out and "+0.200" in out and "extrapolates" in out
    assert "(200.0K tok/s)" in out  # the heads' own rate, in a header rich may wrap
    off = run_plan(tmp_path / "off", *base)
    assert off.returncode == 0, off.stderr
    assert "What more training buys" not in off.stdout and off.stdout.splitlines()[-1] == out.splitlines()[-1]
    # heads evaluated at different K: the title names none
    other_k = write_run(tmp_path / "k6", 400, 32768, alpaca=(2.4, 1.8))
    (other_k / "eval.json").write_text(
        (other_k / "eval.json").read_text().replace('"num_spec_tokens": 4', '"num_spec_tokens": 6')
    )
    mixed = run_plan(tmp_path / "mixed", *base, f"plan.quality.measured=[{small},{other_k}]")
    assert mixed.returncode == 0, mixed.stderr
    assert "What more training buys (τ against log2 of tokens trained" in mixed.stdout
    proc = run_plan(tmp_path / "typo", *base, "plan.quality.mesured=[x]")
    assert proc.returncode != 0 and "mesured" in proc.stdout + proc.stderr
