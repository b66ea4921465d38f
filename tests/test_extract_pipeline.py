"""The extraction loop that never makes the forward wait: mask-free right padding, batches packed on the device
and read on the host one forward later, reusable host buffers, shard writers that only wait on a byte budget,
and shards byte-identical to a plain sequential loop's."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglet.data.templating import TokenizedConversation
from eaglet.errors import DataError
from eaglet.extract import writer as writer_module
from eaglet.extract.plan import plan_batches, plan_shards, shard_batches
from eaglet.extract.transformers_backend import (
    HostBuffers,
    _launch,
    batch_features,
    right_padded,
    write_shards,
)
from eaglet.extract.writer import ShardWriterPool
from eaglet.shards import (
    MANIFEST_VERSION,
    Manifest,
    SequenceFeatures,
    ShardInfo,
    read_manifest,
    write_manifest,
    write_shard,
)
from eaglet.target_model import LoadedTarget, capture_hidden_states, find_target_parts

VOCAB, HIDDEN, LAYERS = 96, 32, 4
AUX_IDS = [1, 2, 3]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def as_target(model: LlamaForCausalLM, device: str = "cpu") -> LoadedTarget:
    """The model as extraction sees it; on another device, a copy (the module's fixture stays on the CPU)."""
    if device != "cpu":
        model = copy.deepcopy(model).to(device)
    return LoadedTarget(
        model=model,
        tokenizer=SimpleNamespace(pad_token_id=7),
        parts=find_target_parts(model),
        config_hash="test",
        tokenizer_hash="test",
        device=torch.device(device),
        dtype=next(model.parameters()).dtype,
    )


def make_samples(lengths: list[int], seed: int = 0) -> list[TokenizedConversation]:
    rng = np.random.default_rng(seed)
    return [
        TokenizedConversation(
            str(i), rng.integers(0, VOCAB, n).astype(np.int32), (np.arange(n) % 3 > 0).astype(np.uint8), False
        )
        for i, n in enumerate(lengths)
    ]


LENGTHS = [5, 23, 9, 17, 31, 2, 12, 40, 8, 19, 27, 3, 14]


def masked_features(
    target: LoadedTarget, samples: list[TokenizedConversation], batch: list[int], dtype: torch.dtype
) -> dict[int, SequenceFeatures]:
    """The extraction loop as it was: a padded, masked forward, cast, copied to the host, row by row."""
    width = max(samples[i].num_tokens for i in batch)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, i in enumerate(batch):
        input_ids[row, : samples[i].num_tokens] = torch.from_numpy(samples[i].input_ids.astype(np.int64))
        mask[row, : samples[i].num_tokens] = 1
    captured = capture_hidden_states(
        target.model, target.parts, input_ids.to(target.device), mask.to(target.device), AUX_IDS
    )
    aux, last = captured.aux_hidden_states.to(dtype).cpu(), captured.last_hidden_state.to(dtype).cpu()
    return {
        i: SequenceFeatures(
            i,
            torch.from_numpy(samples[i].input_ids),
            torch.from_numpy(samples[i].loss_mask),
            aux[row, : samples[i].num_tokens],
            last[row, : samples[i].num_tokens],
        )
        for row, i in enumerate(batch)
    }


def empty_manifest() -> Manifest:
    return Manifest(
        version=MANIFEST_VERSION, status="in_progress", target={}, aux_layer_ids=AUX_IDS, last_layer_id=LAYERS,
        last_hidden_pre_norm=True, hidden_size=HIDDEN, vocab_size=VOCAB, dtype="bfloat16",
        inputs_fingerprint="test",
    )  # fmt: skip


# --------------------------------------------------------------------------- the forward without a mask


def test_mask_free_right_padding_equals_the_masked_forward(llama: LlamaForCausalLM) -> None:
    """Under the causal mask real tokens never see the pads after them: the states at real positions are the
    masked forward's, at fp32, to rounding."""
    samples = make_samples([17, 4, 11, 1])
    input_ids, _, lengths = right_padded(samples, [0, 1, 2, 3], pad_id=7)
    mask = torch.zeros_like(input_ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    parts = find_target_parts(llama)
    masked = capture_hidden_states(llama, parts, input_ids, mask, AUX_IDS)
    free = capture_hidden_states(llama, parts, input_ids, None, AUX_IDS)
    for row, n in enumerate(lengths):
        for name in ("aux_hidden_states", "last_hidden_state"):
            torch.testing.assert_close(
                getattr(free, name)[row, :n], getattr(masked, name)[row, :n], rtol=1e-6, atol=1e-6
            )


def test_a_mask_given_is_still_checked(llama: LlamaForCausalLM) -> None:
    ids = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="right-padded"):
        capture_hidden_states(llama, find_target_parts(llama), ids, torch.tensor([[0, 1, 1, 1]]), AUX_IDS)


def test_right_padded_rows_and_the_real_tokens_flat_index() -> None:
    samples = make_samples([3, 5, 1])
    input_ids, positions, lengths = right_padded(samples, [2, 0, 1], pad_id=7)
    assert lengths == [1, 3, 5] and input_ids.shape == (3, 5) and input_ids.dtype == torch.long
    assert positions.tolist() == [0, 5, 6, 7, 10, 11, 12, 13, 14]
    for row, i in enumerate([2, 0, 1]):
        n = samples[i].num_tokens
        assert input_ids[row, :n].tolist() == samples[i].input_ids.tolist()
        assert (input_ids[row, n:] == 7).all()
    flat = np.concatenate([samples[i].input_ids for i in [2, 0, 1]])
    assert input_ids.flatten()[positions].tolist() == flat.tolist()


def test_shard_batches_run_every_shards_batches_in_order() -> None:
    plan = plan_shards(LENGTHS, 60)
    todo = [2, 0, 3]
    work = shard_batches(LENGTHS, plan, todo, 48)
    expected = [(index, batch) for index in todo for batch in plan_batches(LENGTHS, plan[index], 48)]
    assert work == expected
    assert sorted(i for _, batch in work for i in batch) == sorted(i for index in todo for i in plan[index])


# --------------------------------------------------------------------------- the pipelined loop on the host side


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_features_equal_the_masked_per_batch_forward_bit_for_bit(
    llama: LlamaForCausalLM, dtype: torch.dtype
) -> None:
    target = as_target(llama)
    samples = make_samples(LENGTHS)
    batches = plan_batches(LENGTHS, range(len(LENGTHS)), 64)
    assert len(batches) > 3
    got = list(batch_features(target, samples, batches, AUX_IDS, dtype))
    assert len(got) == len(batches)
    for batch, found in zip(batches, got, strict=True):
        assert list(found) == batch
        expected = masked_features(target, samples, batch, dtype)
        for i in batch:
            a, b = found[i], expected[i]
            assert a.sample_id == i and a.aux_hidden_states.dtype == dtype
            assert torch.equal(a.aux_hidden_states, b.aux_hidden_states)
            assert torch.equal(a.last_hidden_state, b.last_hidden_state)
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)


