"""The generation engine against the reference decoder: same tokens, same sampling streams, same refills.

On CPU in float32 the two agree token for token (the engine's arithmetic is the target's own modules; only the
attention kernel differs, within float32 rounding). CUDA tests compare the Triton decode-attention kernel
with the plain reference, and the engine in bf16, graphs on and off, with the reference decoder.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eaglet.generation import DecodeSettings, Request, chosen_engine, decode_batch, decode_continuous
from eaglet.generation.decode_attention import decode_attention, reference_decode_attention
from eaglet.generation.packed_attention import packed_attention, reference_packed_attention
from eaglet.generation.prefill_graphs import GraphedPrefill, bucket_rows, bucket_width
from eaglet.generation.static_model import PackedPrompts, SlotDecoder, unsupported_reason
from eaglet.generation.work import packed_chunks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DIMS = {"vocab_size": 96, "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256}  # fmt: skip


def tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**DIMS, rope_theta=10000.0))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**DIMS, head_dim=16, rope_theta=10000.0))
    return model.eval()


class Conversations:
    """A work source like regeneration's: each finished answer may bring a follow-up request built from it."""

    def __init__(self, prompts: list[list[int]], turns: int) -> None:
        self.pending = [Request(p, seed=100 + i, tag=(i, 0)) for i, p in enumerate(prompts)]
        self.turns = turns
        self.answers: dict[tuple[int, int], list[int]] = {}

    def take(self, limit: int) -> list[Request]:
        taken, self.pending = self.pending[:limit], self.pending[limit:]
        return taken

    def finish(self, request: Request, tokens: list[int]) -> None:
        conv, turn = request.tag
        self.answers[(conv, turn)] = tokens
        if turn + 1 < self.turns:
            follow_up = [*request.prompt, *tokens, 7, 8 + turn]
            self.pending.append(Request(follow_up, seed=request.seed + 1000, tag=(conv, turn + 1)))


def run(model, engine: str, *, temperature: float = 0.0, top_p: float = 1.0, rows: int = 3, **extra):
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [9] * 20, [4, 4, 5, 6], list(range(10, 40))]
    source = Conversations(prompts, turns=2)
    settings = DecodeSettings(
        max_new_tokens=10, stop_ids=frozenset({3, 17}), pad_id=0, temperature=temperature, top_p=top_p,
        max_rows=rows, refill_every=4, engine=engine, max_context=128, **extra,
    )  # fmt: skip
    on_cpu = next(model.parameters()).device.type == "cpu"
    assert decode_continuous(model, source, settings) == rows or not on_cpu, "the rows decoded at once"
    return source.answers


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_answers_equal_the_reference_decoder(kind: str) -> None:
    model = tiny(kind)
    reference = run(model, "reference")
    assert len(reference) == 12 and any(0 < len(a) < 10 for a in reference.values()), (
        "stops must be exercised"
    )
    assert run(model, "engine") == reference
    # More rows than requests at once, and one row at a time: refills do not change an answer.
    assert run(model, "engine", rows=16) == reference
    assert run(model, "engine", rows=1) == reference
    # Prefills queued behind the window: the same answers, a window later.
    assert run(model, "engine", overlap_prefill=True) == reference
    assert run(model, "engine", rows=1, overlap_prefill=True) == reference
    # Prefills padded to bucket shapes (eagerly here; replayed from CUDA graphs on a GPU), padding rows in the
    # spare slot: no busy slot's cache is touched.
    assert run(model, "engine", prefill_graphs=True) == reference
    assert run(model, "engine", rows=5, prefill_graphs=True, overlap_prefill=True) == reference
    # Prompts packed end to end (attention prompt by prompt here), eagerly and through padded buckets.
    assert run(model, "engine", packed_prefill=True) == reference
    assert run(model, "engine", rows=5, packed_prefill=True, prefill_graphs=True) == reference
    assert (
        run(model, "engine", rows=16, packed_prefill=True, prefill_graphs=True, prefill_tokens=40)
        == reference
    )


