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
    # Answers taken from the record of a conversation's shorter version instead of generated again.
    reused_turns: int = 0
    seconds: float = 0.0
    # Requests sent again after a connection error, timeout, 429 or 5xx (endpoint path only).
    retries: int = 0
    # Rows decoded at once in-process (the batch size, or fewer where the GPU's memory holds fewer); 0: none.
    rows: int = 0

    def merged(self, other: RegenerateStats) -> RegenerateStats:
        """Both runs' counts together (a greedy pass and its sampled answers)."""
        return RegenerateStats(
            conversations=self.conversations + other.conversations,
            resumed=self.resumed + other.resumed,
            generated_turns=self.generated_turns + other.generated_turns,
            generated_tokens=self.generated_tokens + other.generated_tokens,
            cut_for_length=self.cut_for_length + other.cut_for_length,
            reused_turns=self.reused_turns + other.reused_turns,
            seconds=self.seconds + other.seconds,
            retries=self.retries + other.retries,
            rows=max(self.rows, other.rows),
        )