def test_the_next_forward_is_launched_before_a_batch_is_read(
    llama: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch i is collected only after batch i+1's forward was queued: the host's work overlaps the GPU's."""
    from eaglet.extract import transformers_backend

    events: list[str] = []
    launch = transformers_backend._launch

    class Logged:
        def __init__(self, in_flight, name: str) -> None:
            self.in_flight, self.name = in_flight, name

        def collect(self, samples):
            events.append(f"collect {self.name}")
            return self.in_flight.collect(samples)

    def logged(target, samples, batch, *args):
        events.append(f"launch {batch[0]}")
        return Logged(launch(target, samples, batch, *args), str(batch[0]))

    monkeypatch.setattr(transformers_backend, "_launch", logged)
    samples = make_samples([4, 4, 4])
    list(batch_features(as_target(llama), samples, [[0], [1], [2]], AUX_IDS, torch.bfloat16))
    assert events == ["launch 0", "launch 1", "collect 0", "launch 2", "collect 1", "collect 2"]


def test_host_buffers_are_reused_and_grow_for_a_larger_batch() -> None:
    buffers = HostBuffers(torch.bfloat16, tokens=10, pin=False)
    first = buffers.take(6, per_token=4)
    assert first.numel() == 40 and first.dtype == torch.bfloat16  # sized for the largest batch, not this one
    second = buffers.take(10, per_token=4)
    buffers.give(first)
    assert buffers.take(3, per_token=4).data_ptr() == first.data_ptr()  # the same memory, again
    buffers.give(first)
    buffers.give(second)
    grown = buffers.take(15, per_token=4)
    assert grown.numel() == 60 and grown.data_ptr() not in (first.data_ptr(), second.data_ptr())
    # the smaller buffers were dropped while looking for room; later batches get the grown size
    assert buffers.take(1, per_token=4).numel() == 60


def test_reserved_host_buffers_are_the_ones_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    buffers = HostBuffers(torch.bfloat16, tokens=10, pin=False)
    buffers.reserve(3, per_token=4)
    reserved = {b.data_ptr() for b in buffers._free}
    allocations = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocations.append(a) or empty(*a, **k))
    taken = [buffers.take(10, per_token=4) for _ in range(3)]
    assert {b.data_ptr() for b in taken} == reserved and not allocations  # nothing pinned once forwards run
    buffers.reserve(3, per_token=4)  # tops up to 3 free: the taken ones are still out
    assert len(buffers._free) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pipelined_shards_are_byte_identical_to_a_sequential_reference(
    llama: LlamaForCausalLM, tmp_path: Path, dtype: torch.dtype
) -> None:
    """write_shards (pipelined forwards, writer threads, opportunistic commits) writes the bytes and the manifest
    that the plain loop writes: masked forward, one batch at a time, one shard at a time, on this thread."""
    target = as_target(llama)
    samples = make_samples(LENGTHS, seed=1)
    shard_tokens, batch_tokens = 60, 48
    reference = tmp_path / "reference"
    reference.mkdir()
    expected = []
    for index, shard in enumerate(plan_shards(LENGTHS, shard_tokens)):
        features: dict[int, SequenceFeatures] = {}
        for batch in plan_batches(LENGTHS, shard, batch_tokens):
            features.update(masked_features(target, samples, batch, dtype))
        expected.append(write_shard(reference, index, [features[i] for i in shard], dtype))

    out = tmp_path / "pipelined"
    out.mkdir()
    manifest = empty_manifest()
    processed, kept = write_shards(
        target,
        samples,
        AUX_IDS,
        manifest,
        out,
        shard_tokens=shard_tokens,
        batch_tokens=batch_tokens,
        dtype=dtype,
    )
    assert processed == sum(LENGTHS) and kept == 0
    assert manifest.shards == expected and read_manifest(out).shards == expected
    assert len(expected) > 3
    for info in expected:
        assert (out / info.file).read_bytes() == (reference / info.file).read_bytes()

    # A damaged shard is written again, in place, to the same bytes; the others are kept.
    damaged = out / expected[1].file
    damaged.write_bytes(damaged.read_bytes()[:50])
    processed, kept = write_shards(
        target,
        samples,
        AUX_IDS,
        manifest,
        out,
        shard_tokens=shard_tokens,
        batch_tokens=batch_tokens,
        dtype=dtype,
    )
    assert kept == len(expected) - 1 and manifest.shards == expected
    assert damaged.read_bytes() == (reference / expected[1].file).read_bytes()


