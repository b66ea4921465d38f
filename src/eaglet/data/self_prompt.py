"""Self-prompting: the target writes the user prompts it is then asked to answer.

Given its chat template rendered up to the start of a user turn (after a category's system prompt), an
instruction model continues with a user message of the kind it was trained to answer (the "Magpie" method,
arXiv 2406.08464). With `examples`, a few people's prompts (the dataset's, or those of `example_paths`) come
first as earlier turns, each answered by a fixed reply and drawn afresh for each prompt: the target then writes
requests like people's, whose answers a head trained on its own kind of prompts predicts less well. Prompts are
generated in rounds through eaglet.generation (the engine on GPUs), cleaned, held out against every evaluation
set, deduplicated exactly and approximately (eaglet.data.near_duplicates), and appended to a JSONL file in the
shared schema (fsynced per round), so a killed run resumes and a later run with the same settings reuses them; a
run asking for more prompts extends the file.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet.config.schema import SelfPromptConfig
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.holdout import normalise_prompt
from eaglet.data.near_duplicates import NearDuplicates
from eaglet.data.templating import ChatTemplateError, resolve_chat_template
from eaglet.errors import ConfigError
from eaglet.fsutil import append_jsonl, read_appended_jsonl
from eaglet.generation import decode_batch

# Stands for the user message while the template is rendered; the prefix before it is what the target continues.
_SENTINEL = "\u2063EAGLET-USER-MESSAGE\u2063"
# Rounds that add no new prompt before giving up (the target keeps repeating itself at these settings).
_FRUITLESS_ROUNDS = 3
# Longer user prompts (a pasted text, a whole program) are not drawn as examples: each would fill the context
# ahead of the prompt being written.
_EXAMPLE_MAX_CHARS = 400


@dataclass
class SelfPromptStats:
    kept: int = 0
    resumed: int = 0
    generated: int = 0
    tokens: int = 0  # new tokens the target wrote, dropped prompts included
    # Why generated prompts were dropped.
    unfinished: int = 0
    too_short: int = 0
    duplicates: int = 0
    near_duplicates: int = 0
    held_out: int = 0
    seconds: float = 0.0
    categories: Counter[str] | None = None


def user_turn_prefix(tokenizer: Any, template: str, system: str | None) -> tuple[list[int], int | None]:
    """Token ids of the template up to where a user message's text starts (after `system`, if any), and the
    id of the special token that ends a user message in this template (None when it is not a single token)."""
    return next_user_turn_prefix(tokenizer, template, [Turn("system", system)] if system else [])


def next_user_turn_prefix(
    tokenizer: Any, template: str, history: Sequence[Turn]
) -> tuple[list[int], int | None]:
    """Token ids of the template rendering `history` (system, user and assistant turns) up to where the next
    user message's text starts, and the id of the special token that ends a user message (None when it is not
    a single token)."""
    before, after = _around_user_text(tokenizer, template, history)
    ids = tokenizer(before, add_special_tokens=False)["input_ids"]
    following = tokenizer(after, add_special_tokens=False)["input_ids"]
    end = following[0] if following and following[0] in tokenizer.all_special_ids else None
    return [int(i) for i in ids], end


def next_user_turn_prefixes(
    tokenizer: Any, template: str, histories: Sequence[Sequence[Turn]]
) -> list[list[int]]:
    """next_user_turn_prefix's token ids for each of `histories`, tokenized in one call (a round's prefixes:
    tokenizing them one by one cost more than rendering them)."""
    if not histories:
        return []
    befores = [_around_user_text(tokenizer, template, history)[0] for history in histories]
    return [[int(i) for i in ids] for ids in tokenizer(befores, add_special_tokens=False)["input_ids"]]


def _around_user_text(tokenizer: Any, template: str, history: Sequence[Turn]) -> tuple[str, str]:
    """The template's text rendering `history` and then a user message: (before, after) the message's text."""
    turns = [{"role": t.role, "content": t.content} for t in history] + [
        {"role": "user", "content": _SENTINEL}
    ]
    text = tokenizer.apply_chat_template(
        turns, tokenize=False, chat_template=template, add_generation_prompt=False
    )
    if text.count(_SENTINEL) != 1:
        raise ChatTemplateError(
            "self-prompting: the chat template does not render a user message verbatim, so the start of a user "
            "turn cannot be found; pass a template that does with model.chat_template='...'"
        )
    before, after = text.split(_SENTINEL)
    return before, after


def example_pool(user_prompts: Sequence[str]) -> list[str]:
    """The prompts examples are drawn from: distinct, at most _EXAMPLE_MAX_CHARS characters, in the given order."""
    return list(dict.fromkeys(p.strip() for p in user_prompts if 0 < len(p.strip()) <= _EXAMPLE_MAX_CHARS))


def settings_key(cfg: SelfPromptConfig, identity: Mapping[str, Any], pool: Sequence[str] = ()) -> str:
    """Everything that changes which prompts come out, except how many are asked for (more extends the file);
    `pool`: the prompts examples are drawn from (with cfg.examples)."""
    settings = {
        **identity,
        "categories": dict(cfg.categories),
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "min_chars": cfg.min_chars,
        "near_duplicate_jaccard": cfg.near_duplicate_jaccard,
        "rows": cfg.batch_size,
    }
    if cfg.examples:
        drawn_from = hashlib.sha256("\0".join(pool).encode()).hexdigest()[:12]
        settings |= {"examples": cfg.examples, "example_reply": cfg.example_reply, "example_pool": drawn_from}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def self_prompt(
    model: torch.nn.Module,
    tokenizer: Any,
    cfg: SelfPromptConfig,
    *,
    template: str | None,
    out_path: Path,
    seed: int,
    held_out: set[str],
    existing: set[str] = frozenset(),
    examples_from: Sequence[str] = (),
    engine: str = "auto",
    compile: bool = True,
    overlap_prefill: bool = False,
    prefill_graphs: bool = False,
    packed_prefill: bool | None = None,
) -> tuple[list[Conversation], SelfPromptStats]:
    """`cfg.num_prompts` distinct user prompts written by `model`, as one-turn conversations (ids sp-<n>),
    resumed from and appended to `out_path`. `held_out` and `existing` hold normalised prompts to avoid;
    `examples_from`: the example_pool the cfg.examples earlier turns are drawn from."""
    if not cfg.categories:
        raise ConfigError("extract.self_prompt.categories is empty: give at least one name: system prompt")
    if cfg.examples and len(examples_from) < cfg.examples:
        raise ConfigError(
            f"extract.self_prompt.examples={cfg.examples} draws that many user prompts of at most "
            f"{_EXAMPLE_MAX_CHARS} characters (the dataset's, or extract.self_prompt.example_paths') before each "
            f"prompt, but there are {len(examples_from)}; lower extract.self_prompt.examples or give more prompts"
        )
    template = resolve_chat_template(tokenizer, template)
    names = sorted(cfg.categories)
    prefixes, stops = {}, {int(tokenizer.eos_token_id)}
    for name in names:
        prefixes[name], end = user_turn_prefix(tokenizer, template, cfg.categories[name])
        if end is not None:
            stops.add(end)
    pool = list(examples_from)

    def round_prefixes(attempts: range) -> list[list[int]]:
        """The template up to the user text for each attempt: its category's, after its own drawn examples."""
        if not cfg.examples:
            return [prefixes[names[a % len(names)]] for a in attempts]
        histories = []
        for attempt in attempts:
            system = cfg.categories[names[attempt % len(names)]]
            history = [Turn("system", system)] if system else []
            for text in random.Random(_seed(seed, attempt)).sample(pool, cfg.examples):
                history += [Turn("user", text), Turn("assistant", cfg.example_reply)]
            histories.append(history)
        return next_user_turn_prefixes(tokenizer, template, histories)

    stats = SelfPromptStats(categories=Counter())
    filter_ = NearDuplicates(cfg.near_duplicate_jaccard)
    for text in existing:
        filter_.add(text)
    for text in examples_from if cfg.examples else ():  # a prompt that copies an example is no new prompt
        filter_.add(normalise_prompt(text))
    kept = _read(out_path)
    for conv in kept:
        filter_.add(normalise_prompt(conv.turns[0].content))
        stats.categories[prompt_category(conv.id, names)] += 1
    stats.resumed = len(kept)
    start = time.perf_counter()
    attempt = _next_attempt(kept)
    fruitless = 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "ab") as sink:
        while len(kept) < cfg.num_prompts and fruitless < _FRUITLESS_ROUNDS:
            # A little more than is missing: some of every round is dropped.
            count = max(cfg.batch_size, int((cfg.num_prompts - len(kept)) * 1.25))
            attempts = range(attempt, attempt + count)
            attempt += count
            prompts = round_prefixes(attempts)
            outputs = decode_batch(
                model, prompts, max_new_tokens=cfg.max_prompt_tokens, stop_ids=stops,
                pad_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id),
                temperature=cfg.temperature, top_p=cfg.top_p, seeds=[_seed(seed, a) for a in attempts],
                max_rows=cfg.batch_size, engine=engine, compile=compile, overlap_prefill=overlap_prefill,
                prefill_graphs=prefill_graphs, packed_prefill=packed_prefill,
            )  # fmt: skip
            fresh = []
            for a, tokens in zip(attempts, outputs, strict=True):
                stats.generated += 1
                stats.tokens += len(tokens)
                text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                reason = _drop_reason(text, tokens, cfg, stops, held_out, filter_)
                if reason:
                    setattr(stats, reason, getattr(stats, reason) + 1)
                    continue
                conv = Conversation(id=f"sp-{a}", turns=(Turn("user", text),), source=str(out_path), line=0)
                fresh.append(conv)
                stats.categories[names[a % len(names)]] += 1
                if len(kept) + len(fresh) == cfg.num_prompts:
                    break
            _append(sink, fresh, names)
            kept.extend(fresh)
            fruitless = 0 if fresh else fruitless + 1
    stats.kept = len(kept)
    stats.seconds = time.perf_counter() - start
    return kept[: cfg.num_prompts], stats


