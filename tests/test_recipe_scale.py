"""recipes/smollm2_scale.py: every row end to end on CPU at toy size, and invocations stopped by their deadline."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet.config import REPO_ROOT

RECIPES = REPO_ROOT / "recipes"


@pytest.fixture(scope="module")
def recipe():
    """The recipe's module (it imports its sibling modules from recipes/, as `python recipes/...` does)."""
    sys.path.insert(0, str(RECIPES))
    try:
        yield importlib.import_module("smollm2_scale")
    finally:
        sys.path.remove(str(RECIPES))


def driver(out: Path, cache: Path, *options: str) -> subprocess.CompletedProcess:
    tiny = (
        f"hardware=cpu dataset=oasst_en100 dataset.max_records_per_file=6 extract.max_length=256 "
        f"extract.self_prompt.num_prompts=3 extract.self_prompt.batch_size=8 extract.self_prompt.max_prompt_tokens=48 "
        f"extract.regenerate.max_new_tokens=16 extract.regenerate.batch_size=8 extract.regenerate.import_from=null "
        f"extract.regenerate.sampled_conversations=4 paths.data_dir={out}/data paths.cache_dir={cache} "
        # The target and the head eager: compiling them on the CPU costs every training row minutes (test_online and
        # test_ttt_reference check the compiled paths).
        "hardware.tokens_per_device=512 trainer.global_batch_tokens=512 trainer.val_fraction=0.3 trainer.online_compile=false "
        "trainer.compile=false "
        "eval.max_new_tokens=8 eval.sets=[math] draft.vocab_size=64"
    )
    cmd = [sys.executable, str(RECIPES / "smollm2_scale.py"), f"out={out}", "eval_device=cpu", "eval_prompts=1",
           "small_tokens=1024", "mid_tokens=1536", f"extra={tiny}", *options]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)


def commands_run(out: Path) -> int:
    """Commands the recipe started so far: each `$ ...` line of its logs is one."""
    logs = [p for p in out.rglob("*") if p.suffix in (".txt", ".log") and p.is_file()]
    return sum(line.startswith("$ ") for log in logs for line in log.read_text().splitlines())


