"""Extraction with the target loaded in this process by transformers (extract.backend=transformers): every
planned shard's sequences go through the target in length-bucketed batches, their hidden states captured.

The forward never waits for the host. Batches go through the target right-padded and without a mask (no
host sync, SDPA's mask-free path); on CUDA batch i's states are packed (real tokens only) and cast on the GPU,
then copied into a pinned buffer on a side stream while the next forwards run, and the host reads them only
once that copy is done, with QUEUED_FORWARDS forwards still queued; shard writers serialise, hash and fsync on
threads (writer.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from eaglet.data.templating import TokenizedConversation
from eaglet.extract import core
from eaglet.extract.budget import DiskBudget
from eaglet.extract.job import ExtractionJob
from eaglet.extract.plan import plan_shards, shard_batches
from eaglet.extract.writer import ShardWriterPool
from eaglet.shards import STORED_DTYPES, Manifest, SequenceFeatures
from eaglet.target_model import (
    LoadedTarget,
    capture_hidden_states,
    head_weights,
    resolve_aux_layer_ids,
)

# Forwards queued on the GPU while the host reads an earlier batch's states and hands them to the writers: with
# two, the GPU still has a whole forward to run when the host's work for one batch (waiting for its copy,
# moving it out of the pinned buffer, a writer's turn) takes longer than a forward.
QUEUED_FORWARDS = 2


def run_transformers_extraction(job: ExtractionJob) -> core.ExtractSummary:
    """Extract the job's dataset with the target loaded here; returns what was written."""
    ext = job.extract
    aux_ids = resolve_aux_layer_ids(job.model)
    loaded = core.load_job(job)
    target, template, identity, samples = loaded.target, loaded.template, loaded.identity, loaded.samples
    settings = {
        **core.shared_settings(job, aux_ids),
        # Batch composition changes float rounding in the forward: part of the identity.
        "batch_tokens": ext.batch_tokens,
        "target_dtype": identity.dtype,
        "device": identity.device,
        "regenerate": core.regenerate_settings(job),
    }
    folder = core.start_folder(
        job,
        core.inputs_identity(job.model, identity, template, settings),
        samples.tokenized,
        aux_ids,
        read_head=lambda: head_weights(target.parts),
    )

    start = time.perf_counter()
    with folder.writing():
        processed, resumed = write_shards(
            target,
            samples.tokenized,
            aux_ids,
            folder.manifest,
            job.out_dir,
            shard_tokens=ext.shard_tokens,
            batch_tokens=ext.batch_tokens,
            dtype=STORED_DTYPES[ext.dtype],
            budget=folder.budget(job),
        )
        return core.finish(
            job,
            folder.manifest,
            samples.tokenized,
            skipped=samples.skipped,
            seconds=time.perf_counter() - start,
            processed_tokens=processed,
            resumed_shards=resumed,
            regenerated=samples.regenerated,
            follow_ups=samples.follow_ups,
        )


def write_shards(
    target: LoadedTarget,
    samples: list[TokenizedConversation],
    aux_ids: list[int],
    manifest: Manifest,
    out_dir: Path,
    *,
    shard_tokens: int,
    batch_tokens: int,
    dtype: torch.dtype,
    budget: DiskBudget | None = None,
) -> tuple[int, int]:
    """Write every planned shard the manifest does not record intact, within `budget` (extract.max_disk_gb);
    returns (tokens processed, shards kept)."""
    lengths = [s.num_tokens for s in samples]
    plan = plan_shards(lengths, shard_tokens)
    todo = core.check_resumable(plan, manifest, out_dir)
    work = shard_batches(lengths, plan, todo, batch_tokens)
    waiting = {index: len(plan[index]) for index in todo}  # sequences of each shard still to come
    features: dict[int, SequenceFeatures] = {}
    total = sum(lengths[i] for index in todo for i in plan[index])
    processed = 0
    start = time.perf_counter()
    batches = [batch for _, batch in work]
    with (
        tqdm(total=total, desc="extract", unit="tok", unit_scale=True) as bar,
        ShardWriterPool(out_dir, manifest, dtype, budget=budget) as writer,
    ):
        for (index, batch), found in zip(
            work, batch_features(target, samples, batches, aux_ids, dtype), strict=True
        ):
            features.update(found)
            waiting[index] -= len(batch)
            if not waiting[index]:
                writer.submit(index, [features.pop(i) for i in plan[index]])
            n = sum(lengths[i] for i in batch)
            processed += n
            bar.update(n)
            bar.set_postfix(tok_s=f"{processed / (time.perf_counter() - start):.0f}")
    return processed, len(plan) - len(todo)


