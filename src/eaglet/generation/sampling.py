"""Next-token choice: greedy, or nucleus sampling whose randomness belongs to the row, not to the batch.

Sampling draws its noise from a counter-based hash of (row seed, token index, vocabulary id) and picks by the
Gumbel-max trick, so a row samples the same tokens whichever rows share its batch, in whatever order rows
join: a resumed or re-batched run samples what an uninterrupted one does. A shared `torch.Generator` would
tie every sample to the batch composition. On CUDA one kernel does all of it (eaglet.generation.sampling_kernel).
"""

from __future__ import annotations

import torch

from eaglet.generation import sampling_kernel

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int64 values in [0, 2**32).

    The multipliers are below 2**31, so no product overflows int64.
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, vocab], a pure function of each row's (seed, step) and the vocabulary id."""
    row = _mix32(_mix32(seeds & _MASK32) ^ (steps & _MASK32))
    ids = torch.arange(vocab, device=seeds.device)
    return -torch.log(-torch.log(uniform_from_bits(_mix32(_mix32(row[:, None] ^ ids)))))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) from 32 hashed bits: their top 23, which float32 holds exactly with the half step.

    With 24 bits, (k + 0.5) needs 25: the largest k rounded to u = 1, infinite noise, and a token drawn whatever its
    probability (on ~0.3% of rows over a 49K vocabulary, 2**-24 a token).
    """
    return ((bits >> 9).float() + 0.5) * 2.0**-23


def pick_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """Token ids [rows]: argmax when temperature is 0, else a sample of the top-p nucleus at `temperature`.

    `seeds` and `steps` (int64 [rows]) name each row's random stream and the index of the token being drawn.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    if sampling_kernel.kernel_applies(logits):  # the same choice without sorting (CUDA)
        return sampling_kernel.sample_rows(
            logits, temperature=temperature, top_p=top_p, seeds=seeds, steps=steps
        )
    scores = logits.float() / temperature
    noisy = scores + gumbel_noise(seeds, steps, scores.shape[-1])
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays). The mask goes on after
        # the noise, so no noise value can bring a token back (-inf + inf is NaN, which argmax would pick).
        outside = torch.zeros_like(probs, dtype=torch.bool).scatter(
            -1, order, probs.cumsum(dim=-1) - probs > top_p
        )
        noisy = noisy.masked_fill(outside, float("-inf"))
    return noisy.argmax(dim=-1)
