"""Draft-token proposers for speculative decoding: prompt lookup (n-gram) and an EAGLE-3 draft head.

The decoding loop talks to a proposer in three calls. Every token of the sequence except the last has been
processed by the target; the last one is the target's own next token, not yet fed back.

- `reset(tokens, state)`: a new sequence, tokens = prompt + the target's first new token;
  state.aux_hidden_states holds one row per prompt position (len(tokens) - 1 rows).
- `propose(k)`: up to k guesses of the tokens after the last one (fewer, or none, is allowed).
- `accept(tokens, state)`: the tokens appended after verification (accepted drafts + the target's bonus
  token); state holds one row per new token: the target's states at the position just before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import Tensor

from eaglet.errors import ConfigError, DataError
from eaglet.evaluate.drafter import Eagle3Drafter
from eaglet.model.draft_head import Eagle3DraftHead


@dataclass(frozen=True)
class TargetState:
    """What the target computed at the positions whose next token just became known."""

    # [n, num_aux, H_t]: row i = the aux states at the position right before new token i; None when no
    # proposer asked for them.
    aux_hidden_states: Tensor | None = None


class Proposer(Protocol):
    # Target layer ids whose input states the proposer reads (id k = input of decoder layer k); None: none.
    aux_layer_ids: Sequence[int] | None

    def reset(self, tokens: list[int], state: TargetState) -> None: ...

    def propose(self, k: int) -> list[int]: ...

    def accept(self, tokens: list[int], state: TargetState) -> None: ...


class NgramProposer:
    """Prompt lookup: find the longest suffix (max_n down to min_n tokens) seen earlier in prompt + output,
    and propose the tokens that followed its most recent earlier occurrence."""

    aux_layer_ids = None

    def __init__(self, *, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(
                f"n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []

    def reset(self, tokens: list[int], state: TargetState) -> None:
        self._tokens = list(tokens)

    def accept(self, tokens: list[int], state: TargetState) -> None:
        self._tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        seq = np.asarray(self._tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            # Earlier windows only: a match must end before the last token, so at least one token follows it.
            windows = sliding_window_view(seq[:-1], n)
            starts = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n
                return seq[follow : follow + k].tolist()
        return []


class Eagle3Proposer:
    """Greedy chain drafting with an EAGLE-3 head fed by the target's aux hidden states."""

    def __init__(self, head: Eagle3DraftHead, aux_layer_ids: Sequence[int]) -> None:
        if len(aux_layer_ids) != head.num_aux:
            raise ConfigError(
                f"the draft head fuses {head.num_aux} aux states but {len(aux_layer_ids)} aux layer ids were "
                f"given ({list(aux_layer_ids)}); pass the ids the head was trained on (its config.json)"
            )
        self.aux_layer_ids = list(aux_layer_ids)
        self.drafter = Eagle3Drafter(head)

    def reset(self, tokens: list[int], state: TargetState) -> None:
        self.drafter.reset()
        self._append(tokens[1:], state)

    def propose(self, k: int) -> list[int]:
        return self.drafter.propose(k)

    def accept(self, tokens: list[int], state: TargetState) -> None:
        self._append(tokens, state)

    def _append(self, next_tokens: list[int], state: TargetState) -> None:
        if state.aux_hidden_states is None:
            raise DataError(
                "Eagle3Proposer got no target aux hidden states; the decoding loop must capture the layers "
                "in proposer.aux_layer_ids"
            )
        ids = torch.tensor(next_tokens, dtype=torch.int64)
        self.drafter.append_context(ids, state.aux_hidden_states)
