"""The draft head's export names, initialisation from the target, attention variants, and the KD teacher."""

from __future__ import annotations

import pytest
import torch

from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError, DataError
from eaglet.model.attention import document_causal_mask, ttt_attention
from eaglet.model.draft_head import Eagle3DraftHead
from eaglet.train.kd_loss import teacher_targets
from eaglet.train.ttt import tau_sim, ttt_forward

H, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, V, VD = 16, 4, 2, 8, 24, 50, 20


def _config(**overrides) -> DraftConfig:
    shape = dict(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
    )
    return DraftConfig(**{**shape, **overrides})


def _vocab_map(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    used = torch.randperm(V, generator=gen)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(VD), t2d


@pytest.fixture
def target() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    d2t, t2d = _vocab_map(gen)
    return {
        "embed": torch.randn(V, H, generator=gen),
        "lm_head": torch.randn(V, H, generator=gen),
        "norm": 1.0 + 0.1 * torch.randn(H, generator=gen),
        "d2t": d2t,
        "t2d": t2d,
    }


def _head(target, lm_head_trainable: bool = True, seed: int = 0, **overrides) -> Eagle3DraftHead:
    torch.manual_seed(seed)
    head = Eagle3DraftHead(_config(**overrides), target_hidden_size=H, vocab_size=V, draft_vocab_size=VD)
    head.init_from_target(
        target["embed"], target["lm_head"], target["d2t"], target["t2d"], lm_head_trainable=lm_head_trainable
    )
    return head


def _batch(lengths=(6, 1, 5), seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return {
        "input_ids": torch.randint(0, V, (t,), generator=gen),
        "loss_mask": torch.rand(t, generator=gen) < 0.8,
        "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
        "aux_hidden_states": torch.randn(t, 3 * H, generator=gen),
        "last_hidden_state": torch.randn(t, H, generator=gen),
    }


def _forward(head, target, batch=None, steps: int = 3, **kwargs):
    return ttt_forward(
        head,
        batch if batch is not None else _batch(),
        target_norm_weight=target["norm"],
        target_norm_eps=1e-6,
        target_lm_head=target["lm_head"],
        ttt_steps=steps,
        step_loss_decay=0.8,
        **kwargs,
    )


def test_tensor_names_and_shapes_are_the_export_contract(target) -> None:
    head = _head(target)
    expected = {
        "embed_tokens.weight": (V, H),
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (INTERMEDIATE, H),
        "midlayer.mlp.up_proj.weight": (INTERMEDIATE, H),
        "midlayer.mlp.down_proj.weight": (H, INTERMEDIATE),
        "norm.weight": (H,),
        "lm_head.weight": (VD, H),
        "d2t": (VD,),
        "t2d": (V,),
    }
    state = head.state_dict()
    assert {name: tuple(t.shape) for name, t in state.items()} == expected
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert {name for name, _ in head.named_buffers()} == {"d2t", "t2d"}


@pytest.mark.parametrize("lm_head_trainable", [False, True])
def test_embeddings_frozen_and_lm_head_per_flag(target, lm_head_trainable) -> None:
    head = _head(target, lm_head_trainable)
    assert not head.embed_tokens.weight.requires_grad
    assert head.lm_head.weight.requires_grad is lm_head_trainable
    _forward(head, target).loss.backward()
    assert head.embed_tokens.weight.grad is None
    assert (head.lm_head.weight.grad is not None) is lm_head_trainable
    assert head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0


def test_init_from_target_copies_the_draft_rows(target) -> None:
    head = _head(target)
    d2t = target["d2t"]
    assert d2t.abs().sum() > 0  # a non-identity map, so a missing offset would show
    for i in range(VD):
        assert torch.equal(head.lm_head.weight[i], target["lm_head"][i + int(d2t[i])])
    assert torch.equal(head.embed_tokens.weight, target["embed"])
    assert torch.equal(head.d2t, d2t) and torch.equal(head.t2d, target["t2d"])
    assert torch.equal(head.draft_target_ids, target["t2d"].nonzero().squeeze(1))


def test_init_from_target_rejects_mismatches(target) -> None:
    head = Eagle3DraftHead(_config(), target_hidden_size=H, vocab_size=V, draft_vocab_size=VD)
    with pytest.raises(ConfigError, match="lm_head"):
        head.init_from_target(
            target["embed"], target["lm_head"][:, :8], target["d2t"], target["t2d"], lm_head_trainable=True
        )
    other_t2d = target["t2d"].roll(1)
    with pytest.raises(DataError, match="disagree"):
        head.init_from_target(
            target["embed"], target["lm_head"], target["d2t"], other_t2d, lm_head_trainable=True
        )
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        Eagle3DraftHead(
            _config(num_key_value_heads=3), target_hidden_size=H, vocab_size=V, draft_vocab_size=VD
        )


def test_grouped_query_attention_equals_repeated_kv_heads(target) -> None:
    gqa = _head(target)
    mha = _head(target, num_key_value_heads=HEADS)
    state = gqa.state_dict()
    for name in ("k_proj", "v_proj"):  # kv head j serves query heads 2j and 2j+1
        weight = state[f"midlayer.self_attn.{name}.weight"].view(KV_HEADS, HEAD_DIM, 2 * H)
        state[f"midlayer.self_attn.{name}.weight"] = weight.repeat_interleave(HEADS // KV_HEADS, 0).reshape(
            -1, 2 * H
        )
    mha.load_state_dict(state)
    gqa_out, mha_out = _forward(gqa, target), _forward(mha, target)
    torch.testing.assert_close(gqa_out.loss, mha_out.loss)
    torch.testing.assert_close(gqa_out.step_losses, mha_out.step_losses)


def test_norm_before_residual_changes_the_residual(target) -> None:
    heads = {flag: _head(target, norm_before_residual=flag).double() for flag in (False, True)}
    heads[True].load_state_dict(heads[False].state_dict())
    gen = torch.Generator().manual_seed(2)
    embeds, hidden = torch.randn(2, 5, H, generator=gen, dtype=torch.float64)
    mask = document_causal_mask(torch.zeros(5, dtype=torch.int64))
    positions = torch.arange(5)

    def step(flag: bool, scale: float) -> torch.Tensor:
        return heads[flag].decoder_step(embeds, scale * hidden, positions, mask)[0]

    # The residual is the only place the hidden's scale survives hidden_norm: normalised first, it cannot.
    torch.testing.assert_close(step(True, 1.0), step(True, 10.0), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(step(False, 1.0), step(False, 10.0), atol=1e-2)
    assert not torch.allclose(step(False, 1.0), step(True, 1.0), atol=1e-2)


def test_ttt_attention_equals_one_softmax_over_context_and_diagonal() -> None:
    gen = torch.Generator().manual_seed(3)
    t, k, d = 7, 2, HEAD_DIM
    q = torch.randn(t, HEADS, d, generator=gen, dtype=torch.float64)
    keys, values = torch.randn(2, k + 1, t, KV_HEADS, d, generator=gen, dtype=torch.float64)
    documents = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    mask = document_causal_mask(documents)
    out = ttt_attention(q, keys[0], values[0], keys[1:], values[1:], mask, 0.3)
    for i in range(t):
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            visible = [s for s in range(t) if documents[s] == documents[i] and s <= i]
            key_list = [keys[0, s, kv] for s in visible] + [keys[j, i, kv] for j in range(1, k + 1)]
            value_list = [values[0, s, kv] for s in visible] + [values[j, i, kv] for j in range(1, k + 1)]
            weights = torch.softmax(0.3 * torch.stack([q[i, h] @ key for key in key_list]), 0)
            expected = sum(w * v for w, v in zip(weights, value_list, strict=True))
            torch.testing.assert_close(out[i, h], expected, rtol=1e-12, atol=1e-12)


def test_fuse_accepts_stacked_aux_states(target) -> None:
    head = _head(target)
    aux = torch.randn(4, 3, H)
    torch.testing.assert_close(head.fuse(aux), head.fuse(aux.reshape(4, 3 * H)))
    with pytest.raises(DataError, match="aux_hidden_states"):
        head.fuse(torch.randn(4, 2 * H))


@pytest.mark.parametrize("full_vocab_argmax", [True, False])
def test_teacher_in_chunks_equals_full_softmax_restricted(target, full_vocab_argmax) -> None:
    gen = torch.Generator().manual_seed(4)
    last = 3.0 * torch.randn(11, H, generator=gen, dtype=torch.float64)
    lm_head, norm, d2t = target["lm_head"].double(), target["norm"].double(), target["d2t"]
    kwargs = dict(full_vocab_argmax=full_vocab_argmax)
    teacher = teacher_targets(last, norm, 1e-6, lm_head, d2t, chunk_tokens=3, **kwargs)
    whole = teacher_targets(last, norm, 1e-6, lm_head, d2t, chunk_tokens=1000, **kwargs)
    rows = torch.arange(11)
    torch.testing.assert_close(teacher.log_probs(rows), whole.log_probs(rows), rtol=0, atol=1e-13)
    assert torch.equal(teacher.argmax, whole.argmax)

    normed = last / last.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm
    full = torch.softmax(normed @ lm_head.T, dim=-1)
    draft_ids = torch.arange(VD) + d2t
    restricted = full[:, draft_ids]
    torch.testing.assert_close(
        teacher.log_probs(rows).exp(), restricted / restricted.sum(-1, keepdim=True), rtol=1e-12, atol=1e-14
    )
    inside = target["t2d"][full.argmax(-1)]
    assert not inside.all() and inside.any()  # some argmax lies outside the draft vocab, some inside
    if full_vocab_argmax:
        assert torch.equal(teacher.argmax, full.argmax(-1))
    else:  # the best draft token: the full argmax wherever that is a draft token
        assert torch.equal(teacher.argmax, draft_ids[restricted.argmax(-1)])
        assert torch.equal(teacher.argmax[inside], full.argmax(-1)[inside])


def test_invalid_settings_and_batches_raise(target) -> None:
    head = _head(target)
    with pytest.raises(ConfigError, match="ttt_steps"):
        _forward(head, target, steps=0)
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        _forward(head, target, chunk_tokens=0)
    batch = _batch()
    del batch["position_ids"]
    with pytest.raises(DataError, match="position_ids"):
        _forward(head, target, batch)
    batch = _batch()
    batch["loss_mask"] = batch["loss_mask"][:-1]
    with pytest.raises(DataError, match="loss_mask"):
        _forward(head, target, batch)


def test_a_row_without_weight_gives_a_zero_differentiable_loss(target) -> None:
    head = _head(target)
    batch = _batch()
    batch["loss_mask"][:] = False
    out = _forward(head, target, batch)
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    assert out.step_weight_sums.tolist() == [0, 0, 0] and out.step_counts.tolist() == [0, 0, 0]
    out.loss.backward()


def test_tau_sim() -> None:
    assert tau_sim(torch.tensor([8, 3, 1]), torch.tensor([10, 6, 2])) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert tau_sim(torch.tensor([5, 0]), torch.tensor([5, 0])) == pytest.approx(2.0)


class _ShardedLayer(torch.nn.Module):
    """FSDP's structure: a wrapper whose forward makes the layer's parameters whole, runs it, and empties them."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.whole = {name: p.data for name, p in layer.named_parameters()}
        self._reshard()

    def _reshard(self) -> None:
        for p in self.layer.parameters():
            p.data = torch.empty(0)

    def forward(self, *args, **kwargs):
        for name, p in self.layer.named_parameters():
            p.data = self.whole[name]
        try:
            return self.layer(*args, **kwargs)
        finally:
            self._reshard()


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_training_uses_the_layer_parameters_only_inside_its_forward(target, attention) -> None:
    """FSDP gathers a wrapped layer's parameters in its forward only: here they are empty outside it."""
    head = _head(target)
    with torch.no_grad():  # flex has no CPU backward; the backward would need FSDP's re-gathering too
        expected = _forward(head, target, attention=attention, fused_loss=True)
        head.midlayer = _ShardedLayer(head.midlayer)
        out = _forward(head, target, attention=attention, fused_loss=True)
    torch.testing.assert_close(out.loss, expected.loss)
