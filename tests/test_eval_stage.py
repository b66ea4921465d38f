"""evaluate.py and export.py on a run trained here (tiny random Llama target)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import compose_config
from test_train import shards, train_overrides  # noqa: F401  (module fixture: shards by the real extraction)

from eaglet.errors import ConfigError, DataError, EagletError
from eaglet.evaluate.stage import plot_acceptance, run_evaluation, serve_commands
from eaglet.export.stage import run_export
from eaglet.formats.contract import check_speculators_folder
from eaglet.train.run import run_training


@pytest.fixture(scope="module")
def run_dir(shards: Path, tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("outputs")
    run_training(compose_config(model_cache, *train_overrides(shards, out)), out / "train" / "run")
    return out / "train" / "run"


def eval_overrides(shards: Path, run_dir: Path, *extra: str) -> list[str]:  # noqa: F811
    return [
        *train_overrides(shards, run_dir.parent.parent),
        f"eval.run={run_dir}",
        "eval.sets=[code,math]",
        "eval.prompts_per_set=2",
        "eval.max_new_tokens=12",
        "eval.num_spec_tokens=3",
        *extra,
    ]


def test_evaluation_reports_both_proposers_and_stays_lossless(compose, shards, run_dir: Path) -> None:  # noqa: F811
    results = run_evaluation(compose(*eval_overrides(shards, run_dir)))
    assert set(results["sets"]) == {"code", "math"}
    for entry in results["sets"].values():
        assert entry["prompts"] == 2
        assert set(entry["results"]) == {"eaglet", "ngram"}
        for r in entry["results"].values():
            assert 1.0 <= r["tau"] <= 4.0 and len(r["acceptance_rates"]) == 3
    assert json.loads((run_dir / "eval.json").read_text())["num_spec_tokens"] == 3
    assert plot_acceptance(results, run_dir / "acceptance.png").stat().st_size > 1000
    assert '"num_speculative_tokens": 3' in serve_commands(run_dir, 3)


def _counts(results: dict) -> dict:
    """Every figure of eval.json but the clock's."""
    timed = {"speedup", "seconds", "greedy_seconds"}
    return {
        name: {p: {k: v for k, v in r.items() if k not in timed} for p, r in entry["results"].items()}
        for name, entry in results["sets"].items()
    }


def test_worker_processes_count_what_one_process_counts(compose, shards, run_dir: Path) -> None:  # noqa: F811
    """eval.workers=2: prompts decoded in two spawned processes, each with its own target, give the counts of
    one process, per set and proposer (acceptance, tokens, forwards, per-position accuracy, near-ties)."""
    settings = ("eval.prompts_per_set=3", "eval.position_accuracy=true")
    alone = run_evaluation(compose(*eval_overrides(shards, run_dir, *settings)))
    side_by_side = run_evaluation(compose(*eval_overrides(shards, run_dir, *settings, "eval.workers=2")))
    assert _counts(side_by_side) == _counts(alone)
    assert all(e["prompts"] == 3 for e in side_by_side["sets"].values())
    assert all(r["seconds"] > 0 for e in side_by_side["sets"].values() for r in e["results"].values())


def test_a_worker_that_cannot_start_stops_the_evaluation_with_a_hint(
    compose,
    shards,  # noqa: F811
    run_dir: Path,
    tmp_path: Path,
) -> None:
    missing = tmp_path / "no_such_head"
    with pytest.raises(EagletError, match="evaluation process stopped.*smaller eval.workers"):
        run_evaluation(
            compose(*eval_overrides(shards, run_dir, "eval.workers=2", f"eval.baseline_draft={missing}"))
        )


def test_prompts_seen_in_training_are_dropped(compose, shards, run_dir: Path) -> None:  # noqa: F811
    # The training dataset is oasst_en100 (first 30 records): records 28 and 29 overlap, 30 and 31 do not.
    straddling = [
        "eval.sets=[code]",
        "eval.set_defs.code.path=${paths.shared_data}/oasst_en100.jsonl",
        "eval.set_defs.code.skip=28",
        "eval.set_defs.code.count=4",
        "eval.prompts_per_set=4",
    ]
    results = run_evaluation(compose(*eval_overrides(shards, run_dir), *straddling))
    assert results["sets"]["code"]["overlap_dropped"] == 2 and results["sets"]["code"]["prompts"] == 2


