"""Keeping evaluation prompts out of training: one normalisation for both sides of the comparison."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from eaglet.data.conversations import Conversation, load_conversations


def normalise_prompt(text: str) -> str:
    """Whitespace- and case-insensitive form: a prompt copied with other line breaks still matches."""
    return re.sub(r"\s+", " ", text).strip().lower()


def eval_set_prompts(set_defs: Mapping[str, Any]) -> set[str]:
    """Normalised first user turns of every evaluation set (records [skip, skip + count) of its file)."""
    prompts: set[str] = set()
    for spec in set_defs.values():
        conversations, _ = load_conversations(
            [spec.path], max_records=spec.skip + spec.count, require_assistant=False
        )
        for conv in conversations[spec.skip :]:
            first_user = next(t for t in conv.turns if t.role == "user")
            prompts.add(normalise_prompt(first_user.content))
    return prompts


def drop_held_out(
    conversations: Iterable[Conversation], held_out: set[str]
) -> tuple[list[Conversation], int]:
    """Conversations none of whose user turns is a held-out prompt, and how many were dropped."""
    kept, dropped = [], 0
    for conv in conversations:
        if any(t.role == "user" and normalise_prompt(t.content) in held_out for t in conv.turns):
            dropped += 1
        else:
            kept.append(conv)
    return kept, dropped