def batch_features(
    target: LoadedTarget,
    samples: list[TokenizedConversation],
    batches: Sequence[list[int]],
    aux_ids: list[int],
    dtype: torch.dtype,
) -> Iterator[dict[int, SequenceFeatures]]:
    """The features of each of `batches`, in order. On CUDA batch i's are read on the host once the forwards of
    batches i+1..i+QUEUED_FORWARDS are queued (see the module docstring); on CPU each runs in turn."""
    copier, depth = None, 1
    if target.device.type == "cuda":
        largest = max(sum(samples[i].num_tokens for i in batch) for batch in batches)
        copier = DeviceToHost(target.device, HostBuffers(dtype, largest, pin=True))
        copier.upload_elements = max(_upload_elements(samples, batch) for batch in batches)
        depth = QUEUED_FORWARDS
        # Pinned before the first forward: pinning while forwards are queued waits for them to finish, which
        # stalled the first batches of every run (a few GB each at 8B scale).
        per_token = (len(aux_ids) + 1) * target.parts.embed_tokens.weight.shape[1]
        copier.buffers.reserve(QUEUED_FORWARDS + 1, per_token)
    in_flight: deque[InFlight] = deque()
    for batch in batches:
        in_flight.append(_launch(target, samples, batch, aux_ids, dtype, copier))
        if len(in_flight) > depth:
            yield in_flight.popleft().collect(samples)
    while in_flight:
        yield in_flight.popleft().collect(samples)


