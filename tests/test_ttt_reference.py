"""The packed, batched TTT loss against a deliberately naive float64 reference.

The reference walks one document at a time with Python loops over steps, positions, heads and keys, builds
the teacher from the full-vocab softmax (then restricts and renormalises), and shifts inputs, targets and
masks by hand. It shares nothing with the implementation but the parameter values, so a shift, mask or
attention bug shows up as a loss, gradient or count mismatch.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

import eaglet.model.ttt_flex as ttt_flex
import eaglet.train.kd_loss as kd_loss_module
import eaglet.train.ttt as ttt_module
from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError
from eaglet.model.draft_head import Eagle3DraftHead
from eaglet.train.ttt import select_attention, ttt_forward

H, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, V, VD, EPS, THETA = 16, 2, 1, 8, 24, 50, 20, 1e-6, 100.0
TOL = dict(rtol=1e-9, atol=1e-10)
# flex_attention's CUDA kernels need heads of at least 16 (ttt_flex.MIN_CUDA_HEAD_DIM): the GPU case's head.
CUDA_HEAD_DIM = 16


def _draft_config(norm_before_residual: bool, head_dim: int = HEAD_DIM) -> DraftConfig:
    return DraftConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=head_dim,
        intermediate_size=INTERMEDIATE,
        rms_norm_eps=EPS,
        rope_theta=THETA,
        norm_before_residual=norm_before_residual,
    )


def _target(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A tiny target whose argmax is mostly one of three tokens: two in the draft vocab, one outside.

    That makes the draft right about half the time, so conditional accuracies are not all zero.
    """
    used = torch.randperm(V, generator=gen)[:VD].sort().values
    outside = [i for i in range(V) if i not in set(used.tolist())]
    lm_head = 0.1 * torch.randn(V, H, generator=gen, dtype=torch.float64)
    direction = torch.randn(2, H, generator=gen, dtype=torch.float64)
    lm_head[used[3]] += direction[0]
    lm_head[used[11]] -= direction[0]
    lm_head[outside[5]] += direction[1]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return {
        "embed": torch.randn(V, H, generator=gen, dtype=torch.float64),
        "lm_head": lm_head,
        "norm": 1.0 + 0.2 * torch.randn(H, generator=gen, dtype=torch.float64),
        "d2t": used - torch.arange(VD),
        "t2d": t2d,
    }


def _head(
    target: dict[str, torch.Tensor],
    gen: torch.Generator,
    norm_before_residual: bool,
    lm_head_trainable: bool,
    head_dim: int = HEAD_DIM,
):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    head = Eagle3DraftHead(
        _draft_config(norm_before_residual, head_dim), target_hidden_size=H, vocab_size=V, draft_vocab_size=VD
    )
    head = head.double()
    with torch.no_grad():  # norms away from 1 so a swapped norm weight is visible
        for norm in (
            head.midlayer.input_layernorm,
            head.midlayer.hidden_norm,
            head.midlayer.post_attention_layernorm,
            head.norm,
        ):
            norm.weight.copy_(1.0 + 0.3 * torch.randn(H, generator=gen, dtype=torch.float64))
    head.init_from_target(
        target["embed"], target["lm_head"], target["d2t"], target["t2d"], lm_head_trainable=lm_head_trainable
    )
    return head


def _documents(
    lengths: tuple[int, ...], gen: torch.Generator, prompt: float = 0.0
) -> list[dict[str, torch.Tensor]]:
    """Random documents; the first `prompt` share of each has loss mask 0 (a prompt), the rest 75% ones."""
    return [
        {
            "ids": torch.randint(0, V, (n,), generator=gen),
            "loss_mask": (torch.rand(n, generator=gen) < 0.75) & (torch.arange(n) >= int(prompt * n)),
            "aux": torch.randn(n, 3 * H, generator=gen, dtype=torch.float64),
            "last": 2.0 * torch.randn(n, H, generator=gen, dtype=torch.float64),
        }
        for n in lengths
    ]


def _pack(docs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.cat([d["ids"] for d in docs]),
        "loss_mask": torch.cat([d["loss_mask"] for d in docs]),
        # Ids need not be ordered or small; only equality within a document matters.
        "document_ids": torch.cat([torch.full((len(d["ids"]),), 7 * i + 3) for i, d in enumerate(docs)]),
        "position_ids": torch.cat([torch.arange(len(d["ids"])) for d in docs]),
        "aux_hidden_states": torch.cat([d["aux"] for d in docs]),
        "last_hidden_state": torch.cat([d["last"] for d in docs]),
    }