def test_a_set_seen_whole_in_training_fails_and_keeps_earlier_results(compose, shards, run_dir: Path) -> None:  # noqa: F811
    """Issue 18: it used to end with rc 0, an empty table, and an eval.json without results over the old one."""
    same = [
        "eval.sets=[math,code]",
        "eval.set_defs.code.path=${paths.shared_data}/oasst_en100.jsonl",
        "eval.set_defs.code.skip=0",
        "eval.set_defs.code.count=3",
    ]
    earlier = '{"sets": {"math": "an earlier evaluation"}}'
    (run_dir / "eval.json").write_text(earlier)
    with pytest.raises(DataError) as exc:
        run_evaluation(compose(*eval_overrides(shards, run_dir), *same))
    message = str(exc.value)
    assert (
        "prompt set 'code'" in message and "all 2 prompts" in message and "eval.set_defs.code.skip" in message
    )
    assert (run_dir / "eval.json").read_text() == earlier


def test_a_set_added_from_the_command_line_is_evaluated(compose, shards, run_dir: Path) -> None:  # noqa: F811
    added = [
        "+eval.set_defs.extra.path=${paths.shared_data}/gsm8k_train.jsonl",
        "+eval.set_defs.extra.skip=7100",
        "eval.sets=[extra]",
        "eval.prompts_per_set=1",
    ]
    results = run_evaluation(compose(*eval_overrides(shards, run_dir), *added))
    assert results["sets"]["extra"]["prompts"] == 1 and set(results["sets"]["extra"]["results"]) == {
        "eaglet",
        "ngram",
    }


def test_an_unfinished_run_is_named_by_the_stage_key(compose, tmp_path: Path) -> None:
    """Issue 18: export of an unfinished run used to suggest eval.run=."""
    unfinished = tmp_path / "train" / "killed"
    (unfinished / "checkpoints").mkdir(parents=True)
    for stage, key in ((run_export, "export.run"), (run_evaluation, "eval.run")):
        with pytest.raises(ConfigError) as newest:
            stage(compose(f"paths.output_dir={tmp_path}"))
        with pytest.raises(DataError) as named:
            stage(compose(f"paths.output_dir={tmp_path}", f"{key}={unfinished}"))
        for exc in (newest, named):
            assert f"{key}=" in str(exc.value), str(exc.value)
            assert ("eval.run" if key == "export.run" else "export.run") not in str(exc.value)


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        (["eval.num_spec_tokens=0"], ConfigError, "num_spec_tokens"),
        (["eval.sets=[nope]"], ConfigError, "nope"),
        (["eval.sets=[]"], ConfigError, "eval.sets is empty"),
        (["eval.set_defs.code.skip=100000"], DataError, "no records after"),
        (["eval.workers=0"], ConfigError, "eval.workers"),
        (["eval.workers=2", "eval.backend=vllm_server"], ConfigError, "eval.workers=2 applies to"),
    ],
)
def test_bad_evaluation_settings(compose, shards, run_dir: Path, extra, error, match) -> None:  # noqa: F811
    with pytest.raises(error, match=match):
        run_evaluation(compose(*eval_overrides(shards, run_dir), *extra))


