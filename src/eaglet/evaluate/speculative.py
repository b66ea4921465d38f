"""Greedy speculative decoding of one prompt against the target, and the plain greedy loop it must equal.

Each step the proposer guesses up to K tokens; the target reads the last token plus the guesses in one forward
over its KV cache, the longest prefix equal to its own argmax is accepted, and its argmax after that prefix is
the bonus token. The cache is then cut back to the accepted length. Both loops end at a stop id (excluded
from the output) or after max_new_tokens new tokens, so their outputs must match token for token.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection, Sequence
from contextlib import ExitStack

import torch
from transformers import DynamicCache

from eaglet.errors import ConfigError, EagletError
from eaglet.evaluate.acceptance import DecodeStats
from eaglet.evaluate.proposers import Proposer, TargetState
from eaglet.target_model import HiddenStateCapture, LoadedTarget


class LosslessError(EagletError):
    """Speculative decoding produced other tokens than greedy decoding of the same target."""


class _TargetSession:
    """The target over one growing sequence: its DynamicCache, and aux-state capture when asked for."""

    def __init__(self, target: LoadedTarget, aux_layer_ids: Sequence[int] | None, stack: ExitStack) -> None:
        self.model = target.model
        self.device = next(target.model.parameters()).device
        self.cache = DynamicCache()
        self.capture = (
            stack.enter_context(HiddenStateCapture(target.parts, aux_layer_ids)) if aux_layer_ids else None
        )
        self.forwards = 0
        # Ask for the needed logits only (no [S, V] tensor at prefill), under whichever name the model takes.
        params = inspect.signature(self.model.forward).parameters
        self._keep_arg = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)

    def forward(self, ids: Sequence[int], num_logits: int) -> tuple[list[int], torch.Tensor | None]:
        """Feed `ids` after the cached ones; the argmax at the last `num_logits` positions, and the aux states
        of every fed position (None without capture)."""
        keep = {self._keep_arg: num_logits} if self._keep_arg else {}
        out = self.model(
            input_ids=torch.tensor([list(ids)], device=self.device),
            past_key_values=self.cache,
            use_cache=True,
            **keep,
        )
        self.forwards += 1
        aux = self.capture.result().aux_hidden_states[0] if self.capture else None
        return out.logits[0, -num_logits:].argmax(dim=-1).tolist(), aux

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens. A negative count removes that many tokens: transformers 5
        accepts only that form, older releases read it the same way."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)


def _check_request(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise ConfigError("the prompt is empty; decoding needs at least one prompt token")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def greedy_decode(
    target: LoadedTarget, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Collection[int] = ()
) -> tuple[list[int], float]:
    """Plain greedy decoding with a KV cache, one token per forward: the reference. Returns (new ids, seconds)."""
    _check_request(prompt_ids, max_new_tokens)
    stops = set(stop_ids)
    with ExitStack() as stack:
        session = _TargetSession(target, None, stack)
        _sync(session.device)
        start = time.perf_counter()
        (token,), _ = session.forward(prompt_ids, 1)
        out: list[int] = []
        while token not in stops:
            out.append(token)
            if len(out) == max_new_tokens:
                break
            (token,), _ = session.forward([token], 1)
        _sync(session.device)
        return out, time.perf_counter() - start


@torch.inference_mode()
def speculative_decode(
    target: LoadedTarget,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    *,
    num_spec_tokens: int,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
) -> tuple[list[int], DecodeStats]:
    """Greedy speculative decoding with up to `num_spec_tokens` proposals per step; returns (new ids, stats)."""
    if num_spec_tokens < 1:
        raise ConfigError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
    _check_request(prompt_ids, max_new_tokens)
    stops = set(stop_ids)
    stats = DecodeStats.for_draft_length(num_spec_tokens)
    with ExitStack() as stack:
        session = _TargetSession(target, proposer.aux_layer_ids, stack)
        _sync(session.device)
        start = time.perf_counter()
        (token,), aux = session.forward(prompt_ids, 1)
        out: list[int] = []
        if token not in stops:
            out.append(token)
            proposer.reset([*prompt_ids, token], TargetState(aux))
        # Invariant: the target has processed every token but the last one, out[-1].
        while out and len(out) < max_new_tokens:
            processed = len(prompt_ids) + len(out) - 1
            # No more proposals than the budget can use (a step adds at most k + 1 tokens), so no step
            # overshoots max_new_tokens; a proposer may return fewer than asked, extra ones are dropped.
            budget = min(num_spec_tokens, max_new_tokens - len(out) - 1)
            proposals = proposer.propose(budget)[:budget] if budget else []
            argmax, aux = session.forward([out[-1], *proposals], len(proposals) + 1)
            accepted = stats.record_step(proposals, argmax)
            new = [*proposals[:accepted], argmax[accepted]]
            stop_at = next((i for i, t in enumerate(new) if t in stops), None)
            if stop_at is not None:
                out.extend(new[:stop_at])
                break
            out.extend(new)
            session.crop(processed + 1 + accepted)
            proposer.accept(new, TargetState(None if aux is None else aux[: accepted + 1]))
        _sync(session.device)
        stats.seconds = time.perf_counter() - start
        stats.new_tokens = len(out)
        stats.target_forwards = session.forwards
        return out, stats
