"""τ and per-position acceptance of a trained head at draft lengths 1..K_max, against the real target.

The prompts are the evaluator's (eval.sets, eval.prompts_per_set, eval.max_new_tokens; prompts seen in
training are dropped). Every draft length comes from one replayed greedy decode per prompt
(eaglet.sweeps.replay); real speculative decoding at K_max runs too, as a check of the replay (its τ is
recorded beside the replayed one; its output must equal greedy decoding) and for the wall-clock speedup on
this machine.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from eaglet.config.schema import EagletConfig
from eaglet.data.templating import chat_template_variables, resolve_chat_template
from eaglet.errors import DataError
from eaglet.evaluate.acceptance import DecodeStats
from eaglet.evaluate.intervals import tau_intervals
from eaglet.evaluate.metrics import check_lossless
from eaglet.evaluate.prompts import load_prompt_set, training_prompts
from eaglet.evaluate.proposers import Eagle3Proposer, Proposer
from eaglet.evaluate.speculative import greedy_decode, speculative_decode
from eaglet.formats.reader import load_eagle_draft
from eaglet.sweeps.replay import replay_per_prompt, summed_per_length, trace_prompt
from eaglet.target_model import LoadedTarget, load_target


def decode_curve(cfg: EagletConfig, draft_dir: Path, k_max: int) -> dict[str, Any]:
    """The head in `draft_dir` against the target of `cfg.model`, on the evaluator's prompt sets."""
    ev = cfg.eval
    target = load_target(cfg.model, device=ev.device, cache_dir=Path(cfg.paths.cache_dir))
    # The template variables (thinking switch, model.chat_template_kwargs) every other rendering passes.
    variables = chat_template_variables(cfg.model, cfg.extract.regenerate)
    template = resolve_chat_template(target.tokenizer, cfg.model.chat_template, variables)
    embed = target.parts.embed_tokens.weight.detach().float().cpu()
    head, _, aux_ids = load_eagle_draft(draft_dir, embed_tokens=embed)
    proposer = Eagle3Proposer(head.to(target.device), aux_ids)
    seen = training_prompts(cfg)
    prompts: list[list[int]] = []
    per_set: dict[str, int] = {}
    for name in ev.sets:
        ids, _ = load_prompt_set(cfg, name, target.tokenizer, template, seen)
        per_set[name] = len(ids)
        prompts += ids
    if not prompts:
        raise DataError(
            f"no evaluation prompt left in eval.sets={list(ev.sets)}: every one overlaps training; "
            "sweep.tau_source=sim measures on the validation shards instead"
        )
    curve = replayed_curve(
        target,
        proposer,
        prompts,
        k_max=k_max,
        max_new_tokens=ev.max_new_tokens,
        tie_tolerance=ev.tie_tolerance,
        stop_ids={target.tokenizer.eos_token_id},
    )
    return {"prompts": per_set, **curve}


def replayed_curve(
    target: LoadedTarget,
    proposer: Proposer,
    prompts: list[list[int]],
    *,
    k_max: int,
    max_new_tokens: int,
    tie_tolerance: float,
    stop_ids: Collection[int],
) -> dict[str, Any]:
    """τ (with its 95% interval over the prompts), acceptance and tokens per forward at draft lengths 1..k_max by
    replay, each prompt's counts ("per_prompt", per draft length), and real decoding at k_max."""
    if target.device.type == "cuda":  # first calls pay for lazy initialisation: keep them out of the timings
        greedy_decode(target, prompts[0], 2, stop_ids)
    traces, measured, near_ties = [], DecodeStats(), 0
    for prompt in tqdm(prompts, desc=f"decode K=1..{k_max}", unit="prompt"):
        trace = trace_prompt(
            target, proposer, prompt, k_max=k_max, max_new_tokens=max_new_tokens, stop_ids=stop_ids
        )
        output, stats = speculative_decode(
            target,
            proposer,
            prompt,
            num_spec_tokens=k_max,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
        )
        # Lossless: equal to greedy decoding, up to the evaluator's tolerated near-ties of bf16 targets.
        near_ties += check_lossless(
            target,
            prompt,
            trace.reference[: trace.length],
            output,
            tie_tolerance=tie_tolerance,
            proposer="eaglet",
            prompt_index=len(traces),
        )
        traces.append(trace)
        measured = measured + stats
    per_prompt = replay_per_prompt(traces, k_max, max_new_tokens)
    totals = summed_per_length(per_prompt)
    # Per draft length, each prompt's counts: the sweep's summary resamples prompts to say how sure its pick is.
    counts = [
        {"accepted": [s.accepted for s in stats], "steps": [s.steps for s in stats]} for stats in per_prompt
    ]
    greedy_seconds = sum(t.greedy_seconds for t in traces)
    return {
        "new_tokens": totals[0].new_tokens,
        "tau": [t.tau for t in totals],
        "tau_ci95": [tau_intervals({"eaglet": c})["eaglet"]["tau_ci95"] for c in counts],
        "per_prompt": counts,
        # acceptance_rates[K-1][i]: accepted / proposed at draft position i+1 when drafting K tokens.
        "acceptance_rates": [[t.acceptance_rate(i) for i in range(k)] for k, t in enumerate(totals, start=1)],
        "tokens_per_forward": [t.tokens_per_forward for t in totals],
        # Real speculative decoding at K_max: the replay's last entry must match it.
        "measured_at_max_draft_length": {
            "tau": measured.tau,
            "acceptance_rates": [measured.acceptance_rate(i) for i in range(k_max)],
            "tokens_per_forward": measured.tokens_per_forward,
            "wall_clock_speedup": greedy_seconds / measured.seconds if measured.seconds else 0.0,
            "near_ties": near_ties,
        },
    }
