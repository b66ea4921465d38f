"""Prefill forwards of fixed shapes, replayed from CUDA graphs: the host launches one graph, not ~20 kernels a layer.

An eager prefill of a small target is bound by the host: its forward is a few milliseconds of GPU work behind
tens of milliseconds of kernel launches, and the engine prefills after every window. Here a chunk of prompts is
padded to a bucket shape (rows and width rounded up), copied into that bucket's static inputs, and the bucket's
graph - captured on first use - runs the forward. Padding rows write their keys and values to a scratch slot
that no decode step reads; padding columns are never seen by a real token (causal attention) and are
overwritten as the slot decodes, as in the eager prefill. Without CUDA graphs (CPU) the same padded forward runs
eagerly, so the padding is tested where graphs cannot be.

`packed` does the same for prompts packed end to end (SlotDecoder.prefill_packed): the bucket is (prompts rounded
to a power of two, tokens rounded as widths are); the padding tokens are more prompts, in the scratch slot, and
the bucket's spare prompts are empty.
"""

from __future__ import annotations

import logging

import torch

from eaglet.generation.static_model import PackedPrompts, SlotDecoder

log = logging.getLogger(__name__)

# Bucket widths: powers of two and 1.5 times them, so a prompt is padded by at most half its length.
_MIN_WIDTH = 32


def bucket_width(width: int) -> int:
    """The smallest bucket width holding `width` tokens: 32, 48, 64, 96, 128, 192, ..."""
    size = _MIN_WIDTH
    while True:
        if width <= size:
            return size
        if width <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


def bucket_rows(rows: int) -> int:
    """The smallest power of two holding `rows` rows."""
    return 1 << max(0, rows - 1).bit_length()


class _Bucket:
    """Static inputs and outputs of one (rows, width) shape, and its graph once captured."""

    def __init__(self, rows: int, width: int, scratch: int, pad_id: int, device: torch.device) -> None:
        self.ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
        self.lengths = torch.ones(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), scratch, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None