# --------------------------------------------------------------------------- the shard writers


class GatedWrites:
    """write_shard stand-in whose writes finish only once their gate opens."""

    def __init__(self) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.fail: set[int] = set()

    def gate(self, index: int) -> threading.Event:
        return self.gates.setdefault(index, threading.Event())

    def __call__(self, directory: Path, index: int, sequences, dtype) -> ShardInfo:
        assert self.gate(index).wait(30), f"shard {index} never released"
        if index in self.fail:
            raise DataError(f"shard {index} failed")
        return ShardInfo(f"shard-{index:05d}.safetensors", len(sequences), 1, 1, 1, f"{index}", index)


def features(tokens: int) -> list[SequenceFeatures]:
    """One sequence of 13 bytes a token (int32 id, uint8 mask, one fp32 aux value and one fp32 last value)."""
    return [SequenceFeatures(0, torch.zeros(tokens, dtype=torch.int32), torch.zeros(tokens, dtype=torch.uint8),
                             torch.zeros(tokens, 1, 1), torch.zeros(tokens, 1))]  # fmt: skip


def submit_in_thread(pool: ShardWriterPool, index: int, seqs: list[SequenceFeatures]) -> threading.Thread:
    thread = threading.Thread(target=pool.submit, args=(index, seqs), daemon=True)
    thread.start()
    return thread


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> GatedWrites:
    writes = GatedWrites()
    monkeypatch.setattr(writer_module, "write_shard", writes)
    return writes