def test_sampled_answers_follow_the_same_per_row_streams() -> None:
    model = tiny("llama", seed=1)
    reference = run(model, "reference", temperature=0.9, top_p=0.8)
    assert run(model, "engine", temperature=0.9, top_p=0.8) == reference
    assert run(model, "engine", temperature=0.9, top_p=0.8, rows=5) == reference
    assert run(model, "engine", temperature=0.9, top_p=0.8, rows=5, overlap_prefill=True) == reference
    assert run(model, "engine", temperature=0.9, top_p=0.8, rows=5, prefill_graphs=True) == reference
    assert run(model, "engine", temperature=0.9, top_p=0.8, rows=5, packed_prefill=True) == reference
    assert reference != run(model, "reference"), "sampling must differ from greedy here"


def test_prefill_buckets_round_up_by_at_most_half_the_width_and_to_a_power_of_two_rows() -> None:
    assert [bucket_width(w) for w in (1, 32, 33, 48, 49, 64, 65, 97, 1500, 1537)] == [
        32, 32, 48, 48, 64, 64, 96, 128, 1536, 2048,
    ]  # fmt: skip
    assert all(w <= bucket_width(w) < max(32, w) * 1.5 + 1 for w in range(1, 3000))
    assert [bucket_rows(r) for r in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 16, 1024]


def test_a_bucketed_prefill_gives_the_plain_prefills_logits_and_cache() -> None:
    model = tiny("llama")
    plain = SlotDecoder(model, slots=4, capacity=64)
    padded = SlotDecoder(model, slots=4, capacity=64, spare=1)
    bucketed = GraphedPrefill(padded, scratch=4, pad_id=0, graphs=False)
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 0, 0, 0], [13, 14, 15, 0, 0]])
    lengths, slots = torch.tensor([5, 2, 3]), torch.tensor([2, 0, 3])
    with torch.no_grad():
        want = plain.prefill(slots, ids, lengths)
        got = bucketed(slots, ids, lengths)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    assert (4, 32) in bucketed.buckets  # three rows ran as four, five columns as 32
    for layer in range(len(plain.keys)):
        for slot, length in zip(slots.tolist(), lengths.tolist(), strict=True):
            torch.testing.assert_close(
                padded.keys[layer][slot, :, :length], plain.keys[layer][slot, :, :length]
            )
        assert not padded.keys[layer][1].any(), "a slot no prompt went to was written"


def test_packed_prompts_list_each_tokens_slot_and_column() -> None:
    packed = PackedPrompts.build([[7, 8, 9], [4], [5, 6]], [2, 0, 5], torch.device("cpu"))
    assert packed.ids.tolist() == [7, 8, 9, 4, 5, 6]
    assert packed.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert packed.slots.tolist() == [2, 2, 2, 0, 5, 5]
    assert packed.starts.tolist() == [0, 3, 4, 6]
    assert packed.last.tolist() == [2, 3, 5]
    assert packed.longest == 3


def test_packed_chunks_hold_at_most_the_budgets_prompt_tokens() -> None:
    requests = [Request([1] * n) for n in (30, 20, 20, 50, 5, 1)]
    chunks = packed_chunks(requests, budget=50)
    assert [[len(r.prompt) for r in chunk] for chunk in chunks] == [[30, 20], [20], [50], [5, 1]]
    assert [r for chunk in chunks for r in chunk] == requests


def test_reference_packed_attention_is_each_prompts_causal_attention() -> None:
    torch.manual_seed(0)
    lengths = [5, 1, 7, 0, 3]
    query = torch.randn(sum(lengths), 6, 8)
    keys, values = torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = reference_packed_attention(query, keys, values, starts, scale=0.3)
    for begin, n in zip(starts.tolist(), lengths, strict=False):
        q = query[begin : begin + n].transpose(0, 1)
        k, v = (t[begin : begin + n].repeat_interleave(3, 1).transpose(0, 1) for t in (keys, values))
        scores = (q @ k.transpose(1, 2)) * 0.3
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(got[begin : begin + n], (scores.softmax(-1) @ v).transpose(0, 1))


