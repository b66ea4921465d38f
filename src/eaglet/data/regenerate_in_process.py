"""In-process regeneration with transformers: continuous batching over (conversation, user turn) requests.

When a row's answer is done, the row takes its conversation's next turn or a new conversation
(eaglet.generation.continuous). Finished conversations are appended to the regenerated JSONL
(eaglet.data.regenerated) and fsynced, so a killed run resumes without re-generating what is on disk.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from tqdm.auto import tqdm

from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.regenerate_stats import RegenerateStats
from eaglet.data.regenerated import (
    answered_prefixes,
    append_finished,
    kept_turns,
    prompt_hash,
    read_finished,
    user_turn_groups,
)
from eaglet.data.templating import build_prompt_ids
from eaglet.errors import ConfigError
from eaglet.generation import DecodeSettings, Request, decode_continuous


def regenerate_in_process(
    model: torch.nn.Module,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    *,
    cfg: RegenerateConfig,
    seed: int,
    out_path: Path,
    max_length: int,
    chat_template: str | None,
) -> tuple[list[Conversation], RegenerateStats]:
    """Regenerated copies of `conversations` (same ids and order) from `model`, resuming from `out_path`;
    sampled answers are seeded per turn from `seed`."""
    for key in ("batch_size", "refill_every"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"extract.regenerate.{key} must be at least 1, got {getattr(cfg, key)}")
    stats = RegenerateStats(conversations=len(conversations))
    done = read_finished(out_path, {c.id: prompt_hash(c) for c in conversations})
    stats.resumed = len(done)
    pending = [c for c in conversations if c.id not in done]
    prefixes = answered_prefixes(out_path, pending)
    stats.reused_turns = sum(_answers(turns) for turns in prefixes.values())
    # Conversations with more user turns to answer start first: their answers come one after another, so a long
    # one started late would decode alone at the end. Then similar lengths together (little padding). The order,
    # and so the schedule, is deterministic.
    pending.sort(
        key=lambda c: (
            _answers(prefixes.get(c.id, ())) - len(user_turn_groups(c)),
            len(c.turns[0].content),
            c.id,
        )
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = DecodeSettings(
        max_new_tokens=cfg.max_new_tokens,
        stop_ids=frozenset({tokenizer.eos_token_id}),
        pad_id=pad_id,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_rows=cfg.batch_size,
        refill_every=cfg.refill_every,
        engine=str(cfg.engine),
        max_context=max_length,
        compile=cfg.compile,
        overlap_prefill=cfg.overlap_prefill,
        prefill_graphs=cfg.prefill_graphs,
        packed_prefill=cfg.packed_prefill,
    )
    start = time.perf_counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(out_path, "ab") as sink,
        tqdm(total=len(conversations), initial=len(done), desc="regenerate", unit="conv") as bar,
    ):

        def written(finished: list[Conversation]) -> None:
            done.update((conv.id, conv) for conv in finished)
            bar.update(len(finished))
            bar.set_postfix(tok_s=f"{stats.generated_tokens / max(time.perf_counter() - start, 1e-9):.0f}")

        turns = _TurnQueue(
            pending,
            tokenizer,
            cfg=cfg,
            seed=seed,
            max_length=max_length,
            chat_template=chat_template,
            stats=stats,
            sink=sink,
            on_written=written,
            prefixes=prefixes,
        )
        stats.rows = decode_continuous(model, turns, settings)
        turns.flush()
    stats.seconds = time.perf_counter() - start
    return [done[c.id] for c in conversations], stats


@dataclass(eq=False)
class _Dialogue:
    """A conversation being regenerated: its prompt groups, and the turns so far with the target's answers."""

    source: Conversation
    groups: list[list[Turn]]
    history: list[Turn] = field(default_factory=list)
    answered: int = 0


class _TurnQueue:
    """The work source of regeneration: one request per (conversation, user turn).

    A conversation's next turn is ready once its previous answer is in; ready turns go before new
    conversations, so few conversations are open at a time. Finished conversations are appended to the
    output file at each refill of the batch (one fsync per refill, not per conversation).
    """

    def __init__(
        self,
        pending: list[Conversation],
        tokenizer: Any,
        *,
        cfg: RegenerateConfig,
        seed: int,
        max_length: int,
        chat_template: str | None,
        stats: RegenerateStats,
        sink: BinaryIO,
        on_written: Callable[[list[Conversation]], None],
        prefixes: dict[str, list[Turn]],
    ) -> None:
        self.unstarted = iter(pending)
        self.prefixes = prefixes
        self.tokenizer, self.cfg, self.seed, self.max_length = tokenizer, cfg, seed, max_length
        self.chat_template, self.stats = chat_template, stats
        self.sink, self.on_written = sink, on_written
        self.ready: deque[Request] = deque()
        self.unwritten: list[tuple[Conversation, Conversation]] = []

    def take(self, limit: int) -> list[Request]:
        self.flush()
        taken: list[Request] = []
        while len(taken) < limit and self.ready:
            taken.append(self.ready.popleft())
        while len(taken) < limit and (conv := next(self.unstarted, None)) is not None:
            answered = self.prefixes.get(conv.id, [])
            dialogue = _Dialogue(conv, user_turn_groups(conv), list(answered), _answers(answered))
            request = self._next_turn(dialogue)
            if request is not None:
                taken.append(request)
        return taken

    def finish(self, request: Request, tokens: list[int]) -> None:
        dialogue: _Dialogue = request.tag
        reply = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        dialogue.history.append(Turn("assistant", reply))
        self.stats.generated_turns += 1
        self.stats.generated_tokens += len(tokens)
        follow_up = self._next_turn(dialogue)
        if follow_up is not None:
            self.ready.append(follow_up)

    def flush(self) -> None:
        """Append the finished conversations to the output file (fsynced)."""
        if self.unwritten:
            append_finished(self.sink, self.unwritten)
            self.on_written([regenerated for _, regenerated in self.unwritten])
            self.unwritten = []

    def _next_turn(self, dialogue: _Dialogue) -> Request | None:
        """The request answering the dialogue's next user turn, or None when it is complete."""
        if dialogue.answered < len(dialogue.groups):
            turns = dialogue.history + dialogue.groups[dialogue.answered]
            ids = build_prompt_ids(self.tokenizer, turns, chat_template=self.chat_template)
            if len(ids) + self.cfg.max_new_tokens <= self.max_length:
                dialogue.history = turns
                dialogue.answered += 1
                seed = _turn_seed(self.seed, dialogue.source.id, dialogue.answered)
                return Request(ids, seed=seed, tag=dialogue)
            self.stats.cut_for_length += 1
        source = dialogue.source
        turns = kept_turns(dialogue.history, dialogue.groups)
        regenerated = Conversation(id=source.id, turns=turns, source=source.source, line=source.line)
        self.unwritten.append((source, regenerated))
        return None


def _answers(turns: Sequence[Turn]) -> int:
    return sum(turn.role == "assistant" for turn in turns)


def _turn_seed(seed: int, conv_id: str, turn: int) -> int:
    """The sampling stream of one answer: the same whatever else is regenerated, and in whichever batch."""
    digest = hashlib.sha256(f"{seed}\0{conv_id}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
