"""The target's attention over one packed row: documents back to back, each attending causally within itself.

Online training runs the target over a training micro-batch as it is packed (eaglet.train.packing: position ids
restarting at 0 per document), so no token is padding and no [T, T] mask exists. The row's document
boundaries reach every attention layer as forward keyword arguments (`packed_forward_kwargs`); transformers
hands them to the attention function registered here under PACKED_ATTENTION. On CUDA, in bf16 or fp16, each
layer is one varlen flash-attention call (torch.nn.attention.varlen) that reads the boundaries on the device:
no host sync. Elsewhere (CPU, float32) SDPA runs document by document, from boundaries read on the host once
per forward, or once per layer when the layers run through torch.compile (`compiled`: a host list would be a
constant of the compiled graphs, compiled again for every row).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from eaglet.errors import ConfigError

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: the per-document path
    varlen_attn = None

PACKED_ATTENTION = "eaglet_packed"
_CU_SEQLENS = "eaglet_cu_seqlens"  # int32 [D+1] on the row's device: document d is tokens [cu[d], cu[d+1])
_MAX_SEQLEN = "eaglet_max_seqlen"  # an upper bound of the documents' lengths (the row's length will do)
_BOUNDS = "eaglet_document_bounds"  # the same boundaries as a host list: the per-document path
_BOUNDS_TENSOR = "eaglet_bounds_tensor"  # the same as a tensor, read per layer: compiled layers


def varlen_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether varlen flash attention takes these queries (its kernels: CUDA, half precision, head_dim <= 256)."""
    return (
        varlen_attn is not None
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def use_packed_attention(model: nn.Module) -> None:
    """Switch `model` (a transformers model) to the packed attention; it then needs `packed_forward_kwargs`."""
    model.set_attn_implementation(PACKED_ATTENTION)


def packed_forward_kwargs(
    cu_seqlens: torch.Tensor, max_seqlen: int, *, varlen: bool, compiled: bool = False
) -> dict[str, Any]:
    """The forward keyword arguments that carry a packed row's boundaries to every attention layer.

    varlen: the layers run varlen flash attention (see `varlen_applies`), which reads `cu_seqlens` on the
    device; otherwise the boundaries are read on the host here, once for all layers, or, when the layers run
    through torch.compile (`compiled`), in each layer, outside its graphs. Compiled, the number of documents
    is a dynamic size from the start: rows differ in it, and each new count would compile the layers again.
    """
    if not (varlen or compiled):
        return {_BOUNDS: cu_seqlens.tolist()}
    cu = cu_seqlens.to(torch.int32)
    if compiled:
        torch._dynamo.maybe_mark_dynamic(cu, 0)
    if varlen:
        return {_CU_SEQLENS: cu, _MAX_SEQLEN: int(max_seqlen)}
    return {_BOUNDS_TENSOR: cu}


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, Hq, T, D], key/value [1, Hkv, T, D] in, the output
    [1, T, Hq, Dv] and no weights out."""
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    if kwargs.get("sliding_window") is not None:
        raise ConfigError(
            f"{type(module).__name__} uses sliding-window attention, which online training does not run; "
            "extract hidden states and train from shards (trainer.features=shards)"
        )
    if _BOUNDS in kwargs:
        return per_document_attention(query, key, value, kwargs[_BOUNDS], scaling), None
    if _BOUNDS_TENSOR in kwargs:
        return _per_document_read_here(query, key, value, kwargs[_BOUNDS_TENSOR], scaling), None
    if _CU_SEQLENS not in kwargs:
        raise RuntimeError(
            f"attention implementation {PACKED_ATTENTION!r} needs a packed row's boundaries: pass "
            "packed_forward_kwargs(...) to the model's forward"
        )
    out = causal_varlen(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        kwargs[_CU_SEQLENS], kwargs[_MAX_SEQLEN], scaling,
    )  # fmt: skip
    return out.unsqueeze(0), None


def per_document_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scale: float | None
) -> torch.Tensor:
    """SDPA over each document [a, b) of `bounds` on its own, causal: [1, H, T, D] in, [1, T, Hq, Dv] out
    (empty documents allowed)."""
    gqa = query.shape[1] != key.shape[1]
    documents = [
        F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scale, enable_gqa=gqa
        )
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(documents, dim=2).transpose(1, 2)


@torch.compiler.disable
def _per_document_read_here(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """`per_document_attention` with the boundaries read from a tensor, outside any compiled graph (a graph break)."""
    return per_document_attention(query, key, value, cu.tolist(), scale)


# Compiled layers call it as it is when their graph is traced and keep the result as a constant, rather than
# tracing through inspect.
@torch.compiler.assume_constant_result
def _parameters(function: Any) -> tuple[str, ...]:
    return _signature(function)


@functools.cache
def _signature(function: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)  # once, not in every layer of every step


def causal_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float | None
) -> torch.Tensor:
    """Causal varlen flash attention over [T, H, D] tensors, through whichever varlen_attn this torch has: 2.10
    takes `is_causal` and neither a scale nor fewer key/value heads; 2.11 takes `scale` and `window_size`;
    2.12 on also `enable_gqa`."""
    params = _parameters(varlen_attn)
    options: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        options["scale"] = scale
    elif scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * q.shape[-1] ** 0.5)  # the kernel's own scale is 1/sqrt(D)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in params:
        options["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest, **options)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