@pytest.mark.parametrize("bucketed", [False, True])
def test_a_packed_prefill_gives_the_padded_prefills_logits_and_cache(bucketed: bool) -> None:
    model = tiny("qwen3")
    plain = SlotDecoder(model, slots=4, capacity=64)
    packed = SlotDecoder(model, slots=4, capacity=64, spare=1)
    prompts, slot_list = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]], [2, 0, 3]
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 0, 0, 0], [13, 14, 15, 0, 0]])
    lengths, slots = torch.tensor([5, 2, 3]), torch.tensor(slot_list)
    inputs = PackedPrompts.build(prompts, slot_list, torch.device("cpu"))
    with torch.no_grad():
        want = plain.prefill(slots, ids, lengths)
        if bucketed:  # ten tokens run as 32: 22 padding tokens in the spare slot
            got = GraphedPrefill(packed, scratch=4, pad_id=0, graphs=False).packed(inputs)
        else:
            got = packed.prefill_packed(inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer in range(len(plain.keys)):
        for slot, length in zip(slot_list, lengths.tolist(), strict=True):
            torch.testing.assert_close(
                packed.keys[layer][slot, :, :length], plain.keys[layer][slot, :, :length]
            )
            torch.testing.assert_close(
                packed.values[layer][slot, :, :length], plain.values[layer][slot, :, :length]
            )
        assert not packed.keys[layer][1].any(), "a slot no prompt went to was written"
        assert not packed.keys[layer][slot_list[0], :, 5:].any(), "columns past a prompt were written"


def test_a_packed_bucket_splits_its_padding_into_prompts_no_longer_than_a_slot() -> None:
    model = tiny("llama")
    plain = SlotDecoder(model, slots=5, capacity=8)
    packed = SlotDecoder(model, slots=5, capacity=8, spare=1)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13] * 8, [14, 15, 16, 17, 18, 19, 20, 21], [22] * 8, [23]]
    slots = [4, 0, 1, 2, 3]
    bucketed = GraphedPrefill(packed, scratch=5, pad_id=0, graphs=False)
    with torch.no_grad():
        got = bucketed.packed(PackedPrompts.build(prompts, slots, torch.device("cpu")))
        want = plain.prefill(
            torch.tensor(slots),
            torch.tensor([p + [0] * (8 - len(p)) for p in prompts]),
            torch.tensor([len(p) for p in prompts]),
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (bucket,) = bucketed.buckets.values()  # 33 tokens as 48: 15 padding tokens, as prompts of 8 and 7
    starts = bucket.inputs.starts.tolist()
    assert starts[:6] == [0, 8, 16, 24, 32, 33] and starts[6:8] == [41, 48] and set(starts[8:]) == {48}
    assert bucket.inputs.longest == 8


def test_a_prefill_graph_that_cannot_be_captured_leaves_the_prefills_eager(monkeypatch, caplog) -> None:
    model = tiny("llama")
    decoder = SlotDecoder(model, slots=2, capacity=64, spare=1)
    bucketed = GraphedPrefill(decoder, scratch=2, pad_id=0, graphs=True)

    def fail(bucket, forward) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bucketed, "_capture", fail)
    ids, lengths, slots = torch.tensor([[5, 6, 7]]), torch.tensor([3]), torch.tensor([1])
    with torch.no_grad():
        want = SlotDecoder(model, slots=2, capacity=64).prefill(slots, ids, lengths)
        got = bucketed(slots, ids, lengths)
        again = bucketed(slots, ids, lengths)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(again, want)
    assert not bucketed.graphs and "prefill graphs off" in caplog.text


def test_padding_rows_of_a_bucketed_prefill_leave_busy_slots_alone() -> None:
    # Prompts of one length prefill together: three rows run as a bucket of four, the fourth in the spare slot.
    model = tiny("llama", seed=2)
    prompts = [[5 + i, 9, 10 + i, 11, 12 + 2 * i] for i in range(7)]
    want = decode_batch(model, prompts, max_new_tokens=8, stop_ids={3}, pad_id=0, engine="reference")
    got = decode_batch(
        model,
        prompts,
        max_new_tokens=8,
        stop_ids={3},
        pad_id=0,
        engine="engine",
        max_rows=3,
        prefill_graphs=True,
    )
    assert got == want