class _PackedBucket:
    """Static inputs and outputs of one packed (prompts, tokens) shape, and its graph once captured.

    The padding tokens go to the scratch slot as prompts of at most `capacity` tokens each (a real prompt is no
    longer): the attention kernel's grid spans the longest prompt, so one padding prompt as long as the bucket
    would launch a block per `capacity` / 128 of its length in every prompt's row, nearly all of them idle.
    """

    def __init__(self, rows: int, tokens: int, scratch: int, capacity: int, device: torch.device) -> None:
        long = {"dtype": torch.long, "device": device}
        longest = min(tokens, capacity)
        pads = -(-tokens // longest)  # padding prompts the bucket may need
        # Padding tokens at columns 0, 1, ... of the scratch slot, wrapping at its capacity.
        self.pad_positions = torch.arange(tokens, **long) % capacity
        # Where the padding prompts end, after the real tokens: T + longest, T + 2 longest, ... (capped at tokens).
        self.pad_ends = longest * torch.arange(1, rows + pads + 1, **long)
        self.inputs = PackedPrompts(
            ids=torch.zeros(tokens, **long),
            positions=self.pad_positions.clone(),
            slots=torch.full((tokens,), scratch, **long),
            starts=torch.full((rows + pads + 1,), tokens, **long),
            last=torch.zeros(rows, **long),
            longest=longest,
        )
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None


class GraphedPrefill:
    """`decoder.prefill` over bucketed shapes; `graphs`: replay each shape's CUDA graph (else run it eagerly).

    `scratch` is a slot of `decoder` that no request uses (the padding rows write there).
    """

    def __init__(self, decoder: SlotDecoder, *, scratch: int, pad_id: int, graphs: bool) -> None:
        self.decoder, self.scratch, self.pad_id, self.graphs = decoder, scratch, pad_id, graphs
        self.buckets: dict[tuple, _Bucket | _PackedBucket] = {}
        self.pool = None  # one memory pool for every bucket's graph, made at the first capture

    def __call__(self, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] after each prompt, as `SlotDecoder.prefill(slots, ids, lengths)` gives them."""
        rows, width = ids.shape
        # The cache holds `capacity` columns a slot: no wider than that (a prompt always fits it).
        bucket = self._bucket(bucket_rows(rows), min(bucket_width(width), self.decoder.capacity), ids.device)
        bucket.ids.fill_(self.pad_id)
        bucket.ids[:rows, :width] = ids
        bucket.lengths.fill_(1)
        bucket.lengths[:rows] = lengths
        bucket.slots.fill_(self.scratch)
        bucket.slots[:rows] = slots
        self._run(bucket, lambda: self._forward(bucket))
        assert bucket.logits is not None
        return bucket.logits[:rows]

    def packed(self, prompts: PackedPrompts) -> torch.Tensor:
        """Logits [n, vocab] after each of `prompts`, as `SlotDecoder.prefill_packed(prompts)` gives them."""
        rows, tokens = prompts.last.shape[0], prompts.ids.shape[0]
        key = ("packed", bucket_rows(rows), bucket_width(tokens))
        if key not in self.buckets:
            self.buckets[key] = _PackedBucket(
                key[1], key[2], self.scratch, self.decoder.capacity, prompts.ids.device
            )
        bucket = self.buckets[key]
        static = bucket.inputs
        static.ids[:tokens] = prompts.ids
        static.ids[tokens:] = self.pad_id
        static.positions[:tokens] = prompts.positions
        static.positions[tokens:] = bucket.pad_positions[: key[2] - tokens]
        static.slots[:tokens] = prompts.slots
        static.slots[tokens:] = self.scratch
        static.starts[: rows + 1] = prompts.starts
        rest = static.starts.shape[0] - rows - 1
        static.starts[rows + 1 :] = (bucket.pad_ends[:rest] + tokens).clamp_(max=key[2])
        static.last[:rows] = prompts.last
        static.last[rows:] = 0
        self._run(bucket, lambda: self.decoder.prefill_packed(static))
        assert bucket.logits is not None
        return bucket.logits[:rows]

    def _run(self, bucket: _Bucket | _PackedBucket, forward) -> None:
        """The bucket's forward into bucket.logits: its graph replayed, or run eagerly (and captured)."""
        if bucket.graph is not None:
            bucket.graph.replay()
            return
        bucket.logits = forward()
        if self.graphs:
            try:
                self._capture(bucket, forward)
            except RuntimeError as error:  # the forward is right either way: run it eagerly from here on
                log.warning("prefill graphs off: capturing a %s prefill failed (%s)", _shape(bucket), error)
                self.graphs = False

    def _bucket(self, rows: int, width: int, device: torch.device) -> _Bucket:
        key = (rows, width)
        if key not in self.buckets:
            self.buckets[key] = _Bucket(rows, width, self.scratch, self.pad_id, device)
        bucket = self.buckets[key]
        assert isinstance(bucket, _Bucket)
        return bucket

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        return self.decoder.prefill(bucket.slots, bucket.ids, bucket.lengths)

    def _capture(self, bucket: _Bucket | _PackedBucket, forward) -> None:
        """Capture the bucket's forward after the eager run above (which compiled and warmed its kernels).

        The graph's work during capture is not run; its inputs are the bucket's static tensors, refilled before
        each replay. Buckets share one memory pool: the engine never runs two prefills at once.
        """
        torch.cuda.current_stream().synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = forward()
        # The eager run's logits are this input's answer; the replays write the captured output.
        logits.copy_(bucket.logits)
        bucket.logits, bucket.graph = logits, graph


def _shape(bucket: _Bucket | _PackedBucket) -> tuple[int, ...]:
    if isinstance(bucket, _PackedBucket):
        return (bucket.inputs.last.shape[0], bucket.inputs.ids.shape[0])
    return tuple(bucket.ids.shape)
