"""Decode attention for grouped-query models: equal to SDPA over repeated key/value heads, and in use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglet.generation import gqa_attention
from eaglet.generation.gqa_attention import gqa_decode, gqa_decode_attention


def reference(query, key, value, mask, scale):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_equals_sdpa_over_repeated_heads(mask_kind: str) -> None:
    torch.manual_seed(0)
    rows, heads, kv_heads, width, dim = 5, 6, 2, 11, 8
    query = torch.randn(rows, heads, 1, dim, dtype=torch.float64)
    # A slice of a wider buffer, as the row cache hands it over.
    key = torch.randn(rows, kv_heads, width + 4, dim, dtype=torch.float64)[:, :, :width]
    value = torch.randn(rows, kv_heads, width + 4, dim, dtype=torch.float64)[:, :, :width]
    keep = torch.rand(rows, 1, 1, width) > 0.3
    keep[..., -1] = True  # every row sees its newest token
    mask = (
        keep
        if mask_kind == "bool"
        else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -1e30)
    )
    module = torch.nn.Module()
    got, _ = gqa_decode_attention(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(got, reference(query, key, value, mask, 0.3))


def test_decoding_goes_through_it_and_restores_the_model(monkeypatch) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from eaglet.generation import DecodeSettings, Request, decode_continuous

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    calls = []
    original = gqa_attention.gqa_decode_attention

    def counting(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(gqa_attention.NAME, counting)
    try:

        class Source:
            todo = [Request([1, 2, 3]), Request([4, 5])]
            done: list = []

            def take(self, limit):
                taken, self.todo = self.todo[:limit], self.todo[limit:]
                return taken

            def finish(self, request, tokens):
                self.done.append(tokens)

        source = Source()
        decode_continuous(
            model, source, DecodeSettings(max_new_tokens=4, stop_ids=frozenset(), pad_id=0, max_rows=2)
        )
    finally:
        AttentionInterface.register(gqa_attention.NAME, original)
    assert len(source.done) == 2 and all(len(tokens) == 4 for tokens in source.done)
    assert calls.count(1) >= 2 * 3  # each layer, each one-token step
    assert model.config._attn_implementation == "sdpa"


def test_models_without_grouped_heads_keep_their_attention() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")  # fmt: skip
    with gqa_decode(LlamaForCausalLM(config)) as name:
        assert name == "sdpa"
