"""Follow-up turns: the target writes the next user message of a self-prompted conversation it has answered.

The chat template renders the conversation so far (the category's system prompt that steered the first prompt,
then the user and assistant turns) up to where the next user message's text starts, and the target continues
with that message, as it wrote the first one (eaglet.data.self_prompt). Rounds alternate with answering: a round
writes one user turn for each conversation whose last turn is answered, then the target answers them
(regeneration goes on from the answers on disk, so earlier answers are neither generated again nor changed).

What the target wrote is appended to a JSONL beside the prompts (fsynced per round), keyed by conversation, turn
and a hash of the history it followed, so a killed run resumes, a later run reuses it, and a changed earlier
answer is followed up anew. Records hold the raw text: the filters run again on reading (a new evaluation set
holds out a follow-up written before it). Unlike first prompts, follow-ups are not deduplicated: "Can you give an
example?" is a fine follow-up to many different answers.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eaglet.config.schema import SelfPromptConfig
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.holdout import normalise_prompt
from eaglet.data.self_prompt import next_user_turn_prefix, next_user_turn_prefixes, prompt_category
from eaglet.fsutil import append_jsonl, read_appended_jsonl
from eaglet.generation import decode_batch

# Answers a list of conversations (prompt turns only) with the target: same ids and order, the answered copies.
Answer = Callable[[list[Conversation]], list[Conversation]]


@dataclass
class FollowUpStats:
    # Follow-up turns in the data: written and answered (from earlier runs included).
    written: int = 0
    # Follow-ups read back from earlier runs, dropped ones included.
    resumed: int = 0
    # Follow-ups the target wrote in this run, dropped ones included.
    generated: int = 0
    tokens: int = 0
    # Why follow-ups were dropped (that conversation stays shorter).
    unfinished: int = 0
    too_short: int = 0
    held_out: int = 0
    no_room: int = 0  # the conversation so far leaves no room in extract.max_length to write one
    unanswered: int = 0  # written, but regeneration found no room in extract.max_length for its answer
    seconds: float = 0.0
    # Self-prompted conversations by their number of user turns, in the end.
    user_turns: Counter[int] = field(default_factory=Counter)


def add_follow_ups(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: SelfPromptConfig,
    conversations: Sequence[Conversation],
    *,
    answer: Answer,
    template: str,
    out_path: Path,
    seed: int,
    max_length: int,
    held_out: set[str],
    engine: str = "auto",
    compile: bool = True,
    overlap_prefill: bool = False,
    prefill_graphs: bool = False,
    packed_prefill: bool | None = None,
) -> tuple[list[Conversation], FollowUpStats]:
    """`conversations` (self-prompted, answered; ids sp-<n>) with up to `cfg.follow_up_turns` more user turns
    that `model` wrote, each answered through `answer`; same ids and order. `held_out` holds normalised prompts
    a follow-up must not be."""
    names = sorted(cfg.categories)
    _, end = next_user_turn_prefix(tokenizer, template, [])
    stops = {int(tokenizer.eos_token_id)} | ({end} if end is not None else set())
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    stats = FollowUpStats()
    recorded = _read(out_path)
    current = {c.id: c for c in conversations}
    chosen = [c.id for c in conversations if _chosen(seed, c.id, cfg.follow_up_fraction)]
    start = time.perf_counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "ab") as sink:
        for turn in range(2, 2 + cfg.follow_up_turns):
            waiting = [current[i] for i in chosen if _awaits_turn(current[i], turn)]
            contexts = {c.id: _context(c, cfg.categories[prompt_category(c.id, names)]) for c in waiting}
            prompts = {}  # the conversations with room for a follow-up: what the target continues
            rendered = next_user_turn_prefixes(tokenizer, template, [contexts[c.id] for c in waiting])
            for conv, ids in zip(waiting, rendered, strict=True):
                if len(ids) + cfg.max_prompt_tokens > max_length:
                    stats.no_room += 1
                else:
                    prompts[conv.id] = ids
            missing = {i: ids for i, ids in prompts.items() if _key(i, turn, contexts[i]) not in recorded}
            stats.resumed += len(prompts) - len(missing)
            if missing:
                outputs = decode_batch(
                    model, list(missing.values()), max_new_tokens=cfg.max_prompt_tokens, stop_ids=stops,
                    pad_id=pad_id, temperature=cfg.temperature, top_p=cfg.top_p,
                    seeds=[_seed(seed, conv_id, turn) for conv_id in missing], max_rows=cfg.batch_size,
                    engine=engine, compile=compile, overlap_prefill=overlap_prefill,
                    prefill_graphs=prefill_graphs, packed_prefill=packed_prefill,
                )  # fmt: skip
                fresh = [
                    _record(conv_id, turn, contexts[conv_id], tokens, tokenizer, cfg)
                    for conv_id, tokens in zip(missing, outputs, strict=True)
                ]
                stats.generated += len(fresh)
                stats.tokens += sum(len(tokens) for tokens in outputs)
                recorded.update((_key(r["id"], turn, contexts[r["id"]]), r) for r in fresh)
                append_jsonl(sink, fresh)
            extended = []
            for conv_id in prompts:
                record = recorded[_key(conv_id, turn, contexts[conv_id])]
                reason = _drop_reason(record, cfg, held_out)
                if reason:
                    setattr(stats, reason, getattr(stats, reason) + 1)
                    continue
                conv = current[conv_id]
                prompts_so_far = tuple(t for t in conv.turns if t.role != "assistant")
                extended.append(
                    Conversation(
                        conv.id, (*prompts_so_far, Turn("user", record["text"])), conv.source, conv.line
                    )
                )
            if not extended:
                break
            for conv in answer(extended):
                if _user_turns(conv) == turn:
                    stats.written += 1
                else:
                    stats.unanswered += 1
                current[conv.id] = conv
    stats.seconds = time.perf_counter() - start
    final = [current[c.id] for c in conversations]
    stats.user_turns = Counter(_user_turns(c) for c in final)
    return final, stats


def follow_up_report(stats: FollowUpStats) -> dict[str, Any]:
    """The follow-up part of the self-prompting report (eaglet.data.self_prompt.self_prompt_report)."""
    return {
        "written": stats.written,
        "resumed": stats.resumed,
        "generated": stats.generated,
        "dropped": {
            "unfinished": stats.unfinished,
            "too_short": stats.too_short,
            "held_out": stats.held_out,
            "no_room": stats.no_room,
            "unanswered": stats.unanswered,
        },
        "seconds": round(stats.seconds, 1),
        "user_turns": {str(turns): n for turns, n in sorted(stats.user_turns.items())},
    }


def _awaits_turn(conv: Conversation, turn: int) -> bool:
    """Whether `conv` has its first `turn` - 1 user turns answered and nothing after: it may get user turn `turn`."""
    return _user_turns(conv) == turn - 1 and conv.turns[-1].role == "assistant"


def _context(conv: Conversation, system: str | None) -> list[Turn]:
    """What the target sees when it writes the next user turn: the system prompt that steered the first one."""
    return ([Turn("system", system)] if system else []) + list(conv.turns)


def _user_turns(conv: Conversation) -> int:
    return sum(t.role == "user" for t in conv.turns)


def _chosen(seed: int, conv_id: str, fraction: float) -> bool:
    """Whether the conversation gets follow-ups: a fixed draw per (seed, id), so a larger share is a superset."""
    digest = hashlib.sha256(f"follow-up-share\0{seed}\0{conv_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") < fraction * 2**32


def _seed(seed: int, conv_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"follow-up\0{seed}\0{conv_id}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _history_hash(context: Sequence[Turn]) -> str:
    turns = [[t.role, t.content] for t in context]
    return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def _key(conv_id: str, turn: int, context: Sequence[Turn]) -> tuple[str, int, str]:
    return conv_id, turn, _history_hash(context)


def _record(
    conv_id: str, turn: int, context: Sequence[Turn], tokens: list[int], tokenizer: Any, cfg: SelfPromptConfig
) -> dict[str, Any]:
    return {
        "id": conv_id,
        "turn": turn,
        "history": _history_hash(context),
        "text": tokenizer.decode(tokens, skip_special_tokens=True).strip(),
        "finished": len(tokens) < cfg.max_prompt_tokens,  # else cut at the token budget
    }


def _drop_reason(record: Mapping[str, Any], cfg: SelfPromptConfig, held_out: set[str]) -> str | None:
    """Why a written follow-up is dropped (a FollowUpStats field), or None to keep it."""
    if not record["finished"]:
        return "unfinished"
    if len(record["text"]) < cfg.min_chars:
        return "too_short"
    if normalise_prompt(record["text"]) in held_out:
        return "held_out"
    return None


def _read(path: Path) -> dict[tuple[str, int, str], dict[str, Any]]:
    """The follow-ups earlier runs wrote; a last line cut by a kill is dropped (and overwritten by the next append)."""
    return {(r["id"], r["turn"], r["history"]): r for r in read_appended_jsonl(path)}