class HostBuffers:
    """Flat host buffers reused batch after batch, each room for `tokens` tokens (grown when a batch needs
    more): pinning memory is slow and pinned memory scarce, so QUEUED_FORWARDS + 1 buffers serve a whole run."""

    def __init__(self, dtype: torch.dtype, tokens: int, *, pin: bool) -> None:
        self.dtype, self.tokens, self.pin = dtype, tokens, pin
        self._free: list[torch.Tensor] = []

    def reserve(self, count: int, per_token: int) -> None:
        """Allocate `count` buffers of the current size now, for `take` to hand out later."""
        self._free += [
            torch.empty(self.tokens * per_token, dtype=self.dtype, pin_memory=self.pin)
            for _ in range(count - len(self._free))
        ]

    def take(self, tokens: int, per_token: int) -> torch.Tensor:
        """A buffer of at least `tokens` x `per_token` elements."""
        self.tokens = max(self.tokens, tokens)
        while self._free:
            buffer = self._free.pop()
            if buffer.numel() >= tokens * per_token:
                return buffer
            # Smaller than this batch: dropped, a buffer of the grown size replaces it.
        return torch.empty(self.tokens * per_token, dtype=self.dtype, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer taken earlier, free for the next `take`."""
        self._free.append(buffer)


class DeviceToHost:
    """Copies of a batch's states into pinned host buffers on a side stream: the compute stream goes on with
    the next forward while they cross."""

    def __init__(self, device: torch.device, buffers: HostBuffers, upload_elements: int = 0) -> None:
        self.stream = torch.cuda.Stream(device)
        self.buffers = buffers
        self.device = device
        self.upload_elements = upload_elements

    def upload(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids` and `positions` (host, int64) on the GPU, copied from pinned memory without waiting.

        The pinned staging buffer has the same size every batch (the largest batch's): torch's pinned-memory
        cache then serves it again once an earlier copy from it is done, where a buffer of a new size would
        be a fresh cudaHostAlloc, which waits for the GPU to finish the forwards already queued.
        """
        ids, flat = input_ids.numel(), positions.numel()
        staging = torch.empty(max(self.upload_elements, ids + flat), dtype=torch.long, pin_memory=True)
        staging[:ids].copy_(input_ids.view(-1))
        staging[ids : ids + flat].copy_(positions)
        both = staging[: ids + flat].to(self.device, non_blocking=True)
        return both[:ids].view(input_ids.shape), both[ids:]

    def start(self, aux: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, PendingCopy]:
        """Start copying `aux` [T, n_aux, H] and `last` [T, H] (on the GPU) to the host: their host tensors,
        laid out back to back at the start of one pinned buffer, and the copy to wait for."""
        tokens, hidden = last.shape
        buffer = self.buffers.take(tokens, aux.numel() // tokens + hidden)
        host_aux = buffer[: aux.numel()].view(aux.shape)
        host_last = buffer[aux.numel() : aux.numel() + last.numel()].view(last.shape)
        # The states are complete once the compute stream's work so far is done.
        self.stream.wait_stream(torch.cuda.current_stream(aux.device))
        with torch.cuda.stream(self.stream):
            host_aux.copy_(aux, non_blocking=True)
            host_last.copy_(last, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        return host_aux, host_last, PendingCopy(done, (aux, last), buffer, self.buffers)


@dataclass
class PendingCopy:
    """A device-to-host copy under way, and what must live until it is done."""

    done: torch.cuda.Event
    # The GPU tensors read by the side stream: referenced until `done`, so the allocator cannot hand their
    # memory to the next forward while the copy still reads it.
    sources: tuple[torch.Tensor, ...]
    buffer: torch.Tensor  # the pinned buffer written, given back once read
    buffers: HostBuffers


@dataclass
class InFlight:
    """One batch between its forward and its rows on the host: packed states [T, n_aux, H] and [T, H] (real
    tokens only, rows back to back), on the host, or their pinned destination while `copy` is under way."""

    batch: list[int]
    lengths: list[int]
    aux: torch.Tensor
    last: torch.Tensor
    copy: PendingCopy | None = None

    def collect(self, samples: list[TokenizedConversation]) -> dict[int, SequenceFeatures]:
        """The batch's SequenceFeatures (views of one host tensor), once its copy to the host is done."""
        aux, last = self.aux, self.last
        if self.copy is not None:
            self.copy.done.synchronize()
            size = aux.numel() + last.numel()
            # Out of the pinned buffer, which a later batch reuses: one copy in host memory.
            moved = self.copy.buffer[:size].clone()
            self.copy.buffers.give(self.copy.buffer)
            self.copy = None
            aux, last = moved[: aux.numel()].view(aux.shape), moved[aux.numel() :].view(last.shape)
        rows = zip(self.batch, aux.split(self.lengths), last.split(self.lengths), strict=True)
        return {
            i: SequenceFeatures(
                sample_id=i,
                input_ids=torch.from_numpy(samples[i].input_ids),
                loss_mask=torch.from_numpy(samples[i].loss_mask),
                aux_hidden_states=row_aux,
                last_hidden_state=row_last,
            )
            for i, row_aux, row_last in rows
        }


@torch.inference_mode()
def _launch(
    target: LoadedTarget,
    samples: list[TokenizedConversation],
    batch: list[int],
    aux_ids: list[int],
    dtype: torch.dtype,
    copier: DeviceToHost | None,
) -> InFlight:
    """Queue batch `batch`'s forward and, with a `copier`, its copy to the host; returns without waiting."""
    input_ids, positions, lengths = right_padded(samples, batch, target.tokenizer.pad_token_id or 0)
    if copier is not None:
        input_ids, positions = copier.upload(input_ids, positions)
    else:
        input_ids, positions = input_ids.to(target.device), positions.to(target.device)
    captured = capture_hidden_states(target.model, target.parts, input_ids, None, aux_ids)
    # The real tokens only, cast on the device: no padding and fewer bytes cross to the host.
    aux = captured.aux_hidden_states.flatten(0, 1).index_select(0, positions).to(dtype)
    last = captured.last_hidden_state.flatten(0, 1).index_select(0, positions).to(dtype)
    if copier is None:
        return InFlight(batch, lengths, aux, last)
    host_aux, host_last, copy = copier.start(aux, last)
    return InFlight(batch, lengths, host_aux, host_last, copy)


def _upload_elements(samples: list[TokenizedConversation], batch: list[int]) -> int:
    """int64 elements `_launch` uploads for `batch`: its right-padded ids and the flat index of its real tokens."""
    lengths = [samples[i].num_tokens for i in batch]
    return len(lengths) * max(lengths) + sum(lengths)


def right_padded(
    samples: list[TokenizedConversation], batch: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The batch's input_ids [B, S], right-padded, the flat index (row x S + column) of each real token, rows
    back to back, and the rows' lengths. Built on the host, where the rows are right-padded by construction."""
    lengths = np.array([samples[i].num_tokens for i in batch], dtype=np.int64)
    width = int(lengths.max())
    row_starts = np.arange(len(batch), dtype=np.int64) * width
    packed_starts = np.cumsum(lengths) - lengths
    positions = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(row_starts - packed_starts, lengths)
    input_ids = np.full(len(batch) * width, pad_id, dtype=np.int64)
    input_ids[positions] = np.concatenate([samples[i].input_ids for i in batch])
    return (
        torch.from_numpy(input_ids).view(len(batch), width),
        torch.from_numpy(positions),
        lengths.tolist(),
    )
