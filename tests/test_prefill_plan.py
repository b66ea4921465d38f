"""The split of new prompts into prefill forwards: the least total cost, every prompt once, in order."""

from __future__ import annotations

import itertools
import random

import pytest

from eaglet.generation.prefill_plan import padded_tokens, plan_prefills
from eaglet.generation.work import Request


def requests(lengths: list[int]) -> list[Request]:
    return [Request([1] * n, tag=i) for i, n in enumerate(sorted(lengths, reverse=True))]


def cost(chunks: list[list[Request]], launch: int, capacity: int | None = None) -> int:
    return sum(launch + padded_tokens(len(c), len(c[0].prompt), capacity) for c in chunks)


def every_split(items: list[Request]):
    """All ways to cut `items` into consecutive non-empty runs."""
    for cuts in itertools.product((False, True), repeat=len(items) - 1):
        chunks, current = [], [items[0]]
        for item, cut in zip(items[1:], cuts, strict=True):
            if cut:
                chunks.append(current)
                current = []
            current.append(item)
        yield [*chunks, current]


@pytest.mark.parametrize("seed", range(12))
def test_the_plan_costs_no_more_than_any_split_within_the_limit(seed: int) -> None:
    rng = random.Random(seed)
    items = requests([rng.randint(1, 700) for _ in range(rng.randint(1, 10))])
    launch, limit = rng.choice([0, 64, 4096, 50_000]), rng.choice([2048, 8192, 32768])
    plan = plan_prefills(items, launch_tokens=launch, max_tokens=limit)
    assert [r for chunk in plan for r in chunk] == items, "every prompt once, in order"
    assert all(len(c) == 1 or padded_tokens(len(c), len(c[0].prompt)) <= limit for c in plan)
    allowed = [
        split
        for split in every_split(items)
        if all(len(c) == 1 or padded_tokens(len(c), len(c[0].prompt)) <= limit for c in split)
    ]
    assert cost(plan, launch) == min(cost(split, launch) for split in allowed)


def test_a_costly_forward_joins_prompts_and_a_free_one_splits_them() -> None:
    items = requests([600, 500, 90, 80, 70, 40, 33, 20])
    assert len(plan_prefills(items, launch_tokens=10**6, max_tokens=32768)) == 1
    # With no cost per forward only padding counts: the long prompts go apart from the short ones.
    apart = plan_prefills(items, launch_tokens=0, max_tokens=32768)
    assert not any(len(c[0].prompt) == 600 and len(c[-1].prompt) == 20 for c in apart)
    assert cost(apart, 0) < padded_tokens(len(items), 600)


def test_a_prompt_over_the_limit_still_gets_a_forward_of_its_own() -> None:
    items = requests([3000, 10, 10])
    plan = plan_prefills(items, launch_tokens=4096, max_tokens=2048)
    assert [len(c) for c in plan][0] == 1 and sum(len(c) for c in plan) == 3


def test_the_cache_width_caps_the_bucket() -> None:
    # A 1,100-token prompt's bucket is 1,536 wide, but no prefill is wider than a slot's cache.
    assert padded_tokens(3, 1100) == 4 * 1536
    assert padded_tokens(3, 1100, capacity=1200) == 4 * 1200


def test_no_prompts_no_forwards() -> None:
    assert plan_prefills([], launch_tokens=4096, max_tokens=32768) == []
