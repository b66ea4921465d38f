"""Acceptance counting of greedy speculative decoding: the one place a verification step is scored.

Real speculative decoding (`eaglet.evaluate.speculative`) and the sweep's replay of it (`eaglet.sweeps.replay`)
both score their steps with `DecodeStats.record_step`, so measured and replayed τ count the same things.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def accepted_length(proposals: Sequence[int], target_argmax: Sequence[int]) -> int:
    """Length of the longest prefix of `proposals` equal to the target's argmax at the same positions."""
    for i, (proposed, verified) in enumerate(zip(proposals, target_argmax, strict=False)):
        if proposed != verified:
            return i
    return len(proposals)


@dataclass
class DecodeStats:
    """Counters of one speculative run (or the sum of several: `a + b`)."""

    steps: int = 0  # verification forwards that checked at least one proposed token
    accepted: int = 0
    proposed: int = 0
    per_position_accepted: list[int] = field(default_factory=list)
    per_position_proposed: list[int] = field(default_factory=list)
    new_tokens: int = 0
    target_forwards: int = 0  # all of them: prefill, verification, and steps without proposals
    seconds: float = 0.0

    @classmethod
    def for_draft_length(cls, k: int) -> DecodeStats:
        """Empty counters with one slot per draft position 1..k."""
        return cls(per_position_accepted=[0] * k, per_position_proposed=[0] * k)

    def record_step(self, proposals: Sequence[int], target_argmax: Sequence[int]) -> int:
        """Score one verification step: how many of `proposals` the target's argmax at the same positions
        accepts, counted into the totals and per draft position. A step without proposals counts nothing.
        Returns the accepted length."""
        accepted = accepted_length(proposals, target_argmax)
        if proposals:
            self.steps += 1
            self.proposed += len(proposals)
            self.accepted += accepted
            for i in range(len(proposals)):
                self.per_position_proposed[i] += 1
                self.per_position_accepted[i] += int(i < accepted)
        return accepted

    @property
    def tau(self) -> float:
        """Mean acceptance length 1 + accepted / steps, the bonus token counted (vLLM's definition)."""
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    def acceptance_rate(self, position: int) -> float:
        """Accepted / proposed at draft position `position` (0-based); an accepted token implies its prefix was."""
        proposed = _at(self.per_position_proposed, position)
        return _at(self.per_position_accepted, position) / proposed if proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def __add__(self, other: DecodeStats) -> DecodeStats:
        width = max(len(self.per_position_proposed), len(other.per_position_proposed))
        return DecodeStats(
            steps=self.steps + other.steps,
            accepted=self.accepted + other.accepted,
            proposed=self.proposed + other.proposed,
            per_position_accepted=[
                _at(self.per_position_accepted, i) + _at(other.per_position_accepted, i) for i in range(width)
            ],
            per_position_proposed=[
                _at(self.per_position_proposed, i) + _at(other.per_position_proposed, i) for i in range(width)
            ],
            new_tokens=self.new_tokens + other.new_tokens,
            target_forwards=self.target_forwards + other.target_forwards,
            seconds=self.seconds + other.seconds,
        )


def _at(values: list[int], i: int) -> int:
    return values[i] if i < len(values) else 0