@pytest.mark.e2e
def test_every_row_runs_on_cpu_and_a_stopped_invocation_continues(tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / "scale"
    # Stopped by its deadline during the first command: exits 0, says what is left and how to continue.
    stopped = driver(out, model_cache, "deadline_s=1", "min_start_s=0")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "data:main: left: stopped at the deadline" in stopped.stdout
    assert "run the same command again to continue" in stopped.stdout
    assert "## Not run (yet)" in (out / "scale.md").read_text()

    # The rows of each kind: the head, a data-scaling row, an ablation on its own store, the speculators column.
    rows = "rows=main,scale_small,shared_only,speculators"
    done = driver(out, model_cache, rows, "speculators_row=scale_small")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all done" in done.stdout
    record = json.loads((out / "scale.json").read_text())
    assert set(record["rows"]) == {"main", "scale_small", "shared_only", "speculators"}
    for name, row in record["rows"].items():  # each evaluated against the real target beside n-gram lookup
        results = row["sets"]["math"]["results"]
        assert results["eaglet"]["tau"] >= 1.0 and results["ngram"]["tau"] >= 1.0, name
        # K of the evaluation, which plan.quality's table names
        evaluated = out / "rows" / ("scale_small" if name == "speculators" else name) / "eval.json"
        assert row["num_spec_tokens"] == json.loads(evaluated.read_text())["num_spec_tokens"], name
    steps = {name: row["steps"] for name, row in record["rows"].items()}
    assert steps == {"main": steps["main"], "scale_small": 2, "shared_only": 2, "speculators": 2}
    stores = record[
        "stores"
    ]  # shared_only: the self-prompted conversations left out, their sampled answers too
    assert stores["shared_only"]["sequences"] < stores["main"]["sequences"]
    report = (out / "scale.md").read_text()
    for name in record["rows"]:
        assert f"| {name} |" in report
    assert "| n-gram lookup |" in report and "main vs n-gram lookup, maths" in report
    assert (
        "scale_small vs the speculators head (same data and steps)" in report and "Every row ran." in report
    )

    # Nothing finished is redone: a third invocation starts no command.
    before = commands_run(out)
    again = driver(out, model_cache, rows, "speculators_row=scale_small")
    assert again.returncode == 0 and "all done" in again.stdout
    assert commands_run(out) == before


def test_tasks_after_the_deadline_are_left_and_done_ones_skipped(recipe) -> None:
    from smollm2_gpu import DeadlineReached

    ran: list[str] = []

    def task(name: str, done: bool = False, stops: bool = False, needs: tuple[str, ...] = ()):
        def run(deadline: float | None) -> None:
            ran.append(name)
            if stops:
                raise DeadlineReached(name)

        return recipe.Task(name, lambda: done, run, needs)

    tasks = [
        task("data", done=True),
        task("train", stops=True),
        task("eval", needs=("train",)),
        task("other"),
    ]
    status = recipe.run_tasks(tasks, deadline=time.time() + 600, min_start_s=0)
    assert ran == ["train"]
    assert status == {"data": "done", "train": "left: stopped at the deadline, continues where it was",
                      "eval": "left: waits for train", "other": "left: not started before the deadline"}  # fmt: skip
    # Too little time left to start anything.
    ran.clear()
    status = recipe.run_tasks([task("other")], deadline=time.time() + 10, min_start_s=60)
    assert ran == [] and status == {"other": "left: not started before the deadline"}


def test_a_command_running_at_the_deadline_is_stopped(recipe, tmp_path: Path) -> None:
    from smollm2_gpu import DeadlineReached, sh

    start = time.time()
    with pytest.raises(DeadlineReached):
        sh(["sleep", "60"], tmp_path / "log.txt", deadline=time.time() + 1)
    assert time.time() - start < 30
    assert "stopped at the recipe's deadline" in (tmp_path / "log.txt").read_text()


def test_a_command_killed_without_a_word_leaves_its_status_in_the_log(recipe, tmp_path: Path) -> None:
    from smollm2_gpu import sh

    log = tmp_path / "log.txt"
    with pytest.raises(subprocess.CalledProcessError):
        sh(["sh", "-c", "kill -9 $$"], log)
    assert log.read_text().splitlines()[-1] == "exited with status -9"


def test_a_stopped_training_resumes_from_its_last_checkpoint(
    recipe, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import smollm2_gpu

    commands: list[list[str]] = []

    def fake_sh(cmd: list[str], log: Path, gpu: str | None = None, deadline: float | None = None) -> None:
        commands.append(cmd)
        (run / "report.json").write_text(json.dumps({"steps": 3}))

    monkeypatch.setattr(smollm2_gpu, "sh", fake_sh)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert smollm2_gpu.train(run, ["x=1"], 1, "0") == {"steps": 3}
    assert f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}" in commands[0]
    assert smollm2_gpu.train(run, ["x=1"], 1, "0") == {"steps": 3} and len(commands) == 1  # done: not rerun


def test_rows_see_their_tokens_once(recipe) -> None:
    opts = {**recipe.OPTS, "extra": "hardware=cpu trainer.global_batch_tokens=512", "small_tokens": "5000"}
    scale = recipe.Scale(opts)
    assert scale.steps("small_tokens") == 10
    overrides = scale.row_overrides("shared_only")
    assert "extract.self_prompt.num_prompts=0" in overrides and "trainer.max_steps=10" in overrides
    assert f"extract.output_dir={scale.store_dir('shared_only')}" in overrides
    # The experiment's own batch when `extra` sets none: 20M tokens at 32,768 a step.
    assert recipe.Scale(recipe.OPTS).steps("mid_tokens") == 610
    assert [t.name for t in scale.tasks(["main", "ttt7"])] == [
        "data:main", "train:main", "eval:main", "train:ttt7", "eval:ttt7"
    ]  # fmt: skip
    assert not [o for o in scale.row_overrides("main") if o.startswith("trainer.init_from")]
    # The speculators head's evaluation decodes its row's head too: the row's own evaluation comes last.
    assert [t.name for t in scale.tasks(["scale_mid", "speculators", "ttt7"])] == [
        "data:main", "train:scale_mid", "train:speculators", "eval:speculators", "train:ttt7", "eval:ttt7",
        "eval:scale_mid"
    ]  # fmt: skip


def test_the_main_head_can_continue_an_earlier_one(recipe, tmp_path: Path) -> None:
    scale = recipe.Scale({**recipe.OPTS, "main_init_from": str(tmp_path / "draft")})
    assert f"trainer.init_from={tmp_path / 'draft'}" in scale.row_overrides("main")
    assert not [o for o in scale.row_overrides("scale_mid") if o.startswith("trainer.init_from")]


def test_the_budget_sets_the_heads_length_once_and_bounds_every_invocation(recipe, tmp_path: Path) -> None:
    from smollm2_gpu import DeadlineReached

    def scale(**opts: str):
        return recipe.Scale({**recipe.OPTS, "out": str(tmp_path / "scale"), "extra": "trainer.global_batch_tokens=1000",
                             "train_tokens_per_s": "1000", "eval_reserve_s": "100", **opts})  # fmt: skip

    budgeted = scale(budget_s="400")
    end = budgeted.budget_end()
    assert end == pytest.approx(time.time() + 400, abs=5)
    assert scale(budget_s="400").budget_end() == end  # counted from the first start, not from each invocation
    store = budgeted.store_dir("main")
    store.mkdir(parents=True)
    (store / recipe.MANIFEST_FILE).write_text(
        json.dumps({"totals": {"tokens": 1_000_000}})
    )  # 1000 steps an epoch
    run = budgeted.run_dir("main")
    # ~300 s left after the reserve: the run is given that time, its schedule fitted to it at its own rate; at the
    # planned one step a second, ~300 steps (the report's estimate), 0.3 of the 1000-step epoch.
    first = budgeted.budgeted_length(run, "main")
    seconds = float(first[0].removeprefix("trainer.max_time_s="))
    assert 290 <= seconds <= 300 and first[1:] == ["trainer.fit_steps_to_time=true"]
    plan = json.loads((run / recipe.BUDGET_FILE).read_text())
    assert 290 <= plan["steps"] <= 300 and plan["whole_epochs"] is False
    assert budgeted.budgeted_length(run, "main") == first  # a resumed run keeps its time
    # When whole epochs fit at the planned rate, the plan says so; they are the most the run may train
    # (trainer.max_epochs), the time and the fitted schedule the same.
    roomy = scale(budget_s="5000", out=str(tmp_path / "roomy"))
    roomy.store_dir("main").mkdir(parents=True)
    (roomy.store_dir("main") / recipe.MANIFEST_FILE).write_text(json.dumps({"totals": {"tokens": 1_000_000}}))
    assert [o.split("=")[0] for o in roomy.budgeted_length(roomy.run_dir("main"), "main")] == [
        "trainer.max_time_s",
        "trainer.fit_steps_to_time",
    ]
    assert json.loads((roomy.run_dir("main") / recipe.BUDGET_FILE).read_text())["whole_epochs"] is True
    # No time left for the head: it is left, not started.
    late = scale(budget_s="50", out=str(tmp_path / "late"))
    with pytest.raises(DeadlineReached):
        late.budgeted_length(late.run_dir("main"), "main")
    assert scale().budget_end() is None and scale().budgeted_length(run, "main") == []


def test_every_rows_commands_compose(recipe, compose) -> None:
    """A row's overrides are checked as train.py checks them: a wrong key or value fails here, not on a GPU."""
    scale = recipe.Scale(recipe.OPTS)
    for name in recipe.ROWS:
        cfg = compose(*scale.common(scale.row_overrides(name)))
        tokens = recipe.ROWS[name].tokens
        assert cfg.trainer.max_steps == (-1 if tokens is None else scale.steps(tokens)), name
    quarter = compose(*scale.common(scale.row_overrides("quarter_data")))
    assert quarter.trainer.train_fraction == 0.25 and quarter.trainer.ttt_steps == 5
    reseeded = compose(*scale.common(scale.row_overrides("seed_mid")))
    assert (
        reseeded.trainer.seed == 4 and reseeded.seed == quarter.seed and reseeded.extract == quarter.extract
    )


def test_an_ablation_is_measured_against_an_earlier_runs_row_on_the_same_data(recipe, tmp_path: Path) -> None:
    totals = {"sequences": 3, "tokens": 300, "masked_tokens": 200}
    evaluated = {"math": {"prompts": 1, "results": {}}}
    earlier = {"stores": {"main": totals},
               "rows": {"scale_mid": {"store": "main", "against": None, "steps": 610, "sets": evaluated}}}  # fmt: skip
    record = {"stores": {"main": totals}, "rows": {"ttt7": {"store": "main", "against": "scale_mid"}}}
    same = recipe.borrow_earlier(record, earlier, "experiments/e.json", lambda store: totals)
    assert same["rows"]["scale_mid"] == {**earlier["rows"]["scale_mid"], "earlier": "e.json"}
    assert list(same["rows"]) == ["ttt7", "scale_mid"] and "scale_mid" not in record["rows"]
    # Data made otherwise (or not made) is no reference: the row is left out.
    other = {**totals, "tokens": 301}
    assert "scale_mid" not in recipe.borrow_earlier(record, earlier, "e.json", lambda store: other)["rows"]
    assert "scale_mid" not in recipe.borrow_earlier(record, earlier, "e.json", lambda store: None)["rows"]
    # A row this run has wins over the earlier one, and an earlier row never evaluated stands in for nothing.
    ran = {**record, "rows": {**record["rows"], "scale_mid": {"store": "main", "steps": 1}}}
    assert (
        recipe.borrow_earlier(ran, earlier, "e.json", lambda store: totals)["rows"]["scale_mid"]["steps"] == 1
    )
    unevaluated = {**earlier, "rows": {"scale_mid": {"store": "main", "against": None}}}
    assert (
        "scale_mid" not in recipe.borrow_earlier(record, unevaluated, "e.json", lambda store: totals)["rows"]
    )


def test_a_data_scaling_row_takes_the_rest_of_its_curve_from_an_earlier_run(recipe) -> None:
    totals = {"sequences": 3, "tokens": 300, "masked_tokens": 200}
    evaluated = {"math": {"prompts": 1, "results": {}}}
    curve = {"store": "main", "overrides": [], "against": None, "sets": evaluated}
    earlier = {"stores": {"main": totals}, "rows": {
        "scale_small": {**curve, "steps": 153}, "scale_mid": {**curve, "steps": 610},
        "main": {**curve, "steps": 900, "overrides": ["trainer.init_from=/heads/h"]},  # continued: off the curve
        "ttt7": {**curve, "steps": 610, "overrides": ["trainer.ttt_steps=7"], "against": "scale_mid"}}}  # fmt: skip
    ran_main = {"stores": {"main": totals}, "rows": {"main": {**curve, "steps": 7200}}}
    rows = recipe.borrow_earlier(ran_main, earlier, "e.json", lambda store: totals)["rows"]
    assert list(rows) == ["main", "scale_small", "scale_mid"]
    assert rows["main"]["steps"] == 7200 and rows["scale_mid"] == {
        **earlier["rows"]["scale_mid"],
        "earlier": "e.json",
    }
    # A continued head there is no point of this curve.
    ran_small = {"stores": {"main": totals}, "rows": {"scale_small": {**curve, "steps": 153}}}
    assert list(recipe.borrow_earlier(ran_small, earlier, "e.json", lambda store: totals)["rows"]) == [
        "scale_small", "scale_mid"]  # fmt: skip
    # Only ablations run: no curve to complete, only their reference.
    ablation = {"stores": {"main": totals}, "rows": {"ttt7": {**curve, "against": "scale_mid"}}}
    assert list(recipe.borrow_earlier(ablation, earlier, "e.json", lambda store: totals)["rows"]) == [
        "ttt7", "scale_mid"]  # fmt: skip
    # Other data: no point of this curve.
    other = {**totals, "tokens": 301}
    assert list(recipe.borrow_earlier(ran_main, earlier, "e.json", lambda store: other)["rows"]) == ["main"]


def test_the_earlier_file_is_checked_before_any_work(recipe, tmp_path: Path) -> None:
    assert recipe.read_earlier("") is None
    kept = recipe.read_earlier("experiments/smollm2_scale.2026-12-07.json")
    assert kept is not None and kept["rows"]["scale_mid"]["sets"]
    with pytest.raises(SystemExit, match=r"earlier=.*missing.json: cannot read it"):
        recipe.read_earlier(str(tmp_path / "missing.json"))
    (tmp_path / "other.json").write_text(json.dumps({"sets": {}}))
    with pytest.raises(SystemExit, match="not a scale.json"):
        recipe.read_earlier(str(tmp_path / "other.json"))
