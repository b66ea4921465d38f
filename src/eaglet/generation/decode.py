"""Decode a fixed list of prompts together: continuous batching (eaglet.generation.continuous) over one list."""

from __future__ import annotations

import torch

from eaglet.generation.continuous import DecodeSettings, Request, decode_continuous


class _PromptList:
    """Hands out every prompt at once (the batch holds them all) and collects the outputs by index."""

    def __init__(self, requests: list[Request]) -> None:
        self.pending = requests
        self.results: list[list[int]] = [[] for _ in requests]

    def take(self, limit: int) -> list[Request]:
        taken, self.pending = self.pending[:limit], self.pending[limit:]
        return taken

    def finish(self, request: Request, tokens: list[int]) -> None:
        self.results[request.tag] = tokens


def decode_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """New token ids for each prompt, each ending at the first stop id (excluded).

    Greedy when temperature is 0; otherwise each prompt samples from its own stream, seeded from `generator`.
    """
    base = 0
    if generator is not None:
        base = int(torch.randint(0, 2**31 - len(prompts), (1,), generator=generator, device=generator.device))
    source = _PromptList([Request(prompt, seed=base + i, tag=i) for i, prompt in enumerate(prompts)])
    settings = DecodeSettings(
        max_new_tokens=max_new_tokens,
        stop_ids=frozenset(stop_ids),
        pad_id=pad_id,
        temperature=temperature,
        top_p=top_p,
        max_rows=max(1, len(prompts)),
    )
    decode_continuous(model, source, settings)
    return source.results
