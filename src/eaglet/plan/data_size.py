"""How much data a run handles: conversations, tokens, trained tokens and regenerated tokens.

Counted from the dataset files when they are readable (text length / plan.chars_per_token, plus template
tokens per turn; exact token counts from the shards' manifest when this model x dataset was extracted), or
taken from plan.tokens / plan.conversations for data you do not have yet. With
regeneration on, each user turn gets a new answer as long as the original one (or max_new_tokens when
there is none), capped at max_new_tokens; it is generated after a prefill of the conversation so far.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from eaglet.config.schema import DatasetConfig, ExtractConfig, PlanConfig
from eaglet.data.conversations import Conversation, load_conversations
from eaglet.data.dataset import dataset_files
from eaglet.errors import ConfigError, EagletError


@dataclass(frozen=True)
class DataSize:
    conversations: int
    tokens: float  # tokens extracted (each conversation cut at extract.max_length)
    loss_fraction: float  # share of tokens inside the loss mask (answers)
    mean_context: float  # token-weighted mean causal context inside a sequence: Σ n(n+1)/2 / Σ n
    generated_tokens: float  # answers the target regenerates (0 with regeneration off)
    prefill_tokens: float  # prompt tokens read before each regenerated answer
    source: str


@dataclass(frozen=True)
class _Sample:
    tokens: int
    answer_tokens: int
    generated: int
    prefill: int


def _text_tokens(text: str, chars_per_token: float) -> int:
    return math.ceil(len(text) / chars_per_token)


def _sample(conv: Conversation, plan: PlanConfig, extract: ExtractConfig) -> _Sample:
    regen = extract.regenerate
    per_turn = plan.template_tokens_per_turn
    tokens = answers = generated = prefill = 0
    turns = conv.turns
    for i, turn in enumerate(turns):
        if turn.role == "assistant" and regen.enabled:
            continue  # replaced by the answer generated after the user turn before it
        length = _text_tokens(turn.content, plan.chars_per_token) + per_turn
        tokens += length
        if turn.role == "assistant":
            answers += length
        if turn.role == "user" and regen.enabled:
            following = turns[i + 1] if i + 1 < len(turns) and turns[i + 1].role == "assistant" else None
            want = (
                _text_tokens(following.content, plan.chars_per_token) if following else regen.max_new_tokens
            )
            answer = min(want, regen.max_new_tokens)
            prefill += tokens
            generated += answer
            tokens += answer + per_turn
            answers += answer + per_turn
    cut = min(tokens, extract.max_length)
    scale = cut / tokens if tokens else 0.0
    return _Sample(cut, round(answers * scale), generated, prefill)


def _read_samples(plan: PlanConfig, dataset: DatasetConfig, extract: ExtractConfig) -> list[_Sample]:
    conversations: list[Conversation] = []
    for path in dataset_files(dataset):
        part, _ = load_conversations(
            [path],
            max_records=dataset.max_records_per_file,
            require_assistant=not extract.regenerate.enabled,
        )
        conversations.extend(part)
    if extract.max_conversations is not None:
        conversations = conversations[: extract.max_conversations]
    return [_sample(conv, plan, extract) for conv in conversations]


def _extracted_totals(folder: Path) -> dict | None:
    """totals of a complete extraction in `folder`, if there is one."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        totals = manifest["totals"]
        complete = manifest["status"] == "complete" and totals["tokens"] > 0
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {**totals, "folder": str(folder)} if complete else None


def _with_extracted(estimate: DataSize, totals: dict) -> DataSize:
    """Token counts measured by extraction; the context estimate scaled to them."""
    factor = totals["tokens"] / estimate.tokens
    return replace(
        estimate,
        tokens=totals["tokens"],
        loss_fraction=totals["masked_tokens"] / totals["tokens"],
        mean_context=estimate.mean_context * factor,
        source=f"{estimate.source}; tokens and loss mask measured in {totals['folder']}/manifest.json",
    )


def estimate_data_size(
    plan: PlanConfig, dataset: DatasetConfig, extract: ExtractConfig, shards: Path
) -> DataSize:
    """The data of `dataset` as `extract` would handle it, at the size `plan` asks for; exact token counts from
    the manifest in `shards` when that folder holds a complete extraction of the same conversations."""
    try:
        samples = _read_samples(plan, dataset, extract)
        unreadable = None
    except EagletError as exc:
        samples, unreadable = [], str(exc)
    if samples:
        n = len(samples)
        tokens = sum(s.tokens for s in samples)
        measured = DataSize(
            conversations=n,
            tokens=tokens,
            loss_fraction=sum(s.answer_tokens for s in samples) / tokens,
            mean_context=sum(s.tokens * (s.tokens + 1) / 2 for s in samples) / tokens,
            generated_tokens=sum(s.generated for s in samples),
            prefill_tokens=sum(s.prefill for s in samples),
            source=f"dataset '{dataset.name}': {n:,} conversations read, text / {plan.chars_per_token:g} chars per token",
        )
        totals = _extracted_totals(shards)
        if totals and totals.get("sequences") == n:
            measured = _with_extracted(measured, totals)
        return _scaled(measured, plan.tokens, plan.conversations, plan.tokens_per_conversation)
    return _assumed(plan, extract, unreadable or "no conversations")


def _scaled(
    measured: DataSize, tokens: int | None, conversations: int | None, per_conversation: float | None
) -> DataSize:
    """The dataset's shape (loss fraction, context, regenerated share) at the size the plan asks for."""
    mean = measured.tokens / measured.conversations
    if per_conversation is not None:
        mean = per_conversation
    if tokens is None and conversations is None and per_conversation is None:
        return measured
    if tokens is None:
        conversations = conversations or measured.conversations
        tokens = conversations * mean
        how = f"plan.conversations={conversations:,} × {mean:,.0f} tokens each"
    else:
        conversations = conversations or max(round(tokens / mean), 1)
        how = f"plan.tokens={tokens:,}"
    factor = tokens / measured.tokens
    return DataSize(
        conversations=conversations,
        tokens=tokens,
        loss_fraction=measured.loss_fraction,
        mean_context=measured.mean_context,
        generated_tokens=measured.generated_tokens * factor,
        prefill_tokens=measured.prefill_tokens * factor,
        source=f"{how}; shape from {measured.source}",
    )


def _assumed(plan: PlanConfig, extract: ExtractConfig, why: str) -> DataSize:
    """No readable dataset: sizes from plan.* alone, the unknowns at their conservative end."""
    per_conversation = plan.tokens_per_conversation
    if plan.tokens is None and (plan.conversations is None or per_conversation is None):
        raise ConfigError(
            f"cannot size the data ({why}); give plan.tokens=N, or plan.conversations=N with "
            "plan.tokens_per_conversation=M"
        )
    if per_conversation is None:
        per_conversation = plan.tokens / plan.conversations if plan.conversations else extract.max_length
    tokens = plan.tokens if plan.tokens is not None else plan.conversations * per_conversation
    conversations = plan.conversations or max(round(tokens / per_conversation), 1)
    length = min(per_conversation, extract.max_length)
    # Unknown split: every token trained, and with regeneration on every trained token generated.
    generated = tokens if extract.regenerate.enabled else 0.0
    return DataSize(
        conversations=conversations,
        tokens=tokens,
        loss_fraction=1.0,
        mean_context=(length + 1) / 2,
        generated_tokens=generated,
        prefill_tokens=0.0,
        source=(
            f"plan overrides only ({why}): {per_conversation:,.0f} tokens per conversation, all of them "
            "trained" + (" and regenerated" if generated else "")
        ),
    )
