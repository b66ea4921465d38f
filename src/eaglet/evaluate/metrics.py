"""Evaluate proposers on a prompt set: acceptance, tokens per target forward, wall-clock speedup, losslessness.

Every prompt is decoded greedily first (the reference and the baseline time), then by each proposer. A
speculative output that differs from the greedy one is a bug, not a statistic: LosslessError, unless the
target itself hesitated there (top-2 logit gap below `tie_tolerance`, for bf16 runs where a K+1-token forward
may round differently from a 1-token one); such near-ties are counted instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from eaglet.evaluate.acceptance import DecodeStats
from eaglet.evaluate.intervals import tau_intervals
from eaglet.evaluate.positions import (
    in_draft_vocab,
    position_counts,
    position_summary,
    sequence_aux_states,
    target_top1,
)
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


def prompt_key(prompt: Sequence[int]) -> str:
    """A short, stable name of a prompt's token ids (the same prompt, template and tokenizer give the same key)."""
    return hashlib.sha1(np.asarray(prompt, dtype=np.int64).tobytes()).hexdigest()[:16]


@torch.inference_mode()
def top2_gap(target: LoadedTarget, ids: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit after `ids` (no cache): how close its greedy choice was."""
    device = next(target.model.parameters()).device
    logits = target.model(input_ids=torch.tensor([list(ids)], device=device), logits_to_keep=1).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


@dataclass
class PromptOutcome:
    """One prompt's counts, per proposer name: what `summarize` sums over a set (in any order, from any process)."""

    greedy_seconds: float
    stats: dict[str, DecodeStats]
    near_ties: dict[str, int]
    # (right, scored) per draft step, for the EAGLE proposers scored position by position.
    positions: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    # (sum, count) of the target's top-1 probability on the answer tokens, when scored position by position.
    target_top1: tuple[float, int] = (0.0, 0)
    # (answer tokens predicted, how many the draft vocab holds) per EAGLE proposer scored position by position.
    in_vocab: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The prompt's tokens, hashed: evaluations of other runs on the same prompts can be compared prompt by prompt.
    prompt_key: str = ""


def warm_up(
    target: LoadedTarget,
    proposers: dict[str, Proposer],
    prompt: list[int],
    *,
    num_spec_tokens: int,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
) -> None:
    """Untimed decoding of a few tokens: first calls pay for lazy initialisation (allocator, kernels, CUDA
    context), which must not count against whichever loop runs first."""
    tokens = min(_WARMUP_TOKENS, max_new_tokens)
    greedy_decode(target, prompt, tokens, stop_ids)
    for proposer in proposers.values():
        speculative_decode(
            target,
            proposer,
            prompt,
            num_spec_tokens=num_spec_tokens,
            max_new_tokens=tokens,
            stop_ids=stop_ids,
        )


def evaluate_prompt(
    target: LoadedTarget,
    proposers: dict[str, Proposer],
    prompt: list[int],
    *,
    index: int,
    num_spec_tokens: int,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
    tie_tolerance: float = 0.0,
    position_accuracy: bool = False,
) -> PromptOutcome:
    """Greedy decoding of `prompt`, then every proposer's speculative decoding of it, checked lossless against
    the greedy output (`index` names the prompt in a LosslessError). Greedy first, then the proposers, prompt by
    prompt: a load change on the machine hits all of them alike."""
    reference, greedy_seconds = greedy_decode(target, prompt, max_new_tokens, stop_ids)
    outcome = PromptOutcome(greedy_seconds, stats={}, near_ties={}, prompt_key=prompt_key(prompt))
    if position_accuracy:
        tokens, aux_by_layers = [*prompt, *reference], {}
        outcome.target_top1 = target_top1(target, tokens, len(prompt))
        for name, proposer in proposers.items():
            if isinstance(proposer, Eagle3Proposer):
                # One target forward for heads that read the same layers.
                layers = tuple(proposer.aux_layer_ids)
                if layers not in aux_by_layers:
                    aux_by_layers[layers] = sequence_aux_states(target, layers, tokens)
                outcome.positions[name] = position_counts(
                    proposer.drafter, tokens, aux_by_layers[layers], len(prompt), num_spec_tokens
                )
                outcome.in_vocab[name] = in_draft_vocab(proposer.drafter, tokens, len(prompt))
    for name, proposer in proposers.items():
        output, outcome.stats[name] = speculative_decode(
            target,
            proposer,
            prompt,
            num_spec_tokens=num_spec_tokens,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
        )
        outcome.near_ties[name] = check_lossless(
            target, prompt, reference, output, tie_tolerance=tie_tolerance, proposer=name, prompt_index=index
        )
    return outcome


def summarize(outcomes: Sequence[PromptOutcome], num_spec_tokens: int) -> dict[str, dict[str, Any]]:
    """Per proposer name: tau, its 95% interval over prompts (tau_ci95) and that of its ratio to every other
    proposer's (ratio_ci95, resampled on the same prompts; eaglet.evaluate.intervals), acceptance_rates (per
    draft position), tokens_per_forward, speedup (greedy seconds / speculative seconds over the same prompts),
    the raw counts behind them (per_prompt: accepted and steps of each prompt, in order, and the prompts'
    keys), and "positions" (eaglet.evaluate.positions) for the proposers scored position by position."""
    if not outcomes:
        return {}
    greedy_seconds = sum(o.greedy_seconds for o in outcomes)
    per_prompt = {
        name: {
            "accepted": [o.stats[name].accepted for o in outcomes],
            "steps": [o.stats[name].steps for o in outcomes],
            "prompts": [o.prompt_key for o in outcomes],
        }
        for name in outcomes[0].stats
    }
    intervals = tau_intervals(per_prompt)
    results: dict[str, dict[str, Any]] = {}
    for name in outcomes[0].stats:
        total = sum((o.stats[name] for o in outcomes), DecodeStats())
        results[name] = {
            "tau": total.tau,
            **intervals[name],
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
            "near_ties": sum(o.near_ties[name] for o in outcomes),
            "per_prompt": per_prompt[name],
        }
        if name in outcomes[0].positions:
            right = [sum(o.positions[name][0][k] for o in outcomes) for k in range(num_spec_tokens)]
            scored = [sum(o.positions[name][1][k] for o in outcomes) for k in range(num_spec_tokens)]
            top1 = (sum(o.target_top1[0] for o in outcomes), sum(o.target_top1[1] for o in outcomes))
            in_vocab = (
                sum(o.in_vocab[name][0] for o in outcomes),
                sum(o.in_vocab[name][1] for o in outcomes),
            )
            results[name]["positions"] = position_summary(right, scored, top1, in_vocab)
    return results


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
    """`summarize` of every prompt's `evaluate_prompt`, in this process, after a warm-up. With
    `position_accuracy`, each EAGLE proposer also gets "positions": validation's per-position accuracy on the
    greedy answers (eaglet.evaluate.positions).

    A progress bar labelled `desc` advances once per prompt (greedy plus every proposer)."""
    if not prompts:
        return {}
    settings = {"num_spec_tokens": num_spec_tokens, "max_new_tokens": max_new_tokens, "stop_ids": stop_ids}
    warm_up(target, proposers, prompts[0], **settings)
    outcomes = [
        evaluate_prompt(
            target,
            proposers,
            prompt,
            index=index,
            tie_tolerance=tie_tolerance,
            position_accuracy=position_accuracy,
            **settings,
        )
        for index, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt"))
    ]
    return summarize(outcomes, num_spec_tokens)


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


def format_table(results: dict[str, dict[str, Any]], reference: str = "ngram") -> str:
    """A markdown table: one row per proposer, with τ's 95% interval over the prompts and, when `reference`
    (n-gram lookup) is among the proposers, each τ as a multiple of its τ with that ratio's interval."""
    width = max((len(r["acceptance_rates"]) for r in results.values()), default=0)
    against = reference if reference in results else None
    header = [
        "proposer",
        "tau",
        "tau 95% CI",
        *([f"x {against} (95% CI)"] if against else []),
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
        row = [name, f"{r['tau']:.2f}", _interval(r.get("tau_ci95"))]
        if against:
            row.append(_ratio(r, results[against], r.get("ratio_ci95", {}).get(against)))
        row += [*rates, _number(r["tokens_per_forward"]), _number(r["speedup"], "x")]
        lines.append("| " + " | ".join([*row, str(r["new_tokens"])]) + " |")
    return "\n".join(lines)


def _ratio(result: dict[str, Any], reference: dict[str, Any], bounds: list[float] | None) -> str:
    if result is reference:
        return "1"
    ratio = result["tau"] / reference["tau"]
    return f"{ratio:.2f}" if bounds is None else f"{ratio:.2f} ({_interval(bounds)})"


def format_positions(results: dict[str, dict[str, Any]]) -> str:
    """One line per proposer scored position by position (validation's metric on these answers); "" if none."""
    lines = []
    for name, r in results.items():
        if "positions" in r:
            p = r["positions"]
            accuracy = " / ".join(f"{a:.3f}" for a in p["accuracy"])
            lines.append(
                f"{name}, per answer position as in validation: acc_k {accuracy}, tau_sim {p['tau_sim']:.2f} "
                f"({p['positions']} positions); the target's own top-1 probability on these answers "
                f"{p['target_top1']:.3f}; in the draft vocab {p['in_draft_vocab']:.1%}"
            )
    return "\n".join(lines)


def _interval(bounds: list[float] | None) -> str:
    """A 95% interval of the table; n/a where it was not measured (a server reports no per-prompt counts)."""
    return "n/a" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def _number(value: float | None, unit: str = "") -> str:
    """A figure of the table; n/a where it was not measured (a server reports no target forwards)."""
    return "n/a" if value is None else f"{value:.2f}{unit}"
