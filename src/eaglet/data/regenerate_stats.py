"""What one regeneration did, whichever path answered (in-process or an endpoint)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RegenerateStats:
    conversations: int = 0
    resumed: int = 0
    generated_turns: int = 0
    generated_tokens: int = 0
    # Conversations cut short because the prompt outgrew the context budget.
    cut_for_length: int = 0
    seconds: float = 0.0
    # Requests sent again after a connection error, timeout, 429 or 5xx (endpoint path only).
    retries: int = 0
