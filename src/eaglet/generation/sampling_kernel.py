"""eaglet.generation.sampling's nucleus sampling as one Triton kernel: no sort, no [rows, vocab] temporaries.

Sorting every row of the logits to find its nucleus, and hashing a noise value per vocabulary entry in
separate tensor operations, cost more than the rest of a small target's decode step. Here one program per
row reads the row a few times instead. A token is in the nucleus when the probability mass strictly above it
is at most top_p (the sorted prefix the reference keeps, up to probabilities equal within float32 rounding),
and the pick is the Gumbel-max over the nucleus with the reference's counter-based noise (same hash, same
bits), so a row samples what the reference samples except where two candidates' scores agree to the last bits
of float32. Two ways to find it:
- "reject" (the default): one pass takes the online softmax and the Gumbel-max over the whole vocabulary; each
  further pass measures the mass above the candidate and, in the same read, the Gumbel-max among the tokens more
  probable than it. A candidate with at most top_p above it is in the nucleus, and no token of the nucleus
  scores higher (those that do are less probable than a rejected candidate, so outside). The first candidate,
  a sample of the whole distribution, lies in the nucleus at least top_p of the time (99% of SmolLM2's rows
  at top_p 0.95), so a row takes about two passes.
- "search": the online softmax, then SPLITS thresholds a pass for PASSES passes narrowing the nucleus's edge,
  then the pick: eleven passes, whatever the row.
"""

from __future__ import annotations

import logging

import torch

try:  # Triton ships with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

log = logging.getLogger(__name__)

# Passes of the threshold search, each cutting [low, high] into SPLITS + 1 parts: 9**9 > 2**28, past what
# float32 resolves between 0 and the largest probability.
_PASSES = 9
_SPLITS = 8
# Tuned on an H200 at [1024, 49152] bf16, top_p 0.95 (2026-12-03): 2048 x 4 warps 1.13 ms, 1024 x 8 warps
# 1.66 ms, the same picks; more splits per pass (16 x 7, 32 x 6, 64 x 5) were slower.
_BLOCK = 2048
_WARPS = 4


