"""Speculative-decoding counts as the serving engines report them, and eaglet's acceptance figures from them.

vLLM (v1 engine; `SpecDecodingProm` in vllm/v1/spec_decode/metrics.py) keeps Prometheus counters, served in
text format at /metrics, one series per engine (labels `model_name`, `engine`; the client appends `_total`):

    vllm:spec_decode_num_drafts_total                       verification steps that checked a draft
    vllm:spec_decode_num_draft_tokens_total                 draft tokens proposed
    vllm:spec_decode_num_accepted_tokens_total              draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}   accepted at draft position i (0-based)
    vllm:request_success_total{finished_reason=...}         finished requests

They count every request since the server started: eaglet reads them before and after each prompt set and
keeps the difference (series summed over engines). τ = 1 + accepted / drafts and the acceptance at position i
= accepted_i / drafts are vLLM's own definitions (its `SpecDecodingLogging`).

SGLang reports per request, in the `meta_info` of its native /generate answer: `spec_verify_ct` (verification
steps), `completion_tokens`, the accepted draft tokens (`spec_num_correct_drafts`; `spec_accepted_drafts` or
`spec_accept_token_num` in earlier releases) and how many steps accepted 0, 1, ... drafts
(`spec_correct_drafts_histogram`; `spec_accept_histogram` earlier). Its /metrics gauge
`sglang:spec_accept_length` averages over a logging window and cannot be differenced, so eaglet sums the
per-request fields. SGLang's own `spec_accept_length` is completion_tokens / spec_verify_ct, which counts the
token of the prefill too; eaglet's τ stays 1 + accepted / steps, and SGLang's figure is kept beside it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
VLLM_REQUESTS = "vllm:request_success"

# Newest name first: SGLang renamed these fields and kept the old names as aliases for a while.
SGLANG_ACCEPTED = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
SGLANG_PROPOSED = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
SGLANG_HISTOGRAM = ("spec_correct_drafts_histogram", "spec_accept_histogram")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments and unparsable lines skipped)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        samples.append(Sample(match.group(1), dict(_LABEL.findall(match.group(2) or "")), value))
    return samples


def counter_total(samples: list[Sample], name: str, **labels: str) -> float | None:
    """Sum of a counter over its series (every engine), None when the server exposes no such counter.
    Counters appear as `<name>_total`; `_created` series hold start times and are skipped."""
    values = [
        s.value
        for s in samples
        if s.name in (f"{name}_total", name) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


@dataclass
class SpecCounts:
    """Speculative-decoding counts over some requests: a difference of two vLLM snapshots, or a sum of SGLang
    answers (`a + b`, `a - b`)."""

    drafts: int = 0  # verification steps that checked a draft
    draft_tokens: int = 0
    accepted: int | None = 0  # None: an SGLang too old to report it
    accepted_per_pos: list[int] = field(default_factory=list)  # empty: not reported
    requests: int = 0
    completion_tokens: int = 0

    @property
    def tau(self) -> float:
        """1 + accepted / drafts (the bonus token counted), as vLLM reports it; without accepted counts,
        completion tokens per verification step (SGLang's own figure)."""
        if not self.drafts:
            return 1.0
        if self.accepted is None:
            return self.completion_tokens / self.drafts
        return 1.0 + self.accepted / self.drafts

    def acceptance_rates(self) -> list[float]:
        """Per draft position: accepted there / drafts (vLLM's per-position acceptance rate)."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return _combine(self, other, 1)

    def __sub__(self, other: SpecCounts) -> SpecCounts:
        return _combine(self, other, -1)


def _combine(a: SpecCounts, b: SpecCounts, sign: int) -> SpecCounts:
    width = max(len(a.accepted_per_pos), len(b.accepted_per_pos))
    per_pos = [_at(a.accepted_per_pos, i) + sign * _at(b.accepted_per_pos, i) for i in range(width)]
    if (a.drafts and not a.accepted_per_pos) or (b.drafts and not b.accepted_per_pos):
        per_pos = []  # one side could not say: the sum cannot either
    accepted = None if a.accepted is None or b.accepted is None else a.accepted + sign * b.accepted
    return SpecCounts(
        drafts=a.drafts + sign * b.drafts,
        draft_tokens=a.draft_tokens + sign * b.draft_tokens,
        accepted=accepted,
        accepted_per_pos=per_pos,
        requests=a.requests + sign * b.requests,
        completion_tokens=a.completion_tokens + sign * b.completion_tokens,
    )


def _at(values: list[int], i: int) -> int:
    return values[i] if i < len(values) else 0


def vllm_snapshot(text: str) -> SpecCounts | None:
    """vLLM's counters since it started; None when it exposes none (a server without --speculative-config)."""
    samples = parse_prometheus(text)
    drafts = counter_total(samples, VLLM_DRAFTS)
    if drafts is None:
        return None
    positions: dict[int, float] = {}
    for s in samples:
        if s.name in (f"{VLLM_ACCEPTED_PER_POS}_total", VLLM_ACCEPTED_PER_POS) and "position" in s.labels:
            index = int(s.labels["position"])
            positions[index] = positions.get(index, 0.0) + s.value
    width = max(positions) + 1 if positions else 0
    return SpecCounts(
        drafts=round(drafts),
        draft_tokens=round(counter_total(samples, VLLM_DRAFT_TOKENS) or 0),
        accepted=round(counter_total(samples, VLLM_ACCEPTED) or 0),
        accepted_per_pos=[round(positions.get(i, 0.0)) for i in range(width)],
        requests=round(counter_total(samples, VLLM_REQUESTS) or 0),
    )


def vllm_draft_length(text: str) -> int | None:
    """How many tokens the server drafts: the positions of its per-position counter (vLLM makes one series
    per position 0..num_speculative_tokens-1 at start-up)."""
    snapshot = vllm_snapshot(text)
    return len(snapshot.accepted_per_pos) if snapshot is not None else None


def sglang_counts(meta_info: Mapping[str, Any], draft_length: int) -> SpecCounts | None:
    """One SGLang answer's counts from its meta_info; None when it carries none (no speculation)."""
    if "spec_verify_ct" not in meta_info:
        return None
    steps = int(meta_info["spec_verify_ct"])
    completion = int(meta_info.get("completion_tokens") or 0)
    histogram = _first(meta_info, SGLANG_HISTOGRAM)
    accepted = _first(meta_info, SGLANG_ACCEPTED)
    if accepted is None and histogram is not None:
        accepted = sum(length * count for length, count in enumerate(histogram))
    proposed = _first(meta_info, SGLANG_PROPOSED)
    per_pos: list[int] = []
    if histogram is not None:
        # Steps that accepted more than i drafts accepted the draft at position i.
        per_pos = [int(sum(histogram[i + 1 :])) for i in range(max(draft_length, len(histogram) - 1))]
    return SpecCounts(
        drafts=steps,
        draft_tokens=int(proposed) if proposed is not None else steps * draft_length,
        accepted=int(accepted) if accepted is not None else None,
        accepted_per_pos=per_pos if steps else [],
        requests=1,
        completion_tokens=completion,
    )


def _first(meta_info: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    return next((meta_info[n] for n in names if meta_info.get(n) is not None), None)