def test_submit_waits_only_past_the_byte_budget(gated: GatedWrites, tmp_path: Path) -> None:
    manifest = empty_manifest()
    pool = ShardWriterPool(tmp_path, manifest, torch.bfloat16, workers=2, max_bytes=3 * 1300)
    for index in range(3):  # 3 x 1300 bytes in flight, none written yet: no wait, more shards than writers
        thread = submit_in_thread(pool, index, features(100))
        thread.join(5)
        assert not thread.is_alive()
    blocked = submit_in_thread(pool, 3, features(100))
    time.sleep(0.2)
    assert blocked.is_alive()  # 4 x 1300 bytes would be in flight: waits for the oldest
    gated.gate(0).set()
    blocked.join(5)
    assert not blocked.is_alive()
    assert [info.first_sample for info in manifest.shards] == [0]
    for index in range(1, 4):
        gated.gate(index).set()
    pool.close()
    assert [info.first_sample for info in manifest.shards] == [0, 1, 2, 3]


def test_a_shard_larger_than_the_budget_goes_alone(gated: GatedWrites, tmp_path: Path) -> None:
    pool = ShardWriterPool(tmp_path, empty_manifest(), torch.bfloat16, max_bytes=1000)
    thread = submit_in_thread(pool, 0, features(100))
    thread.join(5)
    assert not thread.is_alive()
    gated.gate(0).set()
    pool.close()


def test_shards_are_recorded_in_submission_order_as_they_finish(gated: GatedWrites, tmp_path: Path) -> None:
    manifest = empty_manifest()
    pool = ShardWriterPool(tmp_path, manifest, torch.bfloat16, workers=3)
    for index in range(3):
        pool.submit(index, features(100))
    gated.gate(2).set()
    gated.gate(1).set()
    time.sleep(0.2)
    pool.submit(3, features(100))  # 1 and 2 are durable, but 0 is not: nothing is recorded after a gap
    assert manifest.shards == []
    gated.gate(0).set()
    time.sleep(0.2)
    gated.gate(4).set()
    pool.submit(4, features(100))  # finished shards are recorded without waiting for the others
    assert [info.first_sample for info in manifest.shards] == [0, 1, 2]
    assert [info.first_sample for info in read_manifest(tmp_path).shards] == [0, 1, 2]
    gated.gate(3).set()
    pool.close()
    assert [info.first_sample for info in manifest.shards] == [0, 1, 2, 3, 4]


def test_a_writers_error_is_raised_in_the_loop_and_nothing_after_it_is_recorded(
    gated: GatedWrites, tmp_path: Path
) -> None:
    manifest = empty_manifest()
    write_manifest(tmp_path, manifest)
    gated.fail.add(1)
    for index in range(4):
        gated.gate(index).set()
    with pytest.raises(DataError, match="shard 1 failed"):
        with ShardWriterPool(tmp_path, manifest, torch.bfloat16) as pool:
            for index in range(4):
                pool.submit(index, features(100))
                time.sleep(0.05)
    assert [info.first_sample for info in manifest.shards] == [0]
    assert [info.first_sample for info in read_manifest(tmp_path).shards] == [0]


