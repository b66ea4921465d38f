"""Speculative decoding at every draft length K = 1..K_max from one greedy decode and one chain per state.

Greedy speculative decoding is deterministic. With n tokens generated, the proposer's guess depends only on
prompt + reference[:n] (reference = the target's greedy output), and the first K tokens of its K_max-token
greedy chain are its K-token chain. The target accepts the longest prefix of the guess equal to
reference[n:] and adds its own next token, so the next state is n + accepted + 1. Hence one greedy reference
per prompt (continued past the stop token, where a chain may still be checked), the target's aux states of
that reference (one forward), and the proposer's K_max-chain at every state reproduce, step for step, the run
`speculative_decode` makes at each K <= K_max: same steps, acceptances per position, forwards and output.
Both score a step with the same `DecodeStats.record_step`;
a test checks the replay against real speculative decoding at every K. The cost is one greedy decode plus one
draft chain per generated token, instead of one speculative decode per draft length.

The only difference is numerical: here the target's aux states come from one forward over the reference,
there from cached forwards over growing prefixes (equal up to float rounding).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from eaglet.errors import ConfigError
from eaglet.evaluate.acceptance import DecodeStats
from eaglet.evaluate.proposers import Proposer, TargetState
from eaglet.evaluate.speculative import greedy_decode
from eaglet.target_model import LoadedTarget, capture_hidden_states


@dataclass
class PromptTrace:
    """What the target and the proposer would do at every state of one prompt's greedy decode."""

    # The target's greedy tokens; when it stopped, followed by the stop token and k_max more greedy tokens.
    reference: list[int]
    # Tokens the decode outputs (the stop token excluded).
    length: int
    stopped: bool
    # chains[n]: the proposer's chain (up to k_max tokens) after n generated tokens, for every reachable state.
    chains: dict[int, list[int]]
    # Wall-clock seconds of the plain greedy decode (the baseline of a measured speedup).
    greedy_seconds: float = 0.0


def _check(k: int, max_new_tokens: int) -> None:
    if k < 1:
        raise ConfigError(f"draft length must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.inference_mode()
def trace_prompt(
    target: LoadedTarget,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    *,
    k_max: int,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
) -> PromptTrace:
    """The greedy reference of one prompt and the proposer's k_max-token chain at every reachable state."""
    _check(k_max, max_new_tokens)
    prompt = list(prompt_ids)
    reference, seconds = greedy_decode(target, prompt, max_new_tokens, stop_ids)
    length = len(reference)
    stopped = length < max_new_tokens
    if stopped:
        # The stop token and what the target would verify after it, should a chain run past the stop.
        after, _ = greedy_decode(target, [*prompt, *reference], k_max + 1)
        reference = [*reference, *after]
    # A state n proposes when the budget leaves room (n <= max_new_tokens - 2) and the decode goes on (n <= length).
    last_state = min(length, max_new_tokens - 2)
    chains: dict[int, list[int]] = {}
    if length == 0 or last_state < 1:
        return PromptTrace(reference, length, stopped, chains, seconds)
    aux = _aux_states(target, proposer, [*prompt, *reference[: last_state - 1]])
    p = len(prompt)
    proposer.reset([*prompt, reference[0]], TargetState(None if aux is None else aux[:p]))
    for n in range(1, last_state + 1):
        if n > 1:
            row = None if aux is None else aux[p + n - 2 : p + n - 1]
            proposer.accept([reference[n - 1]], TargetState(row))
        chains[n] = list(proposer.propose(k_max))[:k_max]
    return PromptTrace(reference, length, stopped, chains, seconds)


def _aux_states(target: LoadedTarget, proposer: Proposer, tokens: list[int]) -> torch.Tensor | None:
    """[len(tokens), n_aux, H]: the target's aux states at every position, for proposers that read them."""
    if not proposer.aux_layer_ids:
        return None
    device = next(target.model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    captured = capture_hidden_states(
        target.model, target.parts, ids, torch.ones_like(ids), proposer.aux_layer_ids
    )
    return captured.aux_hidden_states[0]


def replay(trace: PromptTrace, k: int, max_new_tokens: int) -> DecodeStats:
    """The DecodeStats `speculative_decode` reports for this prompt at draft length k (seconds excluded)."""
    _check(k, max_new_tokens)
    stats = DecodeStats.for_draft_length(k)
    stats.target_forwards = 1  # the prefill
    n = min(trace.length, 1)
    while 0 < n < max_new_tokens:
        budget = min(k, max_new_tokens - n - 1)
        proposals = trace.chains[n][:budget] if budget else []
        accepted = stats.record_step(proposals, trace.reference[n : n + len(proposals)])
        stats.target_forwards += 1
        n += accepted + 1
        if trace.stopped and n > trace.length:  # the accepted block reached the stop token
            n = trace.length
            break
    stats.new_tokens = n
    return stats


def replay_per_prompt(
    traces: Sequence[PromptTrace], k_max: int, max_new_tokens: int
) -> list[list[DecodeStats]]:
    """Each prompt's stats at each draft length: [draft length 1..k_max][prompt]."""
    return [[replay(trace, k, max_new_tokens) for trace in traces] for k in range(1, k_max + 1)]


def summed_per_length(per_prompt: Sequence[Sequence[DecodeStats]]) -> list[DecodeStats]:
    """`replay_per_prompt`'s stats summed over the prompts: one DecodeStats per draft length 1..k_max."""
    return [sum(stats, DecodeStats.for_draft_length(k)) for k, stats in enumerate(per_prompt, start=1)]


def replay_all(traces: Sequence[PromptTrace], k_max: int, max_new_tokens: int) -> list[DecodeStats]:
    """Summed stats over the prompts, one DecodeStats per draft length 1..k_max."""
    return summed_per_length(replay_per_prompt(traces, k_max, max_new_tokens))