def test_a_run_without_a_head_or_for_another_target(compose, shards, run_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(DataError, match="no finished head"):
        run_evaluation(compose(*eval_overrides(shards, run_dir), f"eval.run={tmp_path}"))
    (run_dir / ".hydra").mkdir(exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(
        "model: {name: other, hidden_size: 64, vocab_size: 49152}\n"
    )
    try:
        with pytest.raises(ConfigError, match="model.name=other"):
            run_evaluation(compose(*eval_overrides(shards, run_dir)))
    finally:
        (run_dir / ".hydra" / "config.yaml").unlink()


def test_a_head_folder_is_evaluated_like_its_run(compose, shards, run_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """A head by itself (an export, another trainer's head): the same counts as its run, eval.json beside it."""
    head = tmp_path / "head"
    shutil.copytree(run_dir / "draft", head)
    own = run_evaluation(compose(*eval_overrides(shards, run_dir)))
    alone = run_evaluation(compose(*eval_overrides(shards, run_dir), f"eval.run={head}"))
    assert _counts(alone) == _counts(own)
    assert json.loads((head / "eval.json").read_text())["sets"].keys() == {"code", "math"}
    spec = run_export(
        compose(
            *train_overrides(shards, run_dir.parent.parent), f"export.run={head}", "export.format=speculators"
        )
    )
    assert check_speculators_folder(spec)
    assert _counts(run_evaluation(compose(*eval_overrides(shards, run_dir), f"eval.run={spec}"))) == _counts(
        own
    )


def test_a_head_for_another_target_is_refused_by_name(compose, shards, run_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    head = tmp_path / "other"
    shutil.copytree(run_dir / "draft", head)
    config = json.loads((head / "config.json").read_text())
    config["target_hidden_size"] += 8
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 99]
    config.pop("eagle_config", None)
    (head / "config.json").write_text(json.dumps(config))
    for key in ("eval.run", "eval.baseline_draft"):
        with pytest.raises(ConfigError, match=rf"{key}=.*another target") as err:
            run_evaluation(compose(*eval_overrides(shards, run_dir), f"{key}={head}"))
        assert "hidden states of size" in str(err.value) and "[1, 2, 99]" in str(err.value)


def test_export_both_formats_and_refuse_a_full_folder(compose, shards, run_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    base = [*train_overrides(shards, run_dir.parent.parent), f"export.run={run_dir}"]
    out = run_export(compose(*base, f"export.out_dir={tmp_path / 'eagle'}"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(ConfigError, match="export.overwrite=true"):
        run_export(compose(*base, f"export.out_dir={tmp_path / 'eagle'}"))
    spec = run_export(compose(*base, "export.format=speculators", f"export.out_dir={tmp_path / 'spec'}"))
    assert check_speculators_folder(spec)


def test_evaluation_results_go_to_the_training_runs_wandb_run(compose, tmp_path: Path, fake_wandb) -> None:
    from eaglet.evaluate.record import track_evaluation
    from eaglet.tracking import record_for

    run = tmp_path / "run"
    trained = record_for(run, project="eaglet", name="run")  # what training recorded in its folder
    rates = {"eaglet": [0.5, 0.25, 0.0], "ngram": [0.2, 0.0, 0.0]}
    results = {
        "run": str(run),
        "num_spec_tokens": 3,
        "sets": {
            name: {
                "prompts": 2,
                "overlap_dropped": 1,
                "results": {
                    proposer: {"tau": 1.0 + sum(r), "acceptance_rates": r, "tokens_per_forward": 1.5,
                               "speedup": 1.2, "near_ties": int(proposer == "ngram")}
                    for proposer, r in rates.items()
                },
            }
            for name in ("code", "math")
        },
    }  # fmt: skip
    plot = plot_acceptance(results, tmp_path / "acceptance.png")
    assert track_evaluation(compose(), results, plot) == trained.id
    (init,) = fake_wandb.inits
    assert (
        init["id"] == trained.id and init["resume"] == "allow" and init["job_type"] is None
    )  # stays "train"
    summary = fake_wandb.summary
    assert summary["eval/math/eaglet/tau"] == 1.75 and summary["eval/code/ngram/tau"] == 1.2
    assert [summary[f"eval/code/eaglet/acceptance_{k}"] for k in (1, 2, 3)] == [0.5, 0.25, 0.0]
    assert summary["eval/math/eaglet/speedup"] == 1.2 and summary["eval/math/eaglet/lossless"] == 2
    assert summary["eval/math/ngram/lossless"] == 1 and summary["eval/math/ngram/near_ties"] == 1
    assert summary["eval/code/prompts"] == 2 and summary["eval/num_spec_tokens"] == 3
    assert fake_wandb.logged["eval/acceptance"] == ("image", str(plot))
    _, columns, rows = fake_wandb.logged["eval/results"]
    assert columns[:4] == ["set", "proposer", "prompts", "tau"] and len(rows) == 4
