"""Evaluation results in W&B: the training run's W&B run (resumed by the id its folder records) gets the
results as summary values, a table of them and the acceptance plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.config.schema import EagletConfig
from eaglet.tracking import log_results


def eval_summary(results: dict[str, Any]) -> dict[str, float]:
    """The results as flat W&B summary values: eval/<set>/<proposer>/{tau, acceptance_<k>, speedup,
    tokens_per_forward, lossless (prompts decoded exactly as greedy), near_ties}, eval/<set>/prompts."""
    summary: dict[str, float] = {"eval/num_spec_tokens": results["num_spec_tokens"]}
    for name, entry in results["sets"].items():
        summary[f"eval/{name}/prompts"] = entry["prompts"]
        summary[f"eval/{name}/overlap_dropped"] = entry["overlap_dropped"]
        for proposer, r in entry["results"].items():
            key = f"eval/{name}/{proposer}"
            summary[f"{key}/tau"] = r["tau"]
            for k, rate in enumerate(r["acceptance_rates"], start=1):
                summary[f"{key}/acceptance_{k}"] = rate
            summary[f"{key}/speedup"] = r["speedup"]
            summary[f"{key}/tokens_per_forward"] = r["tokens_per_forward"]
            summary[f"{key}/lossless"] = entry["prompts"] - r["near_ties"]
            summary[f"{key}/near_ties"] = r["near_ties"]
    return summary


def results_table(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One row per prompt set and proposer, as format_table prints them."""
    width = results["num_spec_tokens"]
    columns = ["set", "proposer", "prompts", "tau", *(f"acc@{k}" for k in range(1, width + 1))]
    columns += ["tokens_per_forward", "speedup", "lossless", "near_ties"]
    rows = []
    for name, entry in results["sets"].items():
        for proposer, r in entry["results"].items():
            rates = [*r["acceptance_rates"], *[None] * (width - len(r["acceptance_rates"]))]
            rows.append(
                [name, proposer, entry["prompts"], r["tau"], *rates, r["tokens_per_forward"], r["speedup"],
                 entry["prompts"] - r["near_ties"], r["near_ties"]]
            )  # fmt: skip
    return columns, rows


def track_evaluation(cfg: EagletConfig, results: dict[str, Any], plot: Path) -> str | None:
    """The results, their table and the acceptance plot into the W&B run of the evaluated training run
    (resumed by the id its folder records; a new run recorded there if it has none). The run's id, or None."""
    run = Path(results["run"])
    return log_results(
        run,
        summary=eval_summary(results),
        images={"eval/acceptance": plot},
        tables={"eval/results": results_table(results)},
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        group=cfg.wandb.group,
        name=run.name,
        job_type="eval",
    )