def test_decode_batch_takes_the_engine_on_request() -> None:
    model = tiny("qwen3")
    prompts = [[1, 2, 3, 4], [8], [30, 31]]
    want = decode_batch(model, prompts, max_new_tokens=6, stop_ids={3}, pad_id=0, engine="reference")
    assert decode_batch(model, prompts, max_new_tokens=6, stop_ids={3}, pad_id=0, engine="engine") == want


def test_the_choice_of_decoder() -> None:
    llama = tiny("llama")
    assert chosen_engine(llama, "auto") == "reference"  # CPU: the reference decoder
    assert chosen_engine(llama, "engine") == "engine"
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)).eval()
    assert "model_type 'gpt2'" in unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="cannot run GPT2LMHeadModel: model_type 'gpt2'"):
        chosen_engine(gpt2, "engine")
    with pytest.raises(ValueError, match="unknown decoder 'fast'"):
        chosen_engine(llama, "fast")
    windowed = LlamaForCausalLM(LlamaConfig(**DIMS))
    windowed.config.model_type = "mistral"
    windowed.config.sliding_window = 16
    assert unsupported_reason(windowed) == "it uses sliding-window attention"


def test_a_request_longer_than_the_context_is_refused() -> None:
    source = Conversations([[1] * 125], turns=1)
    settings = DecodeSettings(
        max_new_tokens=10, stop_ids=frozenset({3}), pad_id=0, engine="engine", max_context=128
    )
    with pytest.raises(
        ValueError, match="a prompt of 125 tokens plus 10 new ones exceeds the engine's max_context 128"
    ):
        decode_continuous(tiny("llama"), source, settings)


