"""recipes/smollm2_gpu.py end to end on CPU at toy size: data, sweep, final and the speculators baseline."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.config import REPO_ROOT


def driver(out: Path, cache: Path, *options: str) -> subprocess.CompletedProcess:
    tiny = (
        f"hardware=cpu dataset=oasst_en100 dataset.max_records_per_file=16 extract.regenerate.max_new_tokens=24 "
        f"extract.max_length=256 extract.output_dir={out}/shards paths.data_dir={out}/data paths.cache_dir={cache} "
        "hardware.tokens_per_device=512 trainer.global_batch_tokens=512 trainer.max_steps=3 trainer.val_fraction=0.3 "
        "eval.prompts_per_set=1 eval.max_new_tokens=8 eval.sets=[math] draft.vocab_size=64 "
        "extract.regenerate.import_from=null"
    )
    cmd = [sys.executable, str(REPO_ROOT / "recipes" / "smollm2_gpu.py"), f"out={out}", "eval_device=cpu",
           "per_gpu=2", "sweep_prompts=1", "final_epochs=1", f"extra={tiny}", *options]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.e2e
def test_recipe_runs_every_stage_and_resumes(tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / "recipe"
    proc = driver(out, model_cache, "trials=base,ttt3", "final_prompts=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = json.loads((out / "sweep.json").read_text())
    assert set(sweep) == {"base", "ttt3"}
    for trial in sweep.values():  # each evaluated against the real target beside n-gram lookup
        assert set(trial["tau"]) == {"math"} and trial["tau"]["math"] >= 1.0 and trial["ngram"]["math"] >= 1.0
    assert sweep["ttt3"]["overrides"] == ["trainer.ttt_steps=3"]
    final = json.loads((out / "final.json").read_text())
    best = max(sweep, key=lambda name: sweep[name]["score"])
    assert final["final"]["overrides"] == sweep[best]["overrides"]
    assert (Path(final["final"]["saved"]) / "model.safetensors").exists()
    assert (Path(final["speculators"]["saved"]) / "config.json").exists()
    assert "speculators | saved:" in (out / "final.md").read_text()

    # Everything done is reused: a second run trains and evaluates nothing.
    again = driver(out, model_cache, "trials=base,ttt3", "final_prompts=0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "sweep.json").read_text()) == sweep
    logs = (out / "trials" / "base" / "log.txt").read_text()
    assert logs.count("train.py") == 1 and logs.count("evaluate.py") == 1


def test_unknown_option_is_named() -> None:
    cmd = [sys.executable, str(REPO_ROOT / "recipes" / "smollm2_gpu.py"), "epochs=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown option 'epochs'" in proc.stderr


def _driver_module():
    spec = importlib.util.spec_from_file_location("smollm2_gpu", REPO_ROOT / "recipes" / "smollm2_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_final_settings_come_from_a_named_trial_or_the_sweep(tmp_path: Path) -> None:
    recipe = _driver_module()
    assert recipe.final_overrides(tmp_path, "ttt3") == ["trainer.ttt_steps=3"]
    with pytest.raises(SystemExit, match="final_trial='nope' is not a trial"):
        recipe.final_overrides(tmp_path, "nope")
    with pytest.raises(SystemExit, match="run the sweep stage first, or name final_trial=base"):
        recipe.final_overrides(tmp_path, "")
    sweep = {"a": {"overrides": ["x=1"], "score": 0.8}, "b": {"overrides": ["x=2"], "score": 0.9},
             "c": {"failed": "exit 1"}}  # fmt: skip
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    assert recipe.final_overrides(tmp_path, "") == ["x=2"]