def kernel_applies(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1


METHODS = ("reject", "search")
# The method sample_rows uses unless told: "search" from the first time "reject" fails to compile.
default_method = "reject"


def sample_rows(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    method: str | None = None,
) -> torch.Tensor:
    """Token ids [rows] sampled as eaglet.generation.sampling.pick_next samples them (temperature > 0), by
    `method` (one of METHODS; None: `default_method`)."""
    global default_method
    chosen = method or default_method
    if chosen not in METHODS:
        raise ValueError(f"unknown sampling method {chosen!r}; the methods are {', '.join(METHODS)}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    args = (logits, seeds, steps, out, vocab, logits.stride(0), float(temperature), float(top_p))
    if chosen == "reject":
        try:
            _reject_kernel[(rows,)](*args, USE_TOP_P=top_p < 1.0, BLOCK=_BLOCK, num_warps=_WARPS)
            return out
        except Exception as error:  # a compiler that rejects its loop: the search samples the same tokens
            if method is not None:
                raise
            log.warning("nucleus sampling by rejection failed (%s: %s); searching the threshold instead",
                        type(error).__name__, error)  # fmt: skip
            default_method = "search"
    _sample_kernel[(rows,)](
        *args, USE_TOP_P=top_p < 1.0, PASSES=_PASSES, SPLITS=_SPLITS, BLOCK=_BLOCK, num_warps=_WARPS
    )
    return out


if triton is not None:

    @triton.jit
    def _mix32(x):
        """sampling._mix32 on uint32: products wrap modulo 2**32, as the reference's masked int64 products do."""
        x = x ^ (x >> 16)
        x = x * 0x21F0AAAD
        x = x ^ (x >> 15)
        x = x * 0x735A2D97
        return x ^ (x >> 15)

    @triton.jit
    def _softmax_step(best, total, x):
        """The online softmax's largest score and sum of exp(score - largest), per lane, after scores `x`."""
        new_best = tl.maximum(best, x)
        # A lane that has seen only -inf (past the vocabulary's end) keeps 0: exp(-inf - -inf) is NaN.
        rescale = tl.where(new_best > float("-inf"), tl.exp(best - new_best), 0.0)
        return new_best, total * rescale + tl.where(x > float("-inf"), tl.exp(x - new_best), 0.0)

    @triton.jit
    def _argmax_step(score, start, pick, pick_score):
        """The running argmax (first index on ties) after the block of `score` that begins at `start`."""
        block_best = tl.max(score, 0)
        better = block_best > pick_score
        return tl.where(better, start + tl.argmax(score, 0), pick), tl.where(better, block_best, pick_score)

    @triton.jit
    def _row_stream(SEEDS, STEPS, row):
        """The row's noise stream: sampling.gumbel_noise's hash of its (seed, step)."""
        seed = tl.load(SEEDS + row).to(tl.uint32)
        step = tl.load(STEPS + row).to(tl.uint32)
        return _mix32(_mix32(seed) ^ step)

    @triton.jit
    def _minus_log(u):
        """-log(u) for u in (0, 1) to float32's precision, near u = 1 too.

        tl.log may compile to the hardware's approximate log2, whose error is absolute (~1e-7): near u = 1, where
        -log(u) is ~1e-7 itself, the Gumbel noise of the most likely winners came out percents off, and ~1% of
        rows over a 128K vocabulary picked another token than the reference. There -log(u) = 2 atanh(z) with
        z = v / (2 - v), v = 1 - u (exact), summed as a series to z**9: z <= 1/7 keeps it within float32's
        rounding.
        """
        v = 1.0 - u
        z = v / (2.0 - v)
        z2 = z * z
        series = 2.0 * z * (1.0 + z2 * (1.0 / 3.0 + z2 * (0.2 + z2 * (1.0 / 7.0 + z2 * (1.0 / 9.0)))))
        return tl.where(v < 0.25, series, -tl.log(u))

    @triton.jit
    def _gumbel_scores(raw, ids, temperature, stream):
        """Each token's Gumbel-max score: its logit over the temperature plus its noise (sampling.gumbel_noise)."""
        bits = _mix32(_mix32(stream ^ ids.to(tl.uint32)))
        uniform = ((bits >> 9).to(tl.float32) + 0.5) * (2.0**-23)  # sampling.uniform_from_bits
        return tl.math.div_rn(raw, temperature) - tl.log(_minus_log(uniform))

    @triton.jit
    def _sample_kernel(
        LOGITS, SEEDS, STEPS, OUT, vocab, stride, temperature, top_p,
        USE_TOP_P: tl.constexpr, PASSES: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = LOGITS + row.to(tl.int64) * stride
        offsets = tl.arange(0, BLOCK)
        # Online softmax: the largest score and the sum of exp(score - largest).
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            ids = start + offsets
            raw = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
            best, total = _softmax_step(best, total, tl.math.div_rn(raw, temperature))
        top = tl.max(best, 0)
        norm = tl.sum(tl.where(best > float("-inf"), total * tl.exp(best - top), 0.0), 0)
        cut = -1.0
        # The probabilities the search and the final test compare: one formula for both, so the token at the
        # nucleus edge falls on the same side of the threshold in each.
        inverse = 1.0 / temperature
        if USE_TOP_P:
            # The mass of the probabilities above t falls as t grows; the nucleus is every probability above
            # the largest t whose mass above still exceeds top_p. Each pass over the row measures the mass at
            # SPLITS thresholds at once, narrowing [low, high] (mass above low > top_p >= mass above high)
            # SPLITS + 1 times.
            low = 0.0
            high = 1.0 / norm
            splits = tl.arange(0, SPLITS)
            for _ in range(PASSES):
                width = (high - low) / (SPLITS + 1)
                thresholds = low + width * (splits + 1).to(tl.float32)
                mass = tl.zeros([SPLITS], tl.float32)
                for start in range(0, vocab, BLOCK):
                    ids = start + offsets
                    x = tl.load(base + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
                    p = tl.exp(x * inverse - top) / norm
                    mass += tl.sum(tl.where(p[None, :] > thresholds[:, None], p[None, :], 0.0), 1)
                above = tl.sum((mass > top_p).to(tl.int32), 0)  # thresholds are ascending, mass descending
                new_low = low + width * above.to(tl.float32)
                high = low + width * (above + 1).to(tl.float32)
                low = new_low
            cut = low
        stream = _row_stream(SEEDS, STEPS, row)
        pick_score = float("-inf")
        pick = 0
        for start in range(0, vocab, BLOCK):
            ids = start + offsets
            inside = ids < vocab
            raw = tl.load(base + ids, mask=inside, other=float("-inf")).to(tl.float32)
            score = _gumbel_scores(raw, ids, temperature, stream)
            kept = inside & (tl.exp(raw * inverse - top) / norm > cut)
            score = tl.where(kept, score, float("-inf"))
            pick, pick_score = _argmax_step(score, start, pick, pick_score)
        tl.store(OUT + row, pick.to(tl.int64))

    @triton.jit
    def _reject_kernel(
        LOGITS, SEEDS, STEPS, OUT, vocab, stride, temperature, top_p, USE_TOP_P: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        row = tl.program_id(0)
        base = LOGITS + row.to(tl.int64) * stride
        offsets = tl.arange(0, BLOCK)
        stream = _row_stream(SEEDS, STEPS, row)
        # One pass: the online softmax (largest score, sum of exp(score - largest)) and the Gumbel-max of all.
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        pick_score = float("-inf")
        pick = 0
        for start in range(0, vocab, BLOCK):
            ids = start + offsets
            inside = ids < vocab
            raw = tl.load(base + ids, mask=inside, other=float("-inf")).to(tl.float32)
            best, total = _softmax_step(best, total, tl.math.div_rn(raw, temperature))
            score = tl.where(inside, _gumbel_scores(raw, ids, temperature, stream), float("-inf"))
            pick, pick_score = _argmax_step(score, start, pick, pick_score)
        if USE_TOP_P:
            top = tl.max(best, 0)
            norm = tl.sum(tl.where(best > float("-inf"), total * tl.exp(best - top), 0.0), 0)
            # The probabilities every comparison uses: one formula, as in the search kernel.
            inverse = 1.0 / temperature
            mass = top_p + 1.0
            while mass > top_p:
                edge = tl.exp(tl.load(base + pick).to(tl.float32) * inverse - top) / norm
                mass = 0.0
                next_score = float("-inf")
                next_pick = pick
                for start in range(0, vocab, BLOCK):
                    ids = start + offsets
                    inside = ids < vocab
                    raw = tl.load(base + ids, mask=inside, other=float("-inf")).to(tl.float32)
                    p = tl.exp(raw * inverse - top) / norm
                    above = inside & (p > edge)
                    mass += tl.sum(tl.where(above, p, 0.0), 0)
                    score = tl.where(above, _gumbel_scores(raw, ids, temperature, stream), float("-inf"))
                    next_pick, next_score = _argmax_step(score, start, next_pick, next_score)
                # More than top_p above the candidate: it and every token as unlikely are outside the nucleus.
                pick = tl.where(mass > top_p, next_pick, pick)
        tl.store(OUT + row, pick.to(tl.int64))
