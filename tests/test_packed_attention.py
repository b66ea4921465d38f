"""The target's packed attention: documents of one row attend causally within themselves, as separate forwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import eaglet.target_model.packed_attention as packed
from eaglet.target_model.packed_attention import packed_forward_kwargs, use_packed_attention, varlen_applies


def reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):  # fmt: skip
    """torch's varlen_attn contract ([T, H, D] tensors, causal for window (-1, 0)), document by document."""
    assert window_size == (-1, 0) and cu_q is cu_k and max_q >= int((cu_q[1:] - cu_q[:-1]).max())
    assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    assert enable_gqa or query.shape[1] == key.shape[1]
    bounds = cu_q.tolist()
    out = [
        F.scaled_dot_product_attention(
            query[a:b].transpose(0, 1), key[a:b].transpose(0, 1), value[a:b].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=enable_gqa,
        ).transpose(0, 1)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]  # fmt: skip
    return torch.cat(out)


def reference_varlen_2_10(query, key, value, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's varlen_attn: `is_causal`, no scale, as many key/value heads as query heads."""
    assert is_causal and query.shape[1] == key.shape[1]
    return reference_varlen(query, key, value, cu_q, cu_k, max_q, max_k, window_size=(-1, 0))


@pytest.fixture
def target() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    ("path", "compiled"),
    [
        ("per_document", False),
        ("varlen", False),
        ("varlen_2_10", False),
        ("per_document", True),
        ("varlen", True),
    ],
)
def test_a_packed_row_gives_each_document_its_own_forward(
    target, monkeypatch, path: str, compiled: bool
) -> None:
    """compiled: the decoder layers' forwards through torch.compile, as trainer.online_compile runs them."""
    lengths = [5, 1, 9, 3]
    ids = torch.randint(0, 97, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = [
            target(input_ids=doc[None], output_hidden_states=True).hidden_states for doc in ids.split(lengths)
        ]
    use_packed_attention(target)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    # The CUDA kernel's contract, on the CPU: what eaglet hands it and reads back.
    fakes = {"varlen": reference_varlen, "varlen_2_10": reference_varlen_2_10}
    if path in fakes:
        monkeypatch.setattr(packed, "varlen_attn", fakes[path])
    if compiled:
        torch._dynamo.reset()  # compiled afresh: the graphs must not come from another case's layers
        for layer in target.model.layers:
            monkeypatch.setattr(layer, "forward", torch.compile(layer.forward))
    kwargs = packed_forward_kwargs(cu, sum(lengths), varlen=path in fakes, compiled=compiled)
    with torch.no_grad():
        together = target(
            input_ids=ids[None], position_ids=positions[None], output_hidden_states=True, **kwargs
        ).hidden_states
    for layer, states in enumerate(together):
        expected = torch.cat([doc[layer][0] for doc in alone])
        torch.testing.assert_close(states[0], expected, rtol=1e-5, atol=1e-5, msg=f"layer {layer}")


def test_varlen_applies_to_half_precision_cuda_only() -> None:
    cuda = torch.device("cuda", 0)
    assert not varlen_applies(torch.device("cpu"), torch.bfloat16, 64)
    assert not varlen_applies(cuda, torch.float32, 64)
    assert not varlen_applies(cuda, torch.bfloat16, 512)
    assert varlen_applies(cuda, torch.bfloat16, 128) == (packed.varlen_attn is not None)