# ---------------------------------------------------------------- the naive reference


def _rms(x, w):
    return w * x / torch.sqrt((x * x).mean() + EPS)


def _rope(x, position):
    dim = x.shape[0]  # the head size: the reference takes it from the weights
    half = dim // 2
    angle = torch.tensor([position * THETA ** (-2 * i / dim) for i in range(half)], dtype=torch.float64)
    a, b = x[:half], x[half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()])


def _layer_inputs(p, embed, hidden, position, norm_before_residual):
    normed_hidden = _rms(hidden, p["midlayer.hidden_norm.weight"])
    x = torch.cat([_rms(embed, p["midlayer.input_layernorm.weight"]), normed_hidden])
    q = p["midlayer.self_attn.q_proj.weight"] @ x
    k = p["midlayer.self_attn.k_proj.weight"] @ x
    v = p["midlayer.self_attn.v_proj.weight"] @ x
    d = q.shape[0] // HEADS
    queries = [_rope(q[h * d : (h + 1) * d], position) for h in range(HEADS)]
    keys = [_rope(k[h * d : (h + 1) * d], position) for h in range(KV_HEADS)]
    values = [v[h * d : (h + 1) * d] for h in range(KV_HEADS)]
    residual = normed_hidden if norm_before_residual else hidden
    return queries, keys, values, residual


