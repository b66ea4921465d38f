"""Evaluate proposers on a prompt set: acceptance, tokens per target forward, wall-clock speedup, losslessness.

Every prompt is decoded greedily first (the reference and the baseline time), then by each proposer. A
speculative output that differs from the greedy one is a bug, not a statistic: LosslessError, unless the
target itself hesitated there (top-2 logit gap below `tie_tolerance`, for bf16 runs where a K+1-token forward
may round differently from a 1-token one); such near-ties are counted instead.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from eaglet.evaluate.acceptance import DecodeStats
from eaglet.evaluate.positions import position_counts, position_summary, sequence_aux_states
from eaglet.evaluate.proposers import Eagle3Proposer, Proposer
from eaglet.evaluate.speculative import LosslessError, greedy_decode, speculative_decode
from eaglet.target_model import LoadedTarget

_WARMUP_TOKENS = 4


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gap(target: LoadedTarget, ids: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit after `ids` (no cache): how close its greedy choice was."""
    device = next(target.model.parameters()).device
    logits = target.model(input_ids=torch.tensor([list(ids)], device=device), logits_to_keep=1).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def evaluate_prompts(
    target: LoadedTarget,
    proposers: dict[str, Proposer],
    prompts: list[list[int]],
    *,
    num_spec_tokens: int,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
    tie_tolerance: float = 0.0,
    position_accuracy: bool = False,
    desc: str = "evaluate",
) -> dict[str, dict[str, Any]]:
    """Per proposer name: tau, acceptance_rates (per draft position), tokens_per_forward, speedup (greedy
    seconds / speculative seconds, same prompts, same machine), and the raw counts behind them. With
    `position_accuracy`, each EAGLE proposer also gets "positions": validation's per-position accuracy on the
    greedy answers (eaglet.evaluate.positions).

    A progress bar labelled `desc` advances once per prompt (greedy plus every proposer)."""
    if not prompts:
        return {}
    # Untimed warm-up: first calls pay for lazy initialisation (allocator, kernels, CUDA context).
    greedy_decode(target, prompts[0], min(_WARMUP_TOKENS, max_new_tokens), stop_ids)
    for proposer in proposers.values():
        speculative_decode(
            target,
            proposer,
            prompts[0],
            num_spec_tokens=num_spec_tokens,
            max_new_tokens=min(_WARMUP_TOKENS, max_new_tokens),
            stop_ids=stop_ids,
        )
    # Prompt by prompt, greedy then every proposer: a load change on the machine hits all of them alike.
    totals = {name: DecodeStats() for name in proposers}
    scoring = {n: p for n, p in proposers.items() if position_accuracy and isinstance(p, Eagle3Proposer)}
    position_totals = {name: ([0] * num_spec_tokens, [0] * num_spec_tokens) for name in scoring}
    near_ties = dict.fromkeys(proposers, 0)
    greedy_seconds = 0.0
    for index, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        reference, seconds = greedy_decode(target, prompt, max_new_tokens, stop_ids)
        greedy_seconds += seconds
        tokens, aux_by_layers = [*prompt, *reference], {}
        for name, proposer in scoring.items():
            layers = tuple(proposer.aux_layer_ids)  # one target forward for heads that read the same layers
            if layers not in aux_by_layers:
                aux_by_layers[layers] = sequence_aux_states(target, layers, tokens)
            aux = aux_by_layers[layers]
            right, scored = position_counts(proposer.drafter, tokens, aux, len(prompt), num_spec_tokens)
            total_right, total_scored = position_totals[name]
            position_totals[name] = (
                [a + b for a, b in zip(total_right, right, strict=True)],
                [a + b for a, b in zip(total_scored, scored, strict=True)],
            )
        for name, proposer in proposers.items():
            output, stats = speculative_decode(
                target,
                proposer,
                prompt,
                num_spec_tokens=num_spec_tokens,
                max_new_tokens=max_new_tokens,
                stop_ids=stop_ids,
            )
            near_ties[name] += check_lossless(
                target,
                prompt,
                reference,
                output,
                tie_tolerance=tie_tolerance,
                proposer=name,
                prompt_index=index,
            )
            totals[name] = totals[name] + stats

    results: dict[str, dict[str, Any]] = {}
    for name, total in totals.items():
        results[name] = {
            "tau": total.tau,
            "acceptance_rates": [total.acceptance_rate(i) for i in range(num_spec_tokens)],
            "tokens_per_forward": total.tokens_per_forward,
            "speedup": greedy_seconds / total.seconds if total.seconds else 0.0,
            "steps": total.steps,
            "proposed": total.proposed,
            "accepted": total.accepted,
            "new_tokens": total.new_tokens,
            "target_forwards": total.target_forwards,
            "seconds": total.seconds,
            "greedy_seconds": greedy_seconds,
            "near_ties": near_ties[name],
        }
        if name in position_totals:
            results[name]["positions"] = position_summary(*position_totals[name])
    return results


