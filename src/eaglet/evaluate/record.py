"""Evaluation results in W&B: the training run's W&B run (resumed by the id its folder records) gets the
results as summary values, a table of them and the acceptance plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglet.config.schema import EagletConfig
from eaglet.tracking import log_results


def differing(result: dict[str, Any]) -> int | None:
    """Prompts whose text differs from greedy decoding's: at exact near-ties in process, or the mismatched texts
    of a server (None when no server decoded greedily beside it)."""
    return result["near_ties"] if "near_ties" in result else result.get("mismatches")


def eval_summary(results: dict[str, Any]) -> dict[str, float]:
    """The results as flat W&B summary values: eval/<set>/<proposer>/{tau, tau_ci95_low, tau_ci95_high,
    acceptance_<k>, speedup, tokens_per_forward, lossless (prompts decoded exactly as greedy), near_ties, and with
    eval.position_accuracy position_acc_<k>, position_tau_sim, target_top1 and in_draft_vocab},
    eval/<set>/prompts; a value a server does not report (tokens per forward, say) is left out."""
    summary: dict[str, float] = {"eval/num_spec_tokens": results["num_spec_tokens"]}
    for name, entry in results["sets"].items():
        summary[f"eval/{name}/prompts"] = entry["prompts"]
        summary[f"eval/{name}/overlap_dropped"] = entry["overlap_dropped"]
        for proposer, r in entry["results"].items():
            key = f"eval/{name}/{proposer}"
            values = {"tau": r["tau"], "speedup": r["speedup"], "tokens_per_forward": r["tokens_per_forward"]}
            if "tau_ci95" in r:  # in process: intervals over the prompts (a server reports totals only)
                values |= {"tau_ci95_low": r["tau_ci95"][0], "tau_ci95_high": r["tau_ci95"][1]}
            values |= {f"acceptance_{k}": rate for k, rate in enumerate(r["acceptance_rates"], start=1)}
            if (differ := differing(r)) is not None:
                values |= {"lossless": entry["prompts"] - differ, "near_ties": differ}
            if "positions" in r:  # eval.position_accuracy
                values |= {f"position_acc_{k}": a for k, a in enumerate(r["positions"]["accuracy"])}
                values["position_tau_sim"] = r["positions"]["tau_sim"]
                values["target_top1"] = r["positions"].get("target_top1")
                values["in_draft_vocab"] = r["positions"].get("in_draft_vocab")
            summary |= {f"{key}/{k}": v for k, v in values.items() if v is not None}
    return summary


def results_table(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One row per prompt set and proposer, as format_table prints them."""
    width = results["num_spec_tokens"]
    columns = ["set", "proposer", "prompts", "tau", "tau_ci95_low", "tau_ci95_high"]
    columns += [f"acc@{k}" for k in range(1, width + 1)]
    columns += ["tokens_per_forward", "speedup", "lossless", "near_ties"]
    rows = []
    for name, entry in results["sets"].items():
        for proposer, r in entry["results"].items():
            rates = [*r["acceptance_rates"], *[None] * (width - len(r["acceptance_rates"]))]
            differ = differing(r)
            lossless = None if differ is None else entry["prompts"] - differ
            low, high = r.get("tau_ci95", (None, None))
            rows.append(
                [name, proposer, entry["prompts"], r["tau"], low, high, *rates, r["tokens_per_forward"],
                 r["speedup"], lossless, differ]
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