def test_reference_attention_is_masked_scaled_dot_product_attention() -> None:
    """The plain version the kernel is checked against, against SDPA over each slot's visible columns."""
    torch.manual_seed(0)
    slots, heads, kv_heads, capacity, dim = 4, 6, 2, 40, 16
    query = torch.randn(slots, heads, dim, dtype=torch.float64)
    keys = torch.randn(slots, kv_heads, capacity, dim, dtype=torch.float64)
    values = torch.randn(slots, kv_heads, capacity, dim, dtype=torch.float64)
    lengths = torch.tensor([1, 17, 39, 40])
    got = reference_decode_attention(query, keys, values, lengths, 0.3)
    for slot, n in enumerate(lengths.tolist()):
        k = keys[slot, :, :n].repeat_interleave(heads // kv_heads, dim=0)
        v = values[slot, :, :n].repeat_interleave(heads // kv_heads, dim=0)
        want = F.scaled_dot_product_attention(query[slot, :, None], k, v, scale=0.3)[:, 0]
        torch.testing.assert_close(got[slot], want)


@cuda
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (32, 8, 128), (8, 8, 64)])
def test_the_kernel_matches_the_reference(heads: int, kv_heads: int, dim: int) -> None:
    torch.manual_seed(0)
    slots, capacity = 37, 300
    lengths = torch.randint(1, capacity + 1, (slots,), device="cuda")
    lengths[:4] = torch.tensor([1, 63, 64, 65])
    query = torch.randn(slots, heads, dim, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(slots, kv_heads, capacity, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(slots, kv_heads, capacity, dim, device="cuda", dtype=torch.bfloat16)
    # Columns past each length hold NaN: the kernel must never read them.
    past = torch.arange(capacity, device="cuda")[None, :] >= lengths[:, None]
    keys.masked_fill_(past[:, None, :, None], float("nan"))
    values.masked_fill_(past[:, None, :, None], float("nan"))
    got = decode_attention(query, keys, values, lengths, dim**-0.5)
    want = reference_decode_attention(
        query.double(), keys.nan_to_num().double(), values.nan_to_num().double(), lengths, dim**-0.5
    )
    error = (got.double() - want).norm() / want.norm()
    assert error < 1e-2, error


@cuda
def test_on_the_gpu_graphs_change_nothing_and_bf16_follows_the_reference() -> None:
    model = tiny("llama").cuda()
    assert chosen_engine(model, "auto") == "engine"
    fp32 = run(model, "reference")
    assert run(model, "engine", cuda_graphs=True) == fp32 == run(model, "engine", cuda_graphs=False)
    assert run(model, "engine", temperature=0.9, top_p=0.8) == run(
        model, "reference", temperature=0.9, top_p=0.8
    )
    model = model.to(torch.bfloat16)
    graphs, eager = run(model, "engine", rows=6), run(model, "engine", rows=6, cuda_graphs=False)
    assert graphs == eager


@cuda
def test_on_the_gpu_sampled_answers_are_the_cpu_reference_decoders() -> None:
    # On CUDA the Triton kernel samples, on the CPU torch's sorted nucleus: the same noise, so the same answers,
    # with the decode step compiled too (as regeneration runs it).
    reference = run(tiny("llama", seed=1), "reference", temperature=0.9, top_p=0.8)
    model = tiny("llama", seed=1).cuda()
    assert run(model, "engine", temperature=0.9, top_p=0.8, rows=5) == reference
    assert run(model, "engine", temperature=0.9, top_p=0.8, rows=5, compile=True) == reference


@cuda
def test_on_the_gpu_prefills_replayed_from_graphs_change_nothing() -> None:
    model = tiny("llama").cuda()
    reference = run(model, "reference")
    assert run(model, "engine", prefill_graphs=True) == reference
    assert run(model, "engine", rows=5, prefill_graphs=True, overlap_prefill=True) == reference
    sampled = run(model, "reference", temperature=0.9, top_p=0.8)
    assert run(model, "engine", temperature=0.9, top_p=0.8, rows=5, prefill_graphs=True) == sampled


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_variable_length_kernel_matches_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    lengths = [300, 1, 77, 0, 1024, 5]
    total = sum(lengths)
    query = torch.randn(total, 9, 64, device="cuda", dtype=dtype)
    keys, values = (torch.randn(total, 3, 64, device="cuda", dtype=dtype) for _ in range(2))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    got = packed_attention(query, keys, values, starts, longest=total, scale=0.125)
    want = reference_packed_attention(query.float(), keys.float(), values.float(), starts, scale=0.125)
    error = (got.float() - want).norm() / want.norm()
    assert error < 1e-2, error


@cuda
def test_on_the_gpu_packed_prefills_change_nothing() -> None:
    model = tiny("llama").cuda().to(torch.bfloat16)
    padded = run(model, "engine", rows=5, prefill_graphs=True, packed_prefill=False)
    assert run(model, "engine", rows=5, prefill_graphs=True) == padded  # packed: the default in bf16 on CUDA
    assert run(model, "engine", rows=5, prefill_graphs=False, packed_prefill=True) == padded
    sampled = run(
        model, "engine", temperature=0.9, top_p=0.8, rows=5, prefill_graphs=True, packed_prefill=False
    )
    assert run(model, "engine", temperature=0.9, top_p=0.8, rows=5, prefill_graphs=True) == sampled


@cuda
@pytest.mark.parametrize("method", ["reject", "search"])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("rows, vocab", [(512, 49152), (64, 777), (64, 128256)])
def test_the_sampling_kernel_picks_what_the_reference_picks(
    method: str, top_p: float, rows: int, vocab: int
) -> None:
    from eaglet.generation import sampling, sampling_kernel

    torch.manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda") * 3  # float32: bf16 ties would blur the nucleus edge
    seeds = torch.randint(0, 2**31, (rows,), device="cuda")
    steps = torch.randint(0, 600, (rows,), device="cuda")
    got = sampling_kernel.sample_rows(
        logits, temperature=0.7, top_p=top_p, seeds=seeds, steps=steps, method=method
    )
    logits, seeds, steps, got = logits.cpu(), seeds.cpu(), steps.cpu(), got.cpu()
    want = sampling.pick_next(logits, temperature=0.7, top_p=top_p, seeds=seeds, steps=steps)
    # Only near-ties may part (exp and log are not bit-equal between libraries): the two tokens' scores agree
    # to float32's last bits, or one of them lies at the nucleus edge (the mass above it is top_p, rounded).
    scores = logits / 0.7 + sampling.gumbel_noise(seeds, steps, vocab)
    probs = (logits / 0.7).softmax(-1)
    for row in (got != want).nonzero().flatten().tolist():
        pair = torch.tensor([got[row], want[row]])
        gap = (scores[row, pair[0]] - scores[row, pair[1]]).abs().item()
        above = [probs[row][probs[row] > probs[row, token]].sum().item() for token in pair]
        edge = min(abs(mass - top_p) for mass in above)
        assert gap < 1e-4 or edge < 1e-4, f"row {row}: {pair.tolist()}, score gap {gap}, mass above {above}"
    assert (got == want).float().mean() >= 0.99


def test_sampling_by_an_unknown_method_is_refused() -> None:
    from eaglet.generation import sampling_kernel

    with pytest.raises(ValueError, match="unknown sampling method 'sort'.*reject, search"):
        sampling_kernel.sample_rows(
            torch.zeros(2, 8),
            temperature=1.0,
            top_p=0.9,
            seeds=torch.zeros(2),
            steps=torch.zeros(2),
            method="sort",
        )


def test_a_rejection_kernel_that_fails_leaves_sampling_to_the_search(monkeypatch, caplog) -> None:
    from eaglet.generation import sampling_kernel

    launched = []

    class Kernel:
        def __init__(self, name: str, fails: bool) -> None:
            self.name, self.fails = name, fails

        def __getitem__(self, grid):
            def launch(*args, **kwargs) -> None:
                launched.append(self.name)
                if self.fails:
                    raise RuntimeError("PassManager::run failed")

            return launch

    monkeypatch.setattr(sampling_kernel, "default_method", "reject")
    monkeypatch.setattr(sampling_kernel, "_reject_kernel", Kernel("reject", fails=True), raising=False)
    monkeypatch.setattr(sampling_kernel, "_sample_kernel", Kernel("search", fails=False), raising=False)
    args = {"temperature": 0.7, "top_p": 0.9, "seeds": torch.zeros(2), "steps": torch.zeros(2)}
    sampling_kernel.sample_rows(torch.zeros(2, 8), **args)
    sampling_kernel.sample_rows(torch.zeros(2, 8), **args)
    assert launched == ["reject", "search", "search"]
    assert sampling_kernel.default_method == "search" and "searching the threshold instead" in caplog.text
    with pytest.raises(RuntimeError):  # asked for by name, a failure is not hidden
        sampling_kernel.sample_rows(torch.zeros(2, 8), method="reject", **args)


def test_slots_fit_the_free_memory_once_cached_blocks_are_released(monkeypatch) -> None:
    from eaglet.generation import engine

    model = tiny("llama")
    per_slot = SlotDecoder.cache_bytes(model, 1, 100)
    released = []
    # The allocator holds 300 slots' worth of freed blocks until empty_cache hands them back to the driver.
    free = {"bytes": 500 * per_slot}
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: (released.append(1), free.update(bytes=800 * per_slot))
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 10**12))
    gpu = torch.device("cuda", 0)
    # 0.8 of 800 slots' memory: 640, a multiple of SLOT_STEP (64) already.
    assert engine._fit_slots(model, 1024, 100, gpu) == 640 and released
    # Nearby amounts of free memory give the same count (one compiled decode step), never more than wanted.
    for slots in (810, 830, 879):
        free_bytes = slots * per_slot
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda b=free_bytes: free.update(bytes=b))
        assert engine._fit_slots(model, 1024, 100, gpu) == 640
    assert engine._fit_slots(model, 16, 100, gpu) == 16
    assert engine._fit_slots(model, 700, 100, gpu) == 700, "rounded only when fewer than wanted fit"
    # Fewer than one step: as many as fit.
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: free.update(bytes=50 * per_slot))
    assert engine._fit_slots(model, 1024, 100, gpu) == 40


def test_the_engines_summary_line_starts_a_line_of_its_own_under_a_progress_bar(capsys) -> None:
    from tqdm.auto import tqdm

    with tqdm(total=1, desc="regenerate", file=sys.stdout) as bar:
        run(tiny("llama"), "engine")
        bar.update(1)
    segments = capsys.readouterr().out.replace("\r", "\n").splitlines()
    assert any(s.startswith("generation engine: ") for s in segments)