def _layer_output(p, queries, visible, residual):
    """visible: list of (keys per kv head, values per kv head) this query may attend to."""
    heads_out = []
    for h in range(HEADS):
        kv = h // (HEADS // KV_HEADS)
        scores = torch.stack([queries[h] @ keys[kv] / math.sqrt(len(queries[h])) for keys, _ in visible])
        weights = torch.softmax(scores, dim=0)
        heads_out.append(sum(weights[i] * values[kv] for i, (_, values) in enumerate(visible)))
    mid = residual + p["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads_out)
    x = _rms(mid, p["midlayer.post_attention_layernorm.weight"])
    gate, up = p["midlayer.mlp.gate_proj.weight"] @ x, p["midlayer.mlp.up_proj.weight"] @ x
    return mid + p["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)


def _naive(p, target, docs, steps, decay, mask_outside, norm_before_residual, full_argmax=True):
    """full_argmax=False: accuracy against the teacher's best draft-vocab token instead of its full argmax."""
    draft_ids = [i + int(target["d2t"][i]) for i in range(VD)]
    ce_sum = [0.0] * steps
    weight = [0] * steps
    correct = [0] * steps
    count = [0] * steps
    for doc in docs:
        ids, n = doc["ids"].tolist(), len(doc["ids"])
        teacher = []
        for pos in range(n):
            full = torch.softmax(target["lm_head"] @ _rms(doc["last"][pos], target["norm"]), dim=0)
            restricted = full[draft_ids] / full[draft_ids].sum()
            best = int(full.argmax()) if full_argmax else draft_ids[int(restricted.argmax())]
            teacher.append((restricted, best))
        fused = [p["fc.weight"] @ doc["aux"][pos] for pos in range(n)]
        keys, values, outputs = {}, {}, {}
        chain = [True] * n  # steps so far at t all weighted and correct
        for k in range(steps):
            positions = [t for t in range(n) if t + 1 + k < n]  # the input token x_{t+1+k} exists
            queries, residuals = {}, {}
            for t in positions:  # every key of this step first: later positions read earlier ones
                hidden = fused[t] if k == 0 else outputs[k - 1, t]
                embed = p["embed_tokens.weight"][ids[t + 1 + k]]
                queries[t], keys[k, t], values[k, t], residuals[t] = _layer_inputs(
                    p, embed, hidden, t + k, norm_before_residual
                )
            for t in positions:
                visible = [(keys[0, s], values[0, s]) for s in range(t + 1)]
                visible += [(keys[j, t], values[j, t]) for j in range(1, k + 1)]
                outputs[k, t] = _layer_output(p, queries[t], visible, residuals[t])
            for t in range(n):
                target_pos = t + 1 + k
                weighted = t + 2 + k < n and bool(doc["loss_mask"][t + 2 + k])
                if weighted and mask_outside:  # always against the full argmax
                    full = torch.softmax(
                        target["lm_head"] @ _rms(doc["last"][target_pos], target["norm"]), dim=0
                    )
                    weighted = bool(target["t2d"][int(full.argmax())])
                if not weighted:
                    chain[t] = False
                    continue
                restricted, target_argmax = teacher[target_pos]
                logits = p["lm_head.weight"] @ _rms(outputs[k, t], p["norm.weight"])
                ce_sum[k] = ce_sum[k] - (restricted * torch.log_softmax(logits, dim=0)).sum()
                weight[k] += 1
                right = draft_ids[int(logits.argmax())] == target_argmax
                if chain[t]:
                    count[k] += 1
                    correct[k] += int(right)
                chain[t] = chain[t] and right
    step_losses = [
        ce_sum[k] / weight[k] if weight[k] else torch.zeros((), dtype=torch.float64) for k in range(steps)
    ]
    loss = sum(decay**k * step_losses[k] for k in range(steps))
    return loss, step_losses, weight, correct, count


# ---------------------------------------------------------------- the comparison


def _compare(
    lengths,
    steps,
    decay,
    mask_outside,
    norm_before_residual=False,
    lm_head_trainable=True,
    seed=0,
    prompt=0.0,
    full_argmax=True,
    **options,
):
    """ttt_forward (with `options`, e.g. fused_loss, attention) against the naive reference."""
    gen = torch.Generator().manual_seed(seed)
    target = _target(gen)
    head = _head(target, gen, norm_before_residual, lm_head_trainable)
    docs = _documents(lengths, gen, prompt)
    out = ttt_forward(
        head,
        _pack(docs),
        target_norm_weight=target["norm"],
        target_norm_eps=EPS,
        target_lm_head=target["lm_head"],
        ttt_steps=steps,
        step_loss_decay=decay,
        mask_outside_draft_vocab=mask_outside,
        chunk_tokens=4,
        full_vocab_argmax=full_argmax,
        **options,
    )
    out.loss.backward()

    params = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in head.named_parameters()}
    loss, step_losses, weight, correct, count = _naive(
        params, target, docs, steps, decay, mask_outside, norm_before_residual, full_argmax
    )
    if loss.requires_grad:  # False when no position of the row carries weight
        loss.backward()

    torch.testing.assert_close(out.loss, loss, **TOL)
    torch.testing.assert_close(out.step_losses, torch.stack(step_losses).detach(), **TOL)
    assert out.step_weight_sums.tolist() == weight
    assert out.step_correct.tolist() == correct
    assert out.step_counts.tolist() == count
    for name, param in head.named_parameters():
        if not param.requires_grad:
            assert param.grad is None and params[name].grad is None, name
            continue
        expected = params[name].grad if params[name].grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(param.grad, expected, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    return out


@pytest.mark.parametrize("mask_outside", [False, True])
@pytest.mark.parametrize("decay", [1.0, 0.8])
@pytest.mark.parametrize("steps", [1, 3, 5])
@pytest.mark.parametrize(
    "lengths", [(9,), (5, 1, 7), (2, 3, 1, 4)], ids=["one_doc", "docs_5_1_7", "docs_shorter_than_k"]
)
def test_packed_ttt_matches_naive_reference(lengths, steps, decay, mask_outside) -> None:
    _compare(lengths, steps, decay, mask_outside, seed=steps + 10 * len(lengths) + int(mask_outside))


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("lm_head_trainable", [False, True])
def test_reference_with_residual_variants_and_frozen_lm_head(norm_before_residual, lm_head_trainable) -> None:
    _compare((6, 8), 3, 0.8, False, norm_before_residual, lm_head_trainable, seed=5)


def test_reference_exercises_the_accuracy_chain() -> None:
    """Guard on the reference itself: a case where later steps count and some of them are correct."""
    out = _compare((12, 10), 3, 1.0, False, seed=0)
    assert out.step_counts[0] > out.step_counts[1] > out.step_counts[2] > 0
    assert out.step_correct[1] > 0


@pytest.mark.parametrize("lm_head_trainable", [False, True])
@pytest.mark.parametrize("mask_outside", [False, True])
@pytest.mark.parametrize("steps", [1, 3])
def test_fused_loss_matches_naive_reference(steps, mask_outside, lm_head_trainable) -> None:
    """lm_head + soft cross-entropy chunked in one autograd function (chunk_tokens=4 cuts the rows)."""
    _compare(
        (9, 5, 7), steps, 0.8, mask_outside, lm_head_trainable=lm_head_trainable, seed=steps, fused_loss=True
    )


@pytest.mark.parametrize("fused_loss", [False, True])
def test_steps_past_every_document_match_naive_reference(fused_loss) -> None:
    """K=5 over documents of 3-4 tokens: the last steps have no positions left; they add nothing, the rest trains."""
    out = _compare((4, 3, 4), 5, 0.8, False, seed=4, fused_loss=fused_loss)
    assert out.step_counts[0] > 0 and out.step_counts[-1] == 0


@pytest.mark.parametrize("fused_loss", [False, True])
def test_teacher_restricted_to_the_draft_vocab_matches_naive_reference(fused_loss) -> None:
    """Accuracies against the best draft-vocab token: the teacher never multiplies by the other rows."""
    out = _compare((12, 10), 3, 1.0, False, seed=0, full_argmax=False, fused_loss=fused_loss)
    assert out.step_correct[0] > 0


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_prompt_positions_are_skipped_with_the_same_result(steps) -> None:
    """Long prompts (loss mask 0): those positions run step 0's keys only; loss and gradients are unchanged."""
    _compare((14, 3, 11), steps, 0.8, False, seed=steps, prompt=0.5)
    _compare((14, 3, 11), steps, 0.8, False, seed=steps, prompt=0.5, fused_loss=True)


def _dense_flex(q, k, v, block_mask, scale, compiled):
    """flex_attention's contract in dense autograd math over its mask_mod (flex has no CPU backward)."""
    from torch.nn.attention.flex_attention import create_mask

    mask = create_mask(block_mask.mask_mod, None, None, q.shape[2], k.shape[2], device=q.device)[0, 0]
    groups = q.shape[1] // k.shape[1]
    scores = (scale * q @ k.repeat_interleave(groups, 1).transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.repeat_interleave(groups, 1), torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_flex_path_matches_naive_reference(monkeypatch, steps) -> None:
    """The GPU attention path (block mask, padding, lse merge of the diagonal), its kernel in dense math."""
    monkeypatch.setattr(ttt_flex, "_flex_with_lse", _dense_flex)
    _compare((9, 5, 7), steps, 0.8, False, seed=steps, prompt=0.3, attention="flex", fused_loss=True)


def test_flex_kernel_forward_matches_naive_reference() -> None:
    """The real flex_attention (eager, forward only on CPU) gives the reference loss."""
    gen = torch.Generator().manual_seed(3)
    target = _target(gen)
    head = _head(target, gen, False, False)
    docs = _documents((9, 5, 7), gen, 0.3)
    with torch.no_grad():
        out = ttt_forward(
            head, _pack(docs), target_norm_weight=target["norm"], target_norm_eps=EPS,
            target_lm_head=target["lm_head"], ttt_steps=3, step_loss_decay=0.8, attention="flex", fused_loss=True,
        )  # fmt: skip
    params = {name: t.detach() for name, t in head.named_parameters()}
    loss, *_ = _naive(params, target, docs, 3, 0.8, False, False)
    torch.testing.assert_close(out.loss, loss, **TOL)


def test_auto_attention_takes_flex_only_where_its_kernels_run() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_attention("auto", cuda, 128) == select_attention("auto", cuda, CUDA_HEAD_DIM) == "flex"
    assert select_attention("auto", cuda, CUDA_HEAD_DIM - 1) == "sdpa"  # below the kernels' minimum head size
    assert select_attention("auto", cuda, 24) == "flex"  # not a power of two: padded inside the kernel
    assert select_attention("auto", cpu, 128) == "sdpa"
    assert select_attention("flex", cpu, HEAD_DIM) == "flex"  # eager, forward only (see the kernel test)
    assert select_attention("sdpa", cuda, 128) == "sdpa"
    with pytest.raises(ConfigError, match=r"trainer\.attention=flex: .*head_dim >= 16, the draft head has 8"):
        select_attention("flex", cuda, 8)
    with pytest.raises(ConfigError, match="not one of"):
        select_attention("flash", cpu, 128)


@functools.cache
def _cuda_case(steps: int, head_dim: int):
    """Head, target, documents and the naive reference's loss and gradients, computed once per case."""
    gen = torch.Generator().manual_seed(steps)
    target = _target(gen)
    head = _head(target, gen, False, True, head_dim)
    # 162 tokens, a document longer than one 128-token block: neither is a multiple of flex's block.
    docs = _documents((9, 3, 150), gen, 0.3)
    params = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in head.named_parameters()}
    loss, *_ = _naive(params, target, docs, steps, 0.8, False, False)
    loss.backward()
    return head, target, docs, loss.detach(), {name: p.grad for name, p in params.items()}


def test_the_gpu_case_holds_on_cpu() -> None:
    """The reference at the GPU case's head size, against the float64 CPU path: a GPU failure is the GPU's."""
    head, target, docs, loss, grads = _cuda_case(3, CUDA_HEAD_DIM)
    head = copy.deepcopy(head)  # the cached case stays as it is
    out = ttt_forward(
        head, _pack(docs), target_norm_weight=target["norm"], target_norm_eps=EPS,
        target_lm_head=target["lm_head"], ttt_steps=3, step_loss_decay=0.8, attention="sdpa", fused_loss=True,
    )  # fmt: skip
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), loss, **TOL)
    for name, param in head.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(
                param.grad, grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}"
            )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("autocast", "tol"), [(False, 1e-4), (True, 5e-2)], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize(
    ("attention", "compile", "head_dim"),
    [
        ("flex", False, CUDA_HEAD_DIM),
        ("sdpa", False, HEAD_DIM),
        ("flex", True, CUDA_HEAD_DIM),
        ("auto", False, HEAD_DIM),
    ],
    ids=["flex", "sdpa", "compiled", "auto_small_head"],
)
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_cuda_matches_naive_reference(steps, attention, compile, head_dim, autocast, tol) -> None:
    """The GPU paths (flex kernel or masked SDPA, fused loss, optionally compiled) against the float64 reference;
    "auto" with a head too small for flex's kernels runs SDPA."""
    head, target, docs, loss, grads = _cuda_case(steps, head_dim)
    cuda_head = Eagle3DraftHead(
        _draft_config(False, head_dim), target_hidden_size=H, vocab_size=V, draft_vocab_size=VD
    )
    cuda_head.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in head.state_dict().items()}
    )
    cuda_head.cuda()
    batch = {k: (v.float() if v.is_floating_point() else v).cuda() for k, v in _pack(docs).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = ttt_forward(
            cuda_head, batch, target_norm_weight=target["norm"].float().cuda(), target_norm_eps=EPS,
            target_lm_head=target["lm_head"].float().cuda(), ttt_steps=steps, step_loss_decay=0.8,
            attention=attention, compile=compile,
        )  # fmt: skip
    out.loss.backward()
    torch.testing.assert_close(out.loss.double().cpu(), loss, rtol=tol, atol=tol)
    for name, param in cuda_head.named_parameters():
        if param.requires_grad:
            want = grads[name]
            got = param.grad.double().cpu()
            assert (got - want).norm() <= tol * want.norm() + 1e-6, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_flex_refuses_a_head_below_its_kernels_minimum() -> None:
    head, target, docs, *_ = _cuda_case(1, HEAD_DIM)
    batch = {k: (v.float() if v.is_floating_point() else v).cuda() for k, v in _pack(docs).items()}
    with pytest.raises(ConfigError, match=r"head_dim >= 16"):
        ttt_forward(
            copy.deepcopy(head).float().cuda(), batch, target_norm_weight=target["norm"].float().cuda(), target_norm_eps=EPS,
            target_lm_head=target["lm_head"].float().cuda(), ttt_steps=1, step_loss_decay=1.0, attention="flex",
        )  # fmt: skip


@pytest.mark.e2e
def test_compiled_layer_matches_naive_reference() -> None:
    """compile=True: the layer's pieces through torch.compile (inductor's CPU backend here), same values."""
    _compare((9, 5, 7), 3, 0.8, False, seed=3, prompt=0.3, compile=True, fused_loss=True)


@pytest.fixture
def eager_backend_compile(monkeypatch):
    """torch.compile with the eager backend: dynamo traces, caches and guards as usual, without inductor's codegen."""

    def forget_compiled() -> None:
        for cached in (ttt_module._compiled, kd_loss_module._compiled_chunk_terms):
            cached.cache_clear()
        torch._dynamo.reset()

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    forget_compiled()
    yield
    monkeypatch.undo()  # before forgetting: later tests compile with inductor again
    forget_compiled()


def test_compiled_pieces_stay_within_the_recompile_limit(eager_backend_compile) -> None:
    """Batches of new sizes, then no-grad (validation) passes, at K=5: every piece keeps its own compile cache, so
    none reaches torch.compile's recompile limit (with one cache shared by the pieces, this sequence did)."""
    gen = torch.Generator().manual_seed(5)
    target = _target(gen)
    head = _head(target, gen, False, True)

    def forward(lengths: tuple[int, ...]):
        return ttt_forward(
            head, _pack(_documents(lengths, gen, 0.3)), target_norm_weight=target["norm"], target_norm_eps=EPS,
            target_lm_head=target["lm_head"], ttt_steps=5, step_loss_decay=0.8, chunk_tokens=4, compile=True,
            fused_loss=True,
        )  # fmt: skip

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for lengths in [(9, 8, 7), (10, 11), (12, 8, 10, 9)]:
            forward(lengths).loss.backward()
        with torch.no_grad():
            forward((10, 9))
            forward((8, 13, 9))