# --------------------------------------------------------------------------- CUDA (run on a GPU machine)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_pipeline_equals_the_synchronous_forward(llama: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Side-stream copies into reused pinned buffers deliver exactly what a plain .cpu() of the same forward
    gives, for every batch (a buffer reused too early, or a source freed too early, would show here)."""
    target = as_target(llama, "cuda")
    samples = make_samples(LENGTHS * 3, seed=2)
    batches = plan_batches([s.num_tokens for s in samples], range(len(samples)), 64)
    got = list(batch_features(target, samples, batches, AUX_IDS, dtype))
    for batch, found in zip(batches, got, strict=True):
        input_ids, positions, lengths = right_padded(samples, batch, 7)
        captured = capture_hidden_states(target.model, target.parts, input_ids.cuda(), None, AUX_IDS)
        aux = captured.aux_hidden_states.to(dtype).cpu()
        last = captured.last_hidden_state.to(dtype).cpu()
        for row, i in enumerate(batch):
            n = lengths[row]
            assert torch.equal(found[i].aux_hidden_states, aux[row, :n])
            assert torch.equal(found[i].last_hidden_state, last[row, :n])
            assert not found[i].aux_hidden_states.is_pinned()  # out of the pinned buffer, which is reused
    llama.to("cpu")


@needs_cuda
def test_cuda_launch_queues_work_without_a_host_sync(llama: LlamaForCausalLM) -> None:
    """Launching a batch (H2D copies, forward with capture, packing, cast, side-stream copy) never makes the
    host wait for the GPU: CUDA's sync debug mode turns any implicit synchronisation into an error."""
    from eaglet.extract.transformers_backend import DeviceToHost

    target = as_target(llama, "cuda")
    samples = make_samples(LENGTHS)
    batch = list(range(len(samples)))
    copier = DeviceToHost(target.device, HostBuffers(torch.bfloat16, sum(LENGTHS), pin=True))
    _launch(target, samples, batch, AUX_IDS, torch.bfloat16, copier).collect(samples)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        in_flight = _launch(target, samples, batch, AUX_IDS, torch.bfloat16, copier)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert in_flight.copy is not None and in_flight.aux.is_pinned()
    found = in_flight.collect(samples)
    assert sorted(found) == batch
    llama.to("cpu")


@needs_cuda
def test_cuda_launch_of_a_new_batch_size_does_not_wait_for_queued_work(llama: LlamaForCausalLM) -> None:
    """A batch of a size not seen before is launched while the GPU is still busy: its inputs go through a
    pinned staging buffer of one size (a fresh cudaHostAlloc would wait for the queued work; the sync debug
    mode above does not see that wait, so this test keeps the GPU busy and checks the host returned first)."""
    from eaglet.extract.transformers_backend import DeviceToHost, _upload_elements

    target = as_target(llama, "cuda")
    samples = make_samples(LENGTHS * 2, seed=3)
    batches = [list(range(2)), list(range(2, 2 + len(LENGTHS))), list(range(len(samples)))]
    copier = DeviceToHost(
        target.device, HostBuffers(torch.bfloat16, sum(s.num_tokens for s in samples), pin=True)
    )
    copier.upload_elements = max(_upload_elements(samples, batch) for batch in batches)
    _launch(target, samples, batches[0], AUX_IDS, torch.bfloat16, copier).collect(samples)  # warm-up
    torch.cuda.synchronize()
    for batch in batches[1:]:
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the launch
        in_flight = _launch(target, samples, batch, AUX_IDS, torch.bfloat16, copier)
        assert not torch.cuda.current_stream().query(), "the launch waited for the GPU's queued work"
        assert sorted(in_flight.collect(samples)) == batch
    llama.to("cpu")
