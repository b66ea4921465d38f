"""The GPU attention path (`eaglet.model.ttt_flex`) against the tested SDPA path, on CPU.

flex_attention has no CPU backward, so: its forward runs eagerly here (values must equal the SDPA path's,
which proves the block mask visits every block a query may see); the rest of the path (layout, padding,
log-sum-exp merge of the diagonal) is checked with gradients by swapping flex for dense attention over the
same mask_mod. The CUDA tests of test_ttt_reference.py run the real kernel against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import eaglet.model.ttt_flex as ttt_flex
from eaglet.errors import ConfigError
from eaglet.model.attention import SdpaTTTAttention
from eaglet.model.ttt_flex import (
    FlexTTTAttention,
    context_block_mask,
    context_layout,
    context_mask_mod,
    merge_diagonal,
)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _segments(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def _rows(t: int, keep: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.rand(t, generator=gen) < keep).nonzero().squeeze(1)
    return rows if rows.numel() else torch.tensor([t - 1])


def _dense_flex(q, k, v, block_mask, scale, compiled):
    """flex_attention's contract ([1, heads, M, d] in, out and natural-log lse out) in dense autograd math."""
    mask = create_mask(block_mask.mask_mod, None, None, q.shape[2], k.shape[2], device=q.device)[0, 0]
    groups = q.shape[1] // k.shape[1]
    scores = scale * q @ k.repeat_interleave(groups, 1).transpose(-1, -2)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v.repeat_interleave(groups, 1), lse


def _inputs(t: int, m: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(m, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    context = tuple(torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    diagonal = [
        tuple(torch.randn(m, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
        for _ in range(steps)
    ]
    return q, context, diagonal


CASES = [  # document lengths, share of positions that are query rows
    ([300], 1.0),
    ([129, 1, 127, 256, 40], 0.6),  # blocks cut documents; a one-token document; T not a block multiple
    ([100, 700, 3, 200], 0.3),  # long documents: full blocks; query blocks spanning several documents
]


@pytest.mark.parametrize(("lengths", "keep"), CASES)
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_flex_forward_equals_the_sdpa_path(lengths, keep, steps) -> None:
    segments = _segments(lengths)
    rows = _rows(len(segments), keep, seed=len(lengths) + steps)
    q, context, diagonal = _inputs(len(segments), len(rows), steps, seed=steps)
    expected = SdpaTTTAttention(segments, rows)(q, context, diagonal, 0.3)
    with torch.no_grad():
        got = FlexTTTAttention(segments, rows, compiled=False)(q, context, diagonal, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("lengths", "keep"), CASES)
def test_block_mask_covers_every_visible_block_and_marks_full_ones_exactly(lengths, keep) -> None:
    segments = _segments(lengths)
    layout = context_layout(segments, _rows(len(segments), keep, seed=1))
    ours = context_block_mask(layout, segments)
    exact = create_block_mask(
        context_mask_mod(layout), None, None, layout.padded_rows, layout.padded_keys, device="cpu"
    )

    def blocks(num, indices) -> set[tuple[int, int]]:
        return {(i, int(j)) for i in range(num.shape[-1]) for j in indices[0, 0, i, : int(num[0, 0, i])]}

    ours_full = blocks(ours.full_kv_num_blocks, ours.full_kv_indices)
    ours_all = ours_full | blocks(ours.kv_num_blocks, ours.kv_indices)
    exact_full = blocks(exact.full_kv_num_blocks, exact.full_kv_indices)
    exact_all = exact_full | blocks(exact.kv_num_blocks, exact.kv_indices)
    assert exact_all <= ours_all  # no block with a visible key is skipped
    assert ours_full <= exact_full  # mask_mod is skipped only where every key is visible
    assert len(ours_all) <= 1.5 * len(exact_all)  # and the bounds stay tight


def test_padding_queries_repeat_the_last_row() -> None:
    segments = _segments([5, 7])
    layout = context_layout(segments, torch.tensor([0, 3, 9]))
    assert layout.padded_rows == 128 and layout.padded_keys == 128
    assert layout.query_positions[:4].tolist() == [0, 3, 9, 9] and layout.query_positions[-1] == 9
    assert (layout.key_segments[12:] == -1).all()


@pytest.mark.parametrize(("lengths", "keep"), CASES[1:])
@pytest.mark.parametrize("steps", [1, 3])
def test_flex_path_gradients_equal_the_sdpa_path(monkeypatch, lengths, keep, steps) -> None:
    """Layout, padding and the lse merge under autograd, flex's kernel replaced by dense attention."""
    monkeypatch.setattr(ttt_flex, "_flex_with_lse", _dense_flex)
    segments = _segments(lengths)
    rows = _rows(len(segments), keep, seed=steps)
    inputs = _inputs(len(segments), len(rows), steps, seed=7)
    results = []
    for attend in (SdpaTTTAttention(segments, rows), FlexTTTAttention(segments, rows, compiled=False)):
        q, context, diagonal = (
            inputs[0].clone().requires_grad_(),
            tuple(x.clone().requires_grad_() for x in inputs[1]),
            [tuple(x.clone().requires_grad_() for x in kv) for kv in inputs[2]],
        )
        out = attend(q, context, diagonal, 0.3)
        weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
        (out * weights).sum().backward()
        leaves = [q, *context, *(x for kv in diagonal for x in kv)]
        results.append([out.detach(), *(x.grad for x in leaves)])
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_merge_is_stable_for_large_scores() -> None:
    """Scores far beyond exp's range merge like a softmax over all keys (the max is shifted out)."""
    m, d = 3, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(m, 2, d, generator=gen)
    keys = torch.randn(m, 1, d, generator=gen) * 400
    values = torch.randn(m, 1, d, generator=gen)
    out, lse = torch.randn(m, 2, d, generator=gen), torch.full((m, 2), 300.0)
    merged = merge_diagonal(out, lse, q, [(keys, values)], 1.0)
    scores = torch.einsum("mhd,md->mh", q, keys[:, 0])
    weight = torch.softmax(torch.stack([lse, scores]), dim=0)
    expected = weight[0, ..., None] * out + weight[1, ..., None] * values[:, 0, None, :]
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)


def test_flex_on_cpu_refuses_training() -> None:
    segments = _segments([10])
    q, context, diagonal = _inputs(10, 10, 1, seed=0)
    with pytest.raises(ConfigError, match="attention=flex has no backward on CPU"):
        FlexTTTAttention(segments, torch.arange(10), compiled=False)(
            q.requires_grad_(), context, diagonal, 0.3
        )


def test_merge_backward_equals_autograd_of_one_softmax() -> None:
    """The hand-written backward of the merge against gradcheck (float64), GQA and three diagonal steps."""
    gen = torch.Generator().manual_seed(5)
    m, d = 5, 3
    q = torch.randn(m, HEADS, d, generator=gen, dtype=torch.float64, requires_grad=True)
    out = torch.randn(m, HEADS, d, generator=gen, dtype=torch.float64, requires_grad=True)
    lse = torch.randn(m, HEADS, generator=gen, dtype=torch.float64, requires_grad=True)
    diagonal = [
        tuple(
            torch.randn(m, KV_HEADS, d, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2)
        )
        for _ in range(3)
    ]
    leaves = [out, lse, q, *(x for kv in diagonal for x in kv)]

    def merged(out, lse, q, *flat):
        return merge_diagonal(out, lse, q, list(zip(flat[::2], flat[1::2], strict=True)), 0.7)

    assert torch.autograd.gradcheck(merged, leaves)
