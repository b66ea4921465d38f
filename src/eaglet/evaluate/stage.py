"""The evaluation stage: a trained run's head against the real target, beside n-gram lookup, per prompt set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglet.config.eval_sets import eval_set_defs
from eaglet.config.schema import EagletConfig, EvalSetConfig
from eaglet.data.conversations import load_conversations
from eaglet.data.dataset import load_dataset
from eaglet.data.holdout import normalise_prompt
from eaglet.data.templating import build_prompt_ids, chat_template_variables, resolve_chat_template
from eaglet.errors import ConfigError, DataError
from eaglet.evaluate.metrics import evaluate_prompts, format_table
from eaglet.evaluate.proposers import Eagle3Proposer, NgramProposer, Proposer
from eaglet.formats.reader import load_eagle_draft
from eaglet.fsutil import atomic_write_json
from eaglet.run_dir import RunDir
from eaglet.target_model import LoadedTarget, load_target


def check_run_target(run: RunDir, cfg: EagletConfig) -> None:
    """The head must have been trained for the target being evaluated."""
    settings = run.settings()
    if settings is None:
        return
    trained = settings.model
    for key in ("name", "hidden_size", "vocab_size"):
        if trained[key] != cfg.model[key]:
            raise ConfigError(
                f"{run.path} trained a head for model.{key}={trained[key]}, but this evaluation targets "
                f"model.{key}={cfg.model[key]}; pass model={trained['name']} (or another run)"
            )


def training_prompts(cfg: EagletConfig) -> set[str]:
    """Normalised user turns of the training dataset, to keep evaluation prompts apart from them."""
    conversations, _ = load_dataset(
        cfg.dataset,
        require_assistant=not cfg.extract.regenerate.enabled,
        strict=cfg.extract.strict,
        max_conversations=cfg.extract.max_conversations,
        held_out_sets=eval_set_defs(cfg.eval),
    )
    return {normalise_prompt(t.content) for c in conversations for t in c.turns if t.role == "user"}


def prompts_taken(cfg: EagletConfig, spec: EvalSetConfig) -> int:
    """Records a set contributes: its count, capped by eval.prompts_per_set."""
    return spec.count if cfg.eval.prompts_per_set is None else min(spec.count, cfg.eval.prompts_per_set)


def load_prompt_set(
    cfg: EagletConfig, name: str, tokenizer: Any, template: str, seen: set[str]
) -> tuple[list[list[int]], int]:
    """Token ids of the set's prompts (first user turn, generation prompt appended) and how many overlapped training."""
    set_defs = eval_set_defs(cfg.eval)
    if name not in set_defs:
        raise ConfigError(f"eval.sets names {name!r}, which is not one of {sorted(set_defs)} (eval.set_defs)")
    spec = set_defs[name]
    count = prompts_taken(cfg, spec)
    conversations, _ = load_conversations([spec.path], max_records=spec.skip + count, require_assistant=False)
    chosen = conversations[spec.skip :]
    if not chosen:
        raise DataError(
            f"prompt set {name!r}: {spec.path} has no records after the first {spec.skip}; lower eval.set_defs.{name}.skip"
        )
    prompts, overlap = [], 0
    for conv in chosen:
        first_user = next(t for t in conv.turns if t.role == "user")
        if normalise_prompt(first_user.content) in seen:
            overlap += 1
            continue
        prompts.append(build_prompt_ids(tokenizer, [first_user], chat_template=template))
    return prompts, overlap


def check_prompts_left(cfg: EagletConfig, name: str, prompts: list[list[int]], overlap: int) -> None:
    """A set whose every prompt was seen in training has nothing to evaluate: say so before decoding anything."""
    if prompts:
        return
    spec = eval_set_defs(cfg.eval)[name]
    end = spec.skip + prompts_taken(cfg, spec)
    raise DataError(
        f"prompt set {name!r}: all {overlap} prompts (records [{spec.skip}, {end}) of {spec.path}) are in the "
        f"training data (dataset={cfg.dataset.name}) and were dropped as seen in training, so nothing is left "
        f"to evaluate; nothing was written. Point eval.set_defs.{name}.skip past the records training reads, "
        f"leave {name!r} out of eval.sets, or train with dataset.holdout_eval_sets=true"
    )


def build_proposers(cfg: EagletConfig, run: RunDir, target: LoadedTarget) -> dict[str, Proposer]:
    embed = target.parts.embed_tokens.weight.detach().float().cpu()
    head, _, aux_ids = load_eagle_draft(run.draft_dir, embed_tokens=embed)
    proposers: dict[str, Proposer] = {
        "eaglet": Eagle3Proposer(head.to(target.device), aux_ids),
        "ngram": NgramProposer(min_n=cfg.eval.ngram_min_n, max_n=cfg.eval.ngram_max_n),
    }
    if cfg.eval.baseline_draft:
        other, _, other_ids = load_eagle_draft(cfg.eval.baseline_draft, embed_tokens=embed)
        proposers["baseline"] = Eagle3Proposer(other.to(target.device), other_ids)
    return proposers


def run_evaluation(cfg: EagletConfig) -> dict[str, Any]:
    """Evaluate every configured set; results are written to <run>/eval.json and returned.

    Every set's prompts are read before any decoding, so a set with nothing to evaluate stops the run
    before it starts, and an earlier eval.json is never replaced by one without results.
    """
    ev = cfg.eval
    if not ev.sets:
        raise ConfigError(f"eval.sets is empty: name prompt sets to evaluate, from {sorted(ev.set_defs)}")
    run = RunDir.resolve(ev.run, Path(cfg.paths.output_dir), key="eval.run")
    if not run.has_head():
        raise DataError(f"{run.path} holds no finished head (no draft/config.json)")
    check_run_target(run, cfg)
    target = load_target(cfg.model, device=ev.device, cache_dir=Path(cfg.paths.cache_dir))
    template = resolve_chat_template(
        target.tokenizer, cfg.model.chat_template, chat_template_variables(cfg.model, cfg.extract.regenerate)
    )
    seen = training_prompts(cfg)
    prompt_sets = {name: load_prompt_set(cfg, name, target.tokenizer, template, seen) for name in ev.sets}
    for name, (prompts, overlap) in prompt_sets.items():
        check_prompts_left(cfg, name, prompts, overlap)
    proposers = build_proposers(cfg, run, target)
    stop_ids = {target.tokenizer.eos_token_id}
    results: dict[str, Any] = {"run": str(run.path), "num_spec_tokens": ev.num_spec_tokens, "sets": {}}
    for name, (prompts, overlap) in prompt_sets.items():
        per_proposer = evaluate_prompts(
            target,
            proposers,
            prompts,
            num_spec_tokens=ev.num_spec_tokens,
            max_new_tokens=ev.max_new_tokens,
            stop_ids=stop_ids,
            tie_tolerance=ev.tie_tolerance,
            desc=name,
        )
        results["sets"][name] = {"prompts": len(prompts), "overlap_dropped": overlap, "results": per_proposer}
        print(f"\n{name}: {len(prompts)} prompts ({overlap} overlapping training prompts dropped)")
        print(format_table(per_proposer))
    atomic_write_json(run.results_file, results)
    return results


def serve_commands(run: Path, num_spec_tokens: int) -> str:
    """The exact commands that serve the exported head with vLLM and SGLang."""
    draft = RunDir(run).draft_dir.resolve()
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": num_spec_tokens})
    return (
        f"vllm serve TARGET --speculative-config '{spec}'\n"
        f"python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {draft} --speculative-num-steps {num_spec_tokens} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {num_spec_tokens + 1}"
    )


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