def _drop_reason(
    text: str,
    tokens: list[int],
    cfg: SelfPromptConfig,
    stops: set[int],
    held_out: set[str],
    seen: NearDuplicates,
) -> str | None:
    """Why a generated prompt is dropped (a SelfPromptStats field), or None to keep it (then it is recorded)."""
    if len(tokens) >= cfg.max_prompt_tokens:
        return "unfinished"  # cut at the token budget: no end of turn came
    if len(text) < cfg.min_chars:
        return "too_short"
    normal = normalise_prompt(text)
    if normal in held_out:
        return "held_out"
    verdict = seen.check(normal)
    if verdict == "exact":
        return "duplicates"
    if verdict == "near":
        return "near_duplicates"
    seen.add(normal)
    return None


def _seed(seed: int, attempt: int) -> int:
    digest = hashlib.sha256(f"self-prompt\0{seed}\0{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def prompt_category(conv_id: str, names: list[str]) -> str:
    """The category whose system prompt preceded the prompt of self-prompted conversation `conv_id`."""
    return names[int(conv_id.removeprefix("sp-")) % len(names)]


def _append(sink: Any, conversations: list[Conversation], names: list[str]) -> None:
    """Append records and fsync: once this returns they survive a kill (a partial last line is cut on reading)."""
    append_jsonl(
        sink,
        [
            {
                "id": c.id,
                "category": prompt_category(c.id, names),
                "conversations": [{"role": "user", "content": c.turns[0].content}],
            }
            for c in conversations
        ],
    )


def _read(path: Path) -> list[Conversation]:
    """The prompts a previous run kept; a last line cut by a kill is dropped (and overwritten by the next append)."""
    return [
        Conversation(
            id=record["id"],
            turns=(Turn("user", record["conversations"][0]["content"]),),
            source=str(path),
            line=number,
        )
        for number, record in enumerate(read_appended_jsonl(path), 1)
    ]


def _next_attempt(kept: list[Conversation]) -> int:
    """Attempts are numbered across runs (each number its own seed): go on after the last kept one."""
    return max((int(c.id.removeprefix("sp-")) for c in kept), default=-1) + 1


def self_prompt_report(
    stats: SelfPromptStats,
    prompts: list[Conversation],
    samples: int = 5,
    follow_ups: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a self-prompting run kept and dropped, prompts per category, and a few prompts to read; with
    `follow_ups` (eaglet.data.follow_ups.follow_up_report), the follow-up turns written and dropped."""
    step = max(1, len(prompts) // samples)
    return {
        "kept": stats.kept,
        "resumed": stats.resumed,
        "generated": stats.generated,
        "dropped": {
            "unfinished": stats.unfinished,
            "too_short": stats.too_short,
            "duplicates": stats.duplicates,
            "near_duplicates": stats.near_duplicates,
            "held_out": stats.held_out,
        },
        "seconds": round(stats.seconds, 1),
        "categories": dict(sorted((stats.categories or Counter()).items())),
        "samples": [c.turns[0].content for c in prompts[::step][:samples]],
        **({"follow_ups": dict(follow_ups)} if follow_ups is not None else {}),
    }


def format_self_prompt_report(report: Mapping[str, Any]) -> str:
    dropped = ", ".join(f"{n:,} {why.replace('_', ' ')}" for why, n in report["dropped"].items())
    lines = [
        f"self-prompting: {report['kept']:,} prompts kept ({report['resumed']:,} from earlier runs), "
        f"{report['generated']:,} generated in {report['seconds']} s; dropped: {dropped}",
        "prompts per category: " + ", ".join(f"{k} {v:,}" for k, v in report["categories"].items()),
    ]
    lines += [f"  e.g. {text[:160]!r}" for text in report["samples"]]
    follow_ups = report.get("follow_ups")
    if follow_ups is not None:
        dropped = ", ".join(f"{n:,} {why.replace('_', ' ')}" for why, n in follow_ups["dropped"].items())
        lines.append(
            f"follow-up turns: {follow_ups['written']:,} written ({follow_ups['resumed']:,} from earlier runs), "
            f"{follow_ups['generated']:,} generated in {follow_ups['seconds']} s; dropped: {dropped}"
        )
        lines.append(
            "conversations by user turns: "
            + ", ".join(f"{turns}: {n:,}" for turns, n in follow_ups["user_turns"].items())
        )
    return "\n".join(lines)
