"""What decoders share: a request, the source that hands them out, the settings, and how prompts are batched."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, eq=False)
class Request:
    """One prompt to continue. `seed` names its sampling stream (unused when greedy); `tag` is the caller's."""

    prompt: Sequence[int]
    seed: int = 0
    tag: Any = None


class WorkSource(Protocol):
    def take(self, limit: int) -> list[Request]:
        """Up to `limit` requests to start now (fewer, or none, when none are ready)."""
        ...

    def finish(self, request: Request, tokens: list[int]) -> None:
        """A request's new tokens, ending before its first stop id; called in a deterministic order."""
        ...


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    stop_ids: frozenset[int]
    pad_id: int
    temperature: float = 0.0
    top_p: float = 1.0
    # Rows decoding at once.
    max_rows: int = 16
    # Decode steps between checks for finished rows: each check is a device sync and may rebuild the cache;
    # a row that finishes mid-window idles until the check.
    refill_every: int = 16
    # Padded prompt tokens per prefill forward, at most; and at least, before prompts of quite different
    # lengths get a forward of their own (null: 0 on CPU, where padding is pure waste; 16384 on GPUs, where a
    # small forward costs its kernel launches more than its compute).
    prefill_tokens: int = 32768
    min_prefill_tokens: int | None = None
    # Which decoder: "engine" (eaglet.generation.engine: static slots, CUDA graphs), "reference"
    # (eaglet.generation.continuous: any transformers model), or "auto": the engine on CUDA for the
    # architectures it knows, else the reference.
    engine: str = "auto"
    # The most tokens a request's prompt and answer take together: the engine's per-slot cache (required by it).
    max_context: int | None = None
    # The engine's decode step as one CUDA graph (on CUDA); off only to compare or to debug.
    cuda_graphs: bool = True
    # The engine's decode step through torch.compile first (fuses the small elementwise kernels between the
    # matrix products; costs a compilation at the start).
    compile: bool = False
    # The engine prefills new requests behind the window it has just launched instead of before it: the host
    # launches the (eager) prefill while the GPU decodes, at the cost of the freed slots sitting out that window
    # (the requests start one window later). Outputs are the same either way.
    overlap_prefill: bool = False
    # The engine pads each prefill chunk to a bucket shape (rows to a power of two, width to a power of two or
    # 1.5 times one) and replays that shape's CUDA graph, captured on first use, instead of launching the
    # forward's kernels one by one (eaglet.generation.prefill_graphs). Outputs are the same.
    prefill_graphs: bool = False
    # The engine prefills prompts packed end to end, without padding (eaglet.generation.packed_attention), in
    # forwards of up to `prefill_tokens` tokens. None: where torch's variable-length flash attention runs (CUDA,
    # half precision); True: everywhere (elsewhere attention goes prompt by prompt); False: right-padded.
    packed_prefill: bool | None = None


def packed_chunks(requests: list[Request], budget: int) -> list[list[Request]]:
    """Requests in order, in batches of at most `budget` prompt tokens (one request at least)."""
    chunks: list[list[Request]] = []
    tokens = 0
    for request in requests:
        if chunks and tokens + len(request.prompt) <= budget:
            chunks[-1].append(request)
            tokens += len(request.prompt)
        else:
            chunks.append([request])
            tokens = len(request.prompt)
    return chunks


def prefill_chunks(requests: list[Request], budget: int, min_tokens: int) -> list[list[Request]]:
    """Prefill batches of requests sorted longest first, each within `budget` padded tokens (one row at least).

    A batch closes early where the next prompt is under 3/4 of its longest, once it holds `min_tokens`
    padded tokens: padding costs compute (quadratic in attention), and each forward costs launches.
    """
    chunks: list[list[Request]] = []
    for request in requests:
        if chunks:
            longest, rows = len(chunks[-1][0].prompt), len(chunks[-1])
            fits = (rows + 1) * longest <= budget
            similar = 4 * len(request.prompt) >= 3 * longest or rows * longest < min_tokens
            if fits and similar:
                chunks[-1].append(request)
                continue
        chunks.append([request])
    return chunks
