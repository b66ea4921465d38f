"""Prompt sets through one server, and the eval.json entries made of what every server answered.

Every prompt is sent alone and greedily, as token ids. Acceptance comes from the engine's own counters
(eaglet.evaluate.server_metrics); speed is completion tokens over the wall-clock seconds of the requests; the
lossless check compares each speculative server's text with the greedy server's (else with another
speculative server's) and counts the prompts whose text differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eaglet.errors import ConfigError
from eaglet.evaluate.prompts import PromptSets
from eaglet.evaluate.server_client import ServerClient
from eaglet.evaluate.server_metrics import SpecCounts

SPECULATIVE_ROLES = ("eaglet", "ngram", "baseline")
# Untimed tokens of the request each server answers before its counters are read.
_WARMUP_TOKENS = 4
_SPEED = (
    "Speed: completion tokens over the wall-clock seconds of one request at a time (prefill and HTTP "
    "included); speedup against the server without speculation on the same prompts. No target forwards are "
    "counted (tokens/forward n/a)."
)
MEASURED = {
    "vllm": (
        "τ and per-position acceptance from vLLM's counters vllm:spec_decode_num_drafts, _num_draft_tokens, "
        "_num_accepted_tokens and _num_accepted_tokens_per_pos at /metrics, differences around each set "
        f"(τ = 1 + accepted / drafts; position i: accepted_i / drafts). {_SPEED}"
    ),
    "sglang": (
        "τ and per-position acceptance from the meta_info of SGLang's /generate answers, summed over each set "
        "(τ = 1 + accepted drafts / spec_verify_ct; position i from the accepted-length histogram); SGLang's "
        "own spec_accept_length (completion tokens / spec_verify_ct, the prefill's token counted) is kept as "
        f"engine_accept_length. {_SPEED}"
    ),
}


@dataclass
class SetRun:
    """One server's answers to one prompt set."""

    texts: list[str]
    new_tokens: int
    seconds: float
    counts: SpecCounts | None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def measure_server(
    client: ServerClient, role: str, prompt_sets: PromptSets, *, k: int, max_new_tokens: int
) -> dict[str, SetRun]:
    """Every set through one server, one prompt at a time; counts as differences around each set (vLLM) or
    sums of the answers' own (SGLang)."""
    speculative = role != "greedy"
    first = next(prompts[0] for prompts, _ in prompt_sets.values())
    warm = client.complete(first, min(_WARMUP_TOKENS, max_new_tokens), k)  # lazy start-up work, untimed
    check_speculation(client, role, warm.counts, k)
    runs = {}
    for name, (prompts, _) in prompt_sets.items():
        before = client.spec_counts() if speculative and client.engine == "vllm" else None
        texts, tokens, seconds, summed = [], 0, 0.0, SpecCounts()
        for prompt in prompts:
            answer = client.complete(prompt, max_new_tokens, k)
            texts.append(answer.text)
            tokens += answer.tokens
            seconds += answer.seconds
            if answer.counts is not None:
                summed = summed + answer.counts
        counts = summed if speculative else None
        if before is not None:
            counts = (client.spec_counts() or before) - before
            counts.completion_tokens = tokens
        runs[name] = SetRun(texts, tokens, seconds, counts)
    return runs


def check_speculation(client: ServerClient, role: str, answer_counts: SpecCounts | None, k: int) -> None:
    """The server drafts K tokens when it should, and the greedy one does not draft."""
    if client.engine == "vllm":
        snapshot = client.spec_counts()
        drafting, width = snapshot is not None, len(snapshot.accepted_per_pos) if snapshot else 0
        sign = "vllm:spec_decode_* counters at /metrics"
    else:
        drafting, width = answer_counts is not None, k  # SGLang's answers do not say K
        sign = "spec_verify_ct in the meta_info of its /generate answers"
    if role == "greedy" and drafting:
        raise ConfigError(
            f"the greedy server at {client.base} decodes speculatively ({sign}), but it is the reference of the "
            "lossless check and the speed baseline; start it without speculative settings"
        )
    if role != "greedy" and not drafting:
        raise ConfigError(
            f"the {role} server at {client.base} runs without speculative decoding (no {sign}); start it with "
            "the speculative settings eaglet prints (python evaluate.py prints the head's)"
        )
    if role != "greedy" and width != k:
        raise ConfigError(
            f"the {role} server at {client.base} drafts {width} tokens (vllm:spec_decode_num_accepted_tokens_per_pos "
            f"counts positions 0..{width - 1}), but eval.num_spec_tokens={k}; pass eval.num_spec_tokens={width} or "
            f"restart it with num_speculative_tokens={k}"
        )


def role_results(
    runs: dict[str, dict[str, SetRun]], name: str, role: str, prompts: int, engine: str
) -> dict[str, Any]:
    """One proposer's entry of eval.json: the keys in-process evaluation writes, plus the server's own."""
    m = runs[role][name]
    c = m.counts or SpecCounts()
    greedy = runs["greedy"][name] if "greedy" in runs else None
    others = [r for r in SPECULATIVE_ROLES if r in runs and r != role]
    compared = "greedy" if greedy else (others[0] if others else None)
    reference = runs[compared][name] if compared else None
    result: dict[str, Any] = {
        "tau": c.tau,
        "acceptance_rates": c.acceptance_rates(),
        "tokens_per_forward": None,
        "speedup": m.tokens_per_s / greedy.tokens_per_s if greedy and greedy.tokens_per_s else None,
        "steps": c.drafts,
        "proposed": c.draft_tokens,
        "accepted": c.accepted,
        "new_tokens": m.new_tokens,
        "seconds": m.seconds,
        "tokens_per_s": m.tokens_per_s,
        "greedy_seconds": greedy.seconds if greedy else None,
        "greedy_tokens_per_s": greedy.tokens_per_s if greedy else None,
        "mismatches": sum(a != b for a, b in zip(m.texts, reference.texts, strict=True))
        if reference
        else None,
        "compared_with": compared,
    }
    if engine == "sglang":
        result["engine_accept_length"] = c.completion_tokens / c.drafts if c.drafts else None
    else:  # requests of other clients that finished while the set ran: their drafts are in the differences
        result["other_requests"] = max(c.requests - prompts, 0)
    return result


def set_results(
    prompt_sets: PromptSets, runs: dict[str, dict[str, SetRun]], engine: str
) -> dict[str, dict[str, Any]]:
    """eval.json's "sets": per set its prompts, each proposer's results and the greedy server's speed."""
    sets = {}
    for name, (prompts, overlap) in prompt_sets.items():
        entry: dict[str, Any] = {"prompts": len(prompts), "overlap_dropped": overlap}
        entry["results"] = {
            role: role_results(runs, name, role, len(prompts), engine)
            for role in SPECULATIVE_ROLES
            if role in runs
        }
        if "greedy" in runs:
            g = runs["greedy"][name]
            entry["greedy"] = {
                "new_tokens": g.new_tokens,
                "seconds": g.seconds,
                "tokens_per_s": g.tokens_per_s,
            }
        sets[name] = entry
    return sets
