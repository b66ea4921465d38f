"""Which prompts share a prefill forward when each forward is padded to a bucket shape and replayed from a graph.

A replayed prefill costs a fixed amount (every layer's small kernels, whatever the shape) plus its padded
tokens. Splitting a refill's prompts by similar length alone ignores both: for the shared first turns (median 75
tokens, a long tail) a refill of 30 prompts took 5.5 forwards and 5,378 padded tokens for 3,127 real ones. Here
the split is the one of least total cost, found exactly over the prompts sorted longest first (only consecutive
runs can be worth grouping: a chunk is as wide as its longest prompt).

The fixed cost, in padded tokens, was read off one H100 (SmolLM2, 2026-12-06, experiments/BENCHMARKS.md): a
plan at 4,096 (1.6 forwards and 7,327 padded tokens a refill) took the same prefill time as the split by length,
so one forward costs about what 500 padded tokens do.
"""

from __future__ import annotations

import math

from eaglet.generation.prefill_graphs import bucket_rows, bucket_width
from eaglet.generation.work import Request


def padded_width(longest: int, capacity: int | None = None) -> int:
    """The width of a graphed prefill whose longest prompt is `longest` tokens (never wider than the cache)."""
    return bucket_width(longest) if capacity is None else min(bucket_width(longest), capacity)


def padded_tokens(rows: int, longest: int, capacity: int | None = None) -> int:
    """Tokens a graphed prefill of `rows` prompts, the longest `longest` tokens, computes (its bucket shape)."""
    return bucket_rows(rows) * padded_width(longest, capacity)


def plan_prefills(
    requests: list[Request], *, launch_tokens: int, max_tokens: int, capacity: int | None = None
) -> list[list[Request]]:
    """`requests`, sorted longest prompt first, split into consecutive chunks that minimise the sum over chunks
    of `launch_tokens` + padded tokens; a chunk holds at most `max_tokens` padded tokens unless it is one prompt.

    Dynamic programming over the split points: best[e] is the least cost of the first e prompts. A chunk that
    ends at e and starts earlier is wider and has more rows, so the scan back from e stops at the first chunk
    over `max_tokens`.
    """
    count = len(requests)
    widths = [padded_width(len(request.prompt), capacity) for request in requests]
    best = [0.0] + [math.inf] * count
    start_of = [0] * (count + 1)
    for end in range(1, count + 1):
        for start in range(end - 1, -1, -1):
            rows = end - start
            padded = bucket_rows(rows) * widths[start]
            if padded > max_tokens and rows > 1:
                break
            cost = best[start] + launch_tokens + padded
            if cost < best[end]:
                best[end], start_of[end] = cost, start
    chunks: list[list[Request]] = []
    end = count
    while end > 0:
        start = start_of[end]
        chunks.append(requests[start:end])
        end = start
    return chunks[::-1]
