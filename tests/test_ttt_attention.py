"""The fast TTT attention: query tiles over gathered keys, diagonal keys as selector channels.

Rows in the reference tests are shorter than one query tile; here the tile is shrunk so that rows span
many tiles, and results (values and gradients, float64) must not depend on the tile size.
"""

from __future__ import annotations

import pytest
import torch

import eaglet.model.attention as attention
from eaglet.config.schema import DraftConfig
from eaglet.model.attention import document_causal_mask, ttt_attention
from eaglet.model.draft_head import Eagle3DraftHead
from eaglet.train.kd_loss import teacher_targets
from eaglet.train.ttt import ttt_forward

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
DOCUMENTS = torch.tensor([0] * 9 + [1] * 3 + [2] * 14 + [3])


def _naive(q, keys, values, documents, scale):
    """Per query and head: one softmax over the own document's causal context and the own diagonal keys."""
    t, steps = q.shape[0], keys.shape[0] - 1
    out = torch.empty_like(q)
    for i in range(t):
        visible = [s for s in range(t) if documents[s] == documents[i] and s <= i]
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            key_list = [keys[0, s, kv] for s in visible] + [keys[j, i, kv] for j in range(1, steps + 1)]
            value_list = [values[0, s, kv] for s in visible] + [values[j, i, kv] for j in range(1, steps + 1)]
            weights = torch.softmax(scale * torch.stack([q[i, h] @ key for key in key_list]), 0)
            out[i, h] = sum(w * v for w, v in zip(weights, value_list, strict=True))
    return out


def _inputs(steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = DOCUMENTS.numel()
    q = torch.randn(t, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    keys, values = torch.randn(2, steps + 1, t, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, keys, values


def _attend_with_grads(q, keys, values):
    q, keys, values = (x.clone().requires_grad_() for x in (q, keys, values))
    diagonal = (keys[1:], values[1:]) if keys.shape[0] > 1 else (None, None)
    out = ttt_attention(q, keys[0], values[0], *diagonal, document_causal_mask(DOCUMENTS), 0.3)
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), q.grad, keys.grad, values.grad


@pytest.mark.parametrize("steps", [0, 1, 4])
def test_tiled_attention_equals_naive_softmax_and_untiled_gradients(monkeypatch, steps) -> None:
    q, keys, values = _inputs(steps)
    whole = _attend_with_grads(q, keys, values)  # the row fits in one tile
    monkeypatch.setattr(attention, "QUERY_TILE", 5)  # tiles cut documents 0 and 2
    tiled = _attend_with_grads(q, keys, values)
    torch.testing.assert_close(tiled[0], _naive(q, keys, values, DOCUMENTS, 0.3), rtol=1e-12, atol=1e-12)
    for name, got, expected in zip(("out", "q", "keys", "values"), tiled, whole, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_tiles_attend_only_over_keys_their_queries_may_see(monkeypatch) -> None:
    key_counts = []
    sdpa = attention._sdpa

    def counting(q, k, v, mask, scale):
        key_counts.append(k.shape[0])
        return sdpa(q, k, v, mask, scale)

    monkeypatch.setattr(attention, "QUERY_TILE", 5)
    monkeypatch.setattr(attention, "_sdpa", counting)
    q, keys, values = _inputs(2)
    _attend_with_grads(q, keys, values)
    # Queries 10..14 see document 1 (9..11) and the start of document 2 (12..14), plus 2 selector keys.
    assert key_counts == [5 + 2, 10 + 2, 6 + 2, 8 + 2, 13 + 2, 15 + 2]


def test_ttt_forward_does_not_depend_on_the_query_tile(monkeypatch) -> None:
    h, v, vd = 16, 40, 12
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    cfg = DraftConfig(
        hidden_size=h,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=24,
    )
    head = Eagle3DraftHead(cfg, target_hidden_size=h, vocab_size=v, draft_vocab_size=vd).double()
    t = DOCUMENTS.numel()
    batch = {
        "input_ids": torch.randint(0, v, (t,), generator=gen),
        "loss_mask": torch.rand(t, generator=gen) < 0.8,
        "document_ids": DOCUMENTS,
        "position_ids": torch.cat(
            [torch.arange(int(n)) for n in DOCUMENTS.unique_consecutive(return_counts=True)[1]]
        ),
        "aux_hidden_states": torch.randn(t, 3 * h, generator=gen, dtype=torch.float64),
        "last_hidden_state": torch.randn(t, h, generator=gen, dtype=torch.float64),
    }
    lm_head = torch.randn(v, h, generator=gen, dtype=torch.float64)

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        head.zero_grad(set_to_none=True)
        out = ttt_forward(
            head,
            batch,
            target_norm_weight=torch.ones(h, dtype=torch.float64),
            target_norm_eps=1e-6,
            target_lm_head=lm_head,
            ttt_steps=3,
            step_loss_decay=0.8,
        )
        out.loss.backward()
        return out.loss.detach(), {
            n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None
        }

    loss, grads = run()
    monkeypatch.setattr(attention, "QUERY_TILE", 4)
    tiled_loss, tiled_grads = run()
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-12, atol=1e-12)
    assert tiled_grads.keys() == grads.keys() and "midlayer.self_attn.q_proj.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(
            tiled_grads[name], grad, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_teacher_argmax_takes_the_first_of_tied_maxima() -> None:
    h, v = 8, 30
    gen = torch.Generator().manual_seed(2)
    lm_head = 0.1 * torch.randn(v, h, generator=gen, dtype=torch.float64)
    lm_head[25] = lm_head[7] = torch.ones(h, dtype=torch.float64)  # ids 7 and 25 always tie, and win
    # An exact tie whatever order a matmul kernel sums in: with eps 0 the normed states are exactly 1.0, so
    # both logits are sums of eight 1.0s (with eps > 0 they differ in the last bit on some CPUs).
    last = torch.ones(3, h, dtype=torch.float64)
    d2t = torch.tensor([0, 0, 0])
    norm = torch.ones(h, dtype=torch.float64)
    teacher = teacher_targets(last, norm, 0.0, lm_head, d2t, chunk_tokens=2)
    assert teacher.argmax.tolist() == [7, 7, 7]
    # Draft ids 7 and 25 (d2t 0): the restricted argmax ties the same way.
    d2t = torch.tensor([0] * 26)
    teacher = teacher_targets(last, norm, 0.0, lm_head, d2t, chunk_tokens=2, full_vocab_argmax=False)
    assert teacher.argmax.tolist() == [7, 7, 7]


def test_gpu_attention_path_equals_the_tiled_cpu_path(monkeypatch) -> None:
    """The single-call GPU variant (padding to multiples of 8, GQA expanded) computes the same attention."""
    import torch

    from eaglet.model import attention

    gen = torch.Generator().manual_seed(3)
    t, heads, kv, d = 19, 4, 2, 13
    q = torch.randn(t, heads, d, generator=gen, dtype=torch.float64)
    k = torch.randn(t, kv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(t, kv, d, generator=gen, dtype=torch.float64)
    mask = attention.document_causal_mask(torch.tensor([0] * 7 + [1] * 12))
    monkeypatch.setattr(attention, "QUERY_TILE", 5)
    expected = attention.context_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(
        attention._cuda_attention(q, k, v, mask, 0.3), expected, rtol=1e-12, atol=1e-12
    )
