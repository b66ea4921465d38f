"""linear_soft_cross_entropy (eager and compiled chunks) against soft_cross_entropy on explicit logits."""

from __future__ import annotations

import pytest
import torch

from eaglet.train.kd_loss import Teacher, linear_soft_cross_entropy, soft_cross_entropy


def _teacher(rows: int, vocab: int, generator: torch.Generator) -> Teacher:
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 3
    return Teacher(logits, torch.logsumexp(logits, dim=-1), logits.argmax(dim=-1))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_chunks_equal_the_explicit_loss(compiled: bool) -> None:
    g = torch.Generator().manual_seed(0)
    hidden_size, vocab = 16, 40
    teacher = _teacher(30, vocab, g)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    # Two calls of different sizes (the compiled chunk keeps one graph across them); ragged last chunks.
    for n, chunk in ((23, 8), (11, 4)):
        hidden = torch.randn(n, hidden_size, generator=g, dtype=torch.float64)
        rows = torch.randint(0, 30, (n,), generator=g)
        h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, argmax = linear_soft_cross_entropy(h1, w1, teacher, rows, chunk_tokens=chunk, compiled=compiled)
        (loss * 0.7).backward()

        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = h2 @ w2.T
        expected = soft_cross_entropy(teacher.log_probs(rows), logits).sum()
        (expected * 0.7).backward()

        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
        assert torch.equal(argmax, logits.argmax(dim=-1))
        torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-9, atol=1e-10)


def test_compiled_chunks_keep_the_compute_dtype_of_the_gradient() -> None:
    g = torch.Generator().manual_seed(1)
    teacher = _teacher(12, 24, g)
    teacher = Teacher(teacher.logits.bfloat16(), teacher.logsumexp.float(), teacher.argmax)
    hidden = torch.randn(12, 8, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(24, 8, generator=g).bfloat16()
    rows = torch.arange(12)
    eager, _ = linear_soft_cross_entropy(hidden, weight, teacher, rows, chunk_tokens=5)
    (grad_eager,) = torch.autograd.grad(eager, hidden)
    compiled, _ = linear_soft_cross_entropy(hidden, weight, teacher, rows, chunk_tokens=5, compiled=True)
    (grad_compiled,) = torch.autograd.grad(compiled, hidden)
    assert compiled.dtype == torch.float32 and grad_compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_compiled, grad_eager, rtol=2e-2, atol=2e-2)


def test_no_rows_give_a_zero_loss_and_zero_gradients() -> None:
    """A TTT step with no positions left (every document shorter than the step) still trains the others."""
    g = torch.Generator().manual_seed(2)
    teacher = _teacher(5, 12, g)
    hidden = torch.zeros(0, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 4, generator=g, dtype=torch.float64, requires_grad=True)
    loss, argmax = linear_soft_cross_entropy(
        hidden, weight, teacher, torch.zeros(0, dtype=torch.long), chunk_tokens=4
    )
    loss.backward()
    assert loss.item() == 0.0 and argmax.shape == (0,)
    assert hidden.grad.shape == (0, 4) and torch.equal(weight.grad, torch.zeros_like(weight))
