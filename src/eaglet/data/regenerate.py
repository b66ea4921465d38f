"""Replace assistant turns by the target's own answers (the largest single lever on acceptance).

Turn by turn: for a multi-turn conversation, the answer to user turn r is generated from the
conversation so far, including the target's own earlier answers. Conversations are processed in
length-sorted batches; each finished batch is appended to a JSONL file in the shared schema and
fsynced, so a killed run resumes without re-generating what is on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.templating import build_prompt_ids
from eaglet.errors import DataError
from eaglet.generation import decode_batch


@dataclass
class RegenerateStats:
    conversations: int = 0
    resumed: int = 0
    generated_turns: int = 0
    generated_tokens: int = 0
    # Conversations cut short because the prompt outgrew the context budget.
    cut_for_length: int = 0
    seconds: float = 0.0


def regenerate_conversations(
    model: torch.nn.Module,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    *,
    cfg: RegenerateConfig,
    out_path: Path,
    max_length: int,
    chat_template: str | None = None,
) -> tuple[list[Conversation], RegenerateStats]:
    """Regenerated copies of `conversations` (same ids and order), resuming from `out_path`."""
    stats = RegenerateStats(conversations=len(conversations))
    done = _read_finished(out_path, {c.id: prompt_hash(c) for c in conversations})
    stats.resumed = len(done)
    pending = [c for c in conversations if c.id not in done]
    # Length-sorted batches waste little padding; the order is deterministic.
    pending.sort(key=lambda c: (len(c.turns[0].content), c.id))
    device = next(model.parameters()).device
    start = time.perf_counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(out_path, "ab") as sink,
        tqdm(total=len(conversations), initial=len(done), desc="regenerate", unit="conv") as bar,
    ):
        for first in range(0, len(pending), cfg.batch_size):
            batch = pending[first : first + cfg.batch_size]
            # Seeded per batch: a resumed run samples the same answers as an uninterrupted one.
            generator = torch.Generator(device).manual_seed(cfg.seed + first) if cfg.temperature > 0 else None
            finished = _regenerate_batch(
                model,
                tokenizer,
                batch,
                cfg=cfg,
                generator=generator,
                max_length=max_length,
                chat_template=chat_template,
                stats=stats,
            )
            for source, conv in zip(batch, finished, strict=True):
                record = {**conv.to_json(), "prompt_hash": prompt_hash(source)}
                sink.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
                done[conv.id] = conv
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(len(batch))
            elapsed = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{stats.generated_tokens / max(elapsed, 1e-9):.0f}")
    stats.seconds = time.perf_counter() - start
    return [done[c.id] for c in conversations], stats


def _regenerate_batch(
    model: torch.nn.Module,
    tokenizer: Any,
    batch: list[Conversation],
    *,
    cfg: RegenerateConfig,
    generator: torch.Generator | None,
    max_length: int,
    chat_template: str | None,
    stats: RegenerateStats,
) -> list[Conversation]:
    """Generate every assistant turn of `batch`, one user turn at a time across the batch."""
    prompts = [_user_turn_groups(c) for c in batch]
    history: list[list[Turn]] = [[] for _ in batch]
    alive = [True] * len(batch)
    rounds = max(len(p) for p in prompts)
    for r in range(rounds):
        active, prompt_ids = [], []
        for i, groups in enumerate(prompts):
            if not alive[i] or r >= len(groups):
                continue
            turns = history[i] + groups[r]
            ids = build_prompt_ids(tokenizer, turns, chat_template=chat_template)
            if len(ids) + cfg.max_new_tokens > max_length:
                alive[i] = False
                stats.cut_for_length += 1
                continue
            history[i] = turns
            active.append(i)
            prompt_ids.append(ids)
        if not active:
            break
        for i, reply in zip(active, _generate(model, tokenizer, prompt_ids, cfg, generator), strict=True):
            history[i].append(Turn("assistant", reply[0]))
            stats.generated_turns += 1
            stats.generated_tokens += reply[1]
    out = []
    for conv, turns in zip(batch, history, strict=True):
        # A conversation whose first prompt alone is too long keeps no turns; it is dropped later
        # (no assistant tokens) and counted there.
        out.append(Conversation(id=conv.id, turns=tuple(turns), source=conv.source, line=conv.line))
    return out


def _user_turn_groups(conv: Conversation) -> list[list[Turn]]:
    """The non-assistant turns between assistant turns: each group ends with the user turn to answer."""
    groups: list[list[Turn]] = []
    current: list[Turn] = []
    for turn in conv.turns:
        if turn.role == "assistant":
            continue
        current.append(turn)
        if turn.role == "user":
            groups.append(current)
            current = []
    return groups


def _generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    cfg: RegenerateConfig,
    generator: torch.Generator | None,
) -> list[tuple[str, int]]:
    """(reply text, generated token count) per prompt."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    outputs = decode_batch(
        model,
        prompt_ids,
        max_new_tokens=cfg.max_new_tokens,
        stop_ids={tokenizer.eos_token_id},
        pad_id=pad_id,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        generator=generator,
    )
    return [(tokenizer.decode(ids, skip_special_tokens=True).strip(), len(ids)) for ids in outputs]


def prompt_hash(conv: Conversation) -> str:
    """Hash of the turns the target answers: an edited prompt file is regenerated, not silently reused."""
    prompts = [[t.role, t.content] for t in conv.turns if t.role != "assistant"]
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def _read_finished(path: Path, wanted: dict[str, str]) -> dict[str, Conversation]:
    """Conversations already regenerated in `path` whose prompts still match `wanted` (id -> prompt hash).

    A torn last line from a killed run is cut off.
    """
    done: dict[str, Conversation] = {}
    if not path.exists():
        return done
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as fh:
            fh.truncate(len(complete))
    for number, raw in enumerate(complete.splitlines(), start=1):
        try:
            record = json.loads(raw)
            conv_id = record["id"]
            turns = tuple(Turn(t["role"], t["content"]) for t in record["conversations"])
            recorded_hash = record["prompt_hash"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataError(
                f"{path}:{number}: unreadable regenerated conversation ({exc}); delete the file to regenerate "
                "from scratch"
            ) from exc
        if wanted.get(conv_id) == recorded_hash:
            done[conv_id] = Conversation(id=conv_id, turns=turns, source=str(path), line=number)
    return done
