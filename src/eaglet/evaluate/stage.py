"""The evaluation stage: a trained run's head against the real target, beside n-gram lookup, per prompt set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.config.choices import EvalBackend
from eaglet.config.schema import EagletConfig
from eaglet.errors import ConfigError, DataError
from eaglet.evaluate.loading import load_evaluator
from eaglet.evaluate.metrics import evaluate_prompts, format_positions, format_table
from eaglet.evaluate.prompts import check_head_fits_target, check_run_target, load_prompt_sets
from eaglet.evaluate.workers import evaluate_in_workers
from eaglet.formats import serving
from eaglet.formats.folder import CONFIG_FILE
from eaglet.fsutil import atomic_write_json
from eaglet.run_dir import RunDir
from eaglet.target_model.loader import load_tokenizer


def evaluated_run(cfg: EagletConfig) -> RunDir:
    """The run whose head is evaluated: finished, and trained for this target."""
    ev = cfg.eval
    if not ev.sets:
        raise ConfigError(f"eval.sets is empty: name prompt sets to evaluate, from {sorted(ev.set_defs)}")
    run = RunDir.resolve(ev.run, Path(cfg.paths.output_dir), key="eval.run")
    if not run.has_head():
        raise DataError(f"{run.path} holds no finished head (no draft/config.json)")
    check_run_target(run, cfg)
    # A missing baseline head is named where it is loaded.
    if ev.baseline_draft and (Path(ev.baseline_draft) / CONFIG_FILE).is_file():
        check_head_fits_target(Path(ev.baseline_draft), cfg, "eval.baseline_draft")
    return run


def run_evaluation(cfg: EagletConfig) -> dict[str, Any]:
    """Evaluate every configured set; results are written to <run>/eval.json and returned.

    Every set's prompts are read before any decoding, so a set with nothing to evaluate stops the run
    before it starts, and an earlier eval.json is never replaced by one without results. With
    eval.backend=vllm_server|sglang_server the target is reached through a serving engine instead
    (eaglet.evaluate.server_stage), with the same results file.
    """
    ev = cfg.eval
    run = evaluated_run(cfg)
    if ev.backend != EvalBackend.in_process:
        from eaglet.evaluate.server_stage import run_server_evaluation

        return run_server_evaluation(cfg, run)
    if ev.workers > 1:
        prompt_sets = load_prompt_sets(cfg, load_tokenizer(cfg.model, Path(cfg.paths.cache_dir)))
        per_set = evaluate_in_workers(cfg, run, prompt_sets)
    else:
        evaluator = load_evaluator(cfg, run, ev.device)
        prompt_sets = load_prompt_sets(cfg, evaluator.target.tokenizer)
        per_set = {
            name: evaluate_prompts(
                evaluator.target,
                evaluator.proposers,
                prompts,
                num_spec_tokens=ev.num_spec_tokens,
                max_new_tokens=ev.max_new_tokens,
                stop_ids=evaluator.stop_ids,
                tie_tolerance=ev.tie_tolerance,
                position_accuracy=ev.position_accuracy,
                desc=name,
            )
            for name, (prompts, _) in prompt_sets.items()
        }
    results: dict[str, Any] = {"run": str(run.path), "num_spec_tokens": ev.num_spec_tokens, "sets": {}}
    for name, (prompts, overlap) in prompt_sets.items():
        per_proposer = per_set[name]
        results["sets"][name] = {"prompts": len(prompts), "overlap_dropped": overlap, "results": per_proposer}
        print(f"\n{name}: {len(prompts)} prompts ({overlap} overlapping training prompts dropped)")
        print(format_table(per_proposer))
        if ev.position_accuracy:
            print(format_positions(per_proposer))
    atomic_write_json(run.results_file, results)
    return results


def serve_commands(run: Path, num_spec_tokens: int) -> str:
    """The exact commands that serve the exported head with vLLM and SGLang."""
    return serving.serve_commands(RunDir(run).draft_dir.resolve(), num_spec_tokens)


def plot_acceptance(results: dict[str, Any], path: Path) -> Path:
    """Per-position acceptance rate of each proposer, one panel per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = results["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(4 * len(sets), 3.2), squeeze=False, sharey=True)
    for ax, (name, entry) in zip(axes[0], sets.items(), strict=True):
        for proposer, r in entry["results"].items():
            rates = r["acceptance_rates"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{proposer} (τ={r['tau']:.2f})")
        ax.set_title(f"{name} ({entry['prompts']} prompts)")
        ax.set_xlabel("draft position")
        ax.set_xticks(range(1, max(len(r["acceptance_rates"]) for r in entry["results"].values()) + 1))
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("acceptance rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