def check_lossless(
    target: LoadedTarget,
    prompt: Sequence[int],
    reference: Sequence[int],
    output: Sequence[int],
    *,
    tie_tolerance: float,
    proposer: str,
    prompt_index: int,
) -> int:
    """Whether a speculative `output` equals the greedy `reference` of the same prompt: 0 if equal, 1 for a
    near-tie (the target's top-2 logit gap at the first difference below `tie_tolerance`); raises
    LosslessError otherwise, naming the proposer and the prompt's index."""
    position = first_difference(reference, output)
    if position is None:
        return 0
    gap = top2_gap(target, [*prompt, *reference[:position]])
    if gap < tie_tolerance:
        return 1
    rounding = (
        f" The target runs in {target.dtype}, where a forward over K+1 tokens may round differently from a "
        "1-token one: if the gap is a few units in the last place, pass tie_tolerance to count such near-ties."
        if target.dtype != torch.float32
        else ""
    )
    raise LosslessError(
        f"proposer {proposer!r}, prompt {prompt_index}: speculative output differs from greedy at new token "
        f"{position} (greedy {reference[position : position + 3]}..., speculative "
        f"{output[position : position + 3]}...; lengths {len(reference)} and {len(output)}). The target's top-2 "
        f"logit gap there is {gap:.4g}, not below the tie tolerance {tie_tolerance}: the verifier or the cache "
        f"handling is wrong.{rounding}"
    )


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table: one row per proposer."""
    width = max((len(r["acceptance_rates"]) for r in results.values()), default=0)
    header = [
        "proposer",
        "tau",
        *(f"acc@{i + 1}" for i in range(width)),
        "tokens/forward",
        "speedup",
        "tokens",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        rates = [f"{rate:.2f}" for rate in r["acceptance_rates"]] + [""] * (
            width - len(r["acceptance_rates"])
        )
        row = [name, f"{r['tau']:.2f}", *rates, _number(r["tokens_per_forward"]), _number(r["speedup"], "x")]
        lines.append("| " + " | ".join([*row, str(r["new_tokens"])]) + " |")
    return "\n".join(lines)


def format_positions(results: dict[str, dict[str, Any]]) -> str:
    """One line per proposer scored position by position (validation's metric on these answers); "" if none."""
    lines = []
    for name, r in results.items():
        if "positions" in r:
            p = r["positions"]
            accuracy = " / ".join(f"{a:.3f}" for a in p["accuracy"])
            lines.append(
                f"{name}, per answer position as in validation: acc_k {accuracy}, tau_sim {p['tau_sim']:.2f} "
                f"({p['positions']} positions)"
            )
    return "\n".join(lines)


def _number(value: float | None, unit: str = "") -> str:
    """A figure of the table; n/a where it was not measured (a server reports no target forwards)."""
    return "n/a" if value is None else f"{value:.2f}{unit}"
