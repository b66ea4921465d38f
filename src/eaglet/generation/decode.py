"""Run a work source to the end with the right decoder, and decode a fixed list of prompts.

`decode_continuous` picks the generation engine (eaglet.generation.engine) on CUDA for the architectures it
knows, and the reference decoder (eaglet.generation.continuous) everywhere else: on CPU, where a graph saves
nothing and the reference is the one checked against transformers' own `generate`, and for any other model.
"""

from __future__ import annotations

import logging

import torch

from eaglet.generation.continuous import decode_reference
from eaglet.generation.engine import decode_static
from eaglet.generation.static_model import unsupported_reason
from eaglet.generation.work import DecodeSettings, Request, WorkSource

log = logging.getLogger(__name__)
ENGINES = ("auto", "engine", "reference")


def chosen_engine(model: torch.nn.Module, engine: str = "auto") -> str:
    """Which decoder runs: "engine" or "reference", as `engine` asks ("auto": the engine on CUDA when the model allows)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown decoder {engine!r}; one of {', '.join(ENGINES)}")
    if engine == "reference":
        return "reference"
    reason = unsupported_reason(model)
    if engine == "engine":
        if reason is not None:
            raise ValueError(f"the generation engine cannot run {type(model).__name__}: {reason}")
        return "engine"
    if next(model.parameters()).device.type != "cuda":
        return "reference"
    if reason is not None:
        log.info("generating with the reference decoder: %s", reason)
        return "reference"
    return "engine"


def decode_continuous(model: torch.nn.Module, source: WorkSource, settings: DecodeSettings) -> int:
    """Decode every request `source` hands out until it has no more, with the decoder `chosen_engine` picks;
    the rows it decoded at once (fewer than settings.max_rows where the GPU's memory holds fewer)."""
    if chosen_engine(model, settings.engine) == "engine":
        return decode_static(model, source, settings)
    return decode_reference(model, source, settings)


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
    seeds: list[int] | None = None,
    engine: str = "auto",
    max_rows: int | None = None,
    compile: bool = False,
    overlap_prefill: bool = False,
    prefill_graphs: bool = False,
    packed_prefill: bool | None = None,
) -> list[list[int]]:
    """New token ids for each prompt, each ending at the first stop id (excluded).

    Greedy when temperature is 0; otherwise each prompt samples from its own stream: `seeds` (one per prompt),
    or seeded from `generator`.
    `max_rows` rows decode at once (default: every prompt); `compile`, `overlap_prefill`,
    `prefill_graphs` and `packed_prefill` are the engine's DecodeSettings.
    """
    base = 0
    if generator is not None:
        base = int(torch.randint(0, 2**31 - len(prompts), (1,), generator=generator, device=generator.device))
    if seeds is None:
        seeds = [base + i for i in range(len(prompts))]
    elif len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    source = _PromptList(
        [
            Request(prompt, seed=seed, tag=i)
            for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True))
        ]
    )
    settings = DecodeSettings(
        max_new_tokens=max_new_tokens,
        stop_ids=frozenset(stop_ids),
        pad_id=pad_id,
        temperature=temperature,
        top_p=top_p,
        max_rows=max_rows or max(1, len(prompts)),
        engine=engine,
        compile=compile,
        overlap_prefill=overlap_prefill,
        prefill_graphs=prefill_graphs,
        packed_prefill=packed_prefill,
        max_context=max((len(p) for p in prompts), default=0) + max_new_tokens,
    )
    decode_continuous(model, source, settings)
    return source.results
