"""The generation engine: continuous batching over fixed slots, each decode step one CUDA graph replay.

Every slot owns `capacity` columns of a static key/value cache (eaglet.generation.static_model). The state
of the running rows lives in device tensors that are only ever written in place (the token to feed, its
position, the tokens generated so far, where the first stop id fell), so a decode step - the target's
forward, the choice of the next token (eaglet.generation.sampling) and the stop check - has fixed shapes
and is captured once as a CUDA graph (on CUDA), then replayed. A free slot decodes too, on a frozen
position: its rows of the batch are wasted arithmetic, not a branch.

The host meets the device once per window of `refill_every` steps: one copy of the stop positions tells which
rows are done; their tokens come back in one copy; requests taken ahead are prefilled into the freed slots
(packed end to end without padding where torch's variable-length attention runs, else in chunks of similar
lengths; written straight into their slots) and the next window is launched at once,
with them (or, with DecodeSettings.overlap_prefill, the window is launched first and the prefills queued
behind it, so that the host's work on them overlaps the GPU's decoding; with DecodeSettings.prefill_graphs,
each prefill chunk is padded to a bucket shape and replayed from that shape's CUDA graph,
eaglet.generation.prefill_graphs). The work source (detokenizing, the next turn's chat template) runs while
the device decodes.

The outputs match eaglet.generation.continuous (the reference decoder) token for token where the arithmetic
agrees: on CPU in float32 it does (tests); in bf16 on a GPU the two differ only where two tokens' logits
are within rounding of each other.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from eaglet.generation.prefill_graphs import GraphedPrefill
from eaglet.generation.sampling import pick_next
from eaglet.generation.static_model import PackedPrompts, SlotDecoder
from eaglet.generation.work import DecodeSettings, Request, WorkSource, packed_chunks, prefill_chunks
from eaglet.target_model.packed_attention import varlen_applies

log = logging.getLogger(__name__)

# The most of the free GPU memory the key/value cache may take (activations, logits and the graph need the rest).
_CACHE_SHARE = 0.8
# Slots are fitted to free memory in steps of this many (the decode step is compiled per slot count).
SLOT_STEP = 64


@dataclass
class _Slot:
    """The host's record of one busy slot (positions and counts advance in lockstep on both sides)."""

    request: Request
    generated: int


@dataclass
class _Clock:
    """Where the engine's wall time went: GPU seconds decoding and prefilling (CUDA events, read at the
    window's sync, so timing costs no extra sync), and host seconds spent waiting for the GPU."""

    on: bool
    decode: float = 0.0
    prefill: float = 0.0
    waited: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def mark(self) -> torch.cuda.Event | None:
        if not self.on:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, kind: str, start: torch.cuda.Event | None) -> None:
        if start is not None:
            self.pending.append((kind, start, self.mark()))

    def settle(self) -> None:
        """Add up the spans that finished (call after a sync)."""
        for kind, start, end in self.pending:
            setattr(self, kind, getattr(self, kind) + start.elapsed_time(end) / 1e3)
        self.pending.clear()

    def line(self) -> str:
        wall = time.perf_counter() - self.started
        if not self.on:
            return f"{wall:.1f} s"
        idle = max(0.0, wall - self.decode - self.prefill)
        return (
            f"{wall:.1f} s: the GPU decoded {self.decode:.1f} s, prefilled {self.prefill:.1f} s, waited for the "
            f"host {idle:.1f} s; the host waited for the GPU {self.waited:.1f} s"
        )


@torch.inference_mode()
def decode_static(model: torch.nn.Module, source: WorkSource, settings: DecodeSettings) -> int:
    """Decode every request `source` hands out until it has no more and no slot is busy; the rows (slots) it
    decoded at once."""
    if settings.max_context is None:
        raise ValueError("the generation engine needs DecodeSettings.max_context (prompt + answer tokens)")
    engine = _Engine(model, settings)
    engine.run(source)
    return engine.slots


class _Engine:
    def __init__(self, model: torch.nn.Module, settings: DecodeSettings) -> None:
        self.settings = settings
        device = next(model.parameters()).device
        self.device = device
        # A row decodes up to refill_every - 1 steps past its budget before the host sees it is done.
        self.capacity = settings.max_context + settings.refill_every + 1
        self.slots = _fit_slots(model, settings.max_rows, self.capacity, device)
        # With bucketed prefills, one spare slot takes the padding rows' keys and values.
        spare = 1 if settings.prefill_graphs else 0
        self.decoder = SlotDecoder(model, slots=self.slots, capacity=self.capacity, spare=spare)
        self.forward = self.decoder.step
        self.prefill = self.decoder.prefill
        self.prefill_packed = self.decoder.prefill_packed
        self.packed = settings.packed_prefill
        if self.packed is None:
            self.packed = varlen_applies(device, self.decoder.keys[0].dtype, self.decoder.head_dim)
        if settings.prefill_graphs:
            graphs = device.type == "cuda" and settings.cuda_graphs
            bucketed = GraphedPrefill(self.decoder, scratch=self.slots, pad_id=settings.pad_id, graphs=graphs)
            self.prefill, self.prefill_packed = bucketed, bucketed.packed
        if settings.compile and device.type == "cuda":
            self.forward = torch.compile(self.decoder.step, dynamic=False)
        long = {"dtype": torch.long, "device": device}
        self.tokens = torch.zeros(self.slots, **long)
        self.positions = torch.zeros(self.slots, **long)
        self.counts = torch.zeros(self.slots, **long)
        self.stop_at = torch.full((self.slots,), -1, **long)
        self.seeds = torch.zeros(self.slots, **long)
        self.active = torch.zeros(self.slots, **long)  # 1 for a busy slot: its position and count advance
        self.out = torch.zeros((self.slots, settings.max_new_tokens + settings.refill_every), **long)
        self.stops = torch.tensor(sorted(settings.stop_ids), **long)
        self.busy: dict[int, _Slot] = {}
        self.steps = self.windows = self.kept_tokens = 0  # for the summary line
        self.clock = _Clock(on=device.type == "cuda")
        self.graph = self._capture() if device.type == "cuda" and settings.cuda_graphs else None

    def run(self, source: WorkSource) -> None:
        budget = self.settings.max_new_tokens
        self.clock = _Clock(on=self.device.type == "cuda")
        # Requests taken ahead, their prompts built while the last window decoded: at the next sync they are
        # prefilled into the slots freed there, before the next window, which they join at once.
        ready: list[Request] = []
        while True:
            with record_function("engine.harvest"):
                finished = self._harvest()
            if not self.settings.overlap_prefill:
                ready = self._refill(ready, budget)
            # The window runs while the source records what finished and works out what comes next.
            with record_function("engine.launch"):
                self._launch_window()
            if self.settings.overlap_prefill:  # the GPU runs these prefills after the window
                ready = self._refill(ready, budget)
            with record_function("engine.source"):
                for request, tokens in finished:
                    source.finish(request, tokens)
                # Enough for the slots free now and as many again as just finished (about what the
                # window frees).
                wanted = self.slots - len(self.busy) + len(finished) - len(ready)
                if wanted > 0:
                    ready += source.take(wanted)
            if not ready and not self.busy:
                if self.clock.on:
                    torch.cuda.synchronize(self.device)
                self.clock.settle()
                self._summary()
                return

    def _refill(self, ready: list[Request], budget: int) -> list[Request]:
        """Prefill as many `ready` requests as there are free slots into them; the rest, still to come."""
        free = [slot for slot in range(self.slots) if slot not in self.busy]
        if ready and free:
            with record_function("engine.prefill"):
                start = self.clock.mark()
                admitted, ready = ready[: len(free)], ready[len(free) :]
                self._admit(free[: len(admitted)], admitted, budget)
                self.clock.span("prefill", start)
        return ready

    def _harvest(self) -> list[tuple[Request, list[int]]]:
        """The busy slots that met a stop id or their budget, freed; (request, tokens) for each, in slot order."""
        if not self.busy:
            return []
        budget = self.settings.max_new_tokens
        waiting = time.perf_counter()
        stop_at = self.stop_at.tolist()  # the window's one device sync
        self.clock.waited += time.perf_counter() - waiting
        self.clock.settle()
        done, lengths = [], []
        for slot in sorted(self.busy):
            stop, generated = stop_at[slot], self.busy[slot].generated
            if stop >= 0 or generated >= budget:
                done.append(slot)
                lengths.append(min(stop if stop >= 0 else generated, budget))
        if not done:
            return []
        index = torch.tensor(done, device=self.device)
        rows = self.out[index, : max(lengths)].tolist()
        self.active[index] = 0
        # A free slot still decodes; at position 0 its attention reads one column, not its old context.
        self.positions[index] = 0
        finished = [
            (self.busy.pop(slot).request, tokens[:length])
            for slot, tokens, length in zip(done, rows, lengths, strict=True)
        ]
        self.kept_tokens += sum(max(0, n - 1) for n in lengths)  # the first token came from the prefill
        return finished

    def _launch_window(self) -> None:
        """Enqueue up to `refill_every` steps (fewer when every busy row reaches its budget sooner)."""
        if not self.busy:
            return
        remaining = max(self.settings.max_new_tokens - slot.generated for slot in self.busy.values())
        steps = max(1, min(self.settings.refill_every, remaining))
        start = self.clock.mark()
        for _ in range(steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
        self.clock.span("decode", start)
        for slot in self.busy.values():
            slot.generated += steps
        self.steps += steps
        self.windows += 1

    def _summary(self) -> None:
        """One line on how full the rows were: decode steps are paid for every row, busy or not."""
        if self.steps:
            share = self.kept_tokens / (self.steps * self.slots)
            # Through tqdm: a caller's progress bar (regeneration's) stays on its own line, this one on its own.
            tqdm.write(
                f"generation engine: {self.steps:,} steps of {self.slots:,} rows in {self.windows:,} windows; "
                f"{share:.0%} of the row-steps made a kept token (the rest: free rows, tokens after a stop); "
                f"{self.clock.line()}"
            )

    def _step(self) -> None:
        """One decode step of every slot, written in place (captured as the graph)."""
        logits = self.forward(self.tokens, self.positions)
        token = pick_next(
            logits,
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
            seeds=self.seeds,
            steps=self.counts,
        )
        self.out.scatter_(1, self.counts[:, None], token[:, None])
        first_stop = torch.isin(token, self.stops) & (self.stop_at < 0)
        self.stop_at.copy_(torch.where(first_stop, self.counts, self.stop_at))
        self.tokens.copy_(token)
        self.counts.add_(self.active)
        self.positions.add_(self.active)

    def _admit(self, slots: list[int], requests: list[Request], budget: int) -> None:
        """Prefill `requests` into the free `slots`, longest prompts first, in chunks of similar lengths."""
        for request in requests:
            if len(request.prompt) + budget > self.settings.max_context:
                raise ValueError(
                    f"a prompt of {len(request.prompt)} tokens plus {budget} new ones exceeds the engine's "
                    f"max_context {self.settings.max_context}"
                )
        pairs = sorted(zip(slots, requests, strict=True), key=lambda pair: -len(pair[1].prompt))
        order = [request for _, request in pairs]
        slot_of = {id(request): slot for slot, request in pairs}
        if self.packed:
            chunks = packed_chunks(order, self.settings.prefill_tokens)
        else:
            chunks = prefill_chunks(order, self.settings.prefill_tokens, self._min_prefill_tokens)
        for chunk in chunks:
            self._prefill([slot_of[id(request)] for request in chunk], chunk)

    @property
    def _min_prefill_tokens(self) -> int:
        if self.settings.min_prefill_tokens is not None:
            return self.settings.min_prefill_tokens
        # A small eager forward costs its launches more than its compute; a graph replay costs neither.
        return 0 if self.device.type == "cpu" or self.settings.prefill_graphs else 16384

    def _prefill(self, slots: list[int], chunk: list[Request]) -> None:
        lengths = torch.tensor([len(r.prompt) for r in chunk], dtype=torch.long, device=self.device)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        seeds = torch.tensor([r.seed for r in chunk], dtype=torch.long, device=self.device)
        if self.packed:
            logits = self.prefill_packed(
                PackedPrompts.build([list(r.prompt) for r in chunk], slots, self.device)
            )
        else:
            width = max(len(request.prompt) for request in chunk)
            pad = self.settings.pad_id
            ids = torch.tensor(
                [list(r.prompt) + [pad] * (width - len(r.prompt)) for r in chunk], device=self.device
            )
            logits = self.prefill(index, ids, lengths)
        first = pick_next(
            logits,
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
            seeds=seeds,
            steps=torch.zeros_like(seeds),
        )
        self.tokens[index] = first
        self.positions[index] = lengths
        self.counts[index] = 1
        self.stop_at[index] = torch.where(torch.isin(first, self.stops), 0, -1)
        self.seeds[index] = seeds
        self.out[index, 0] = first
        self.active[index] = 1
        for slot, request in zip(slots, chunk, strict=True):
            self.busy[slot] = _Slot(request, generated=1)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """The decode step as a CUDA graph, captured while every slot is free (its work is then discarded)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(
                2
            ):  # compiles the kernels (and the step, with settings.compile), warms the allocator
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self._reset()
        return graph

    def _reset(self) -> None:
        for tensor in (self.tokens, self.positions, self.counts, self.seeds, self.active, self.out):
            tensor.zero_()
        self.stop_at.fill_(-1)


def _fit_slots(model: torch.nn.Module, wanted: int, capacity: int, device: torch.device) -> int:
    """`wanted` slots, or as many as the free GPU memory holds the cache of (a warning says so), rounded down
    to a multiple of SLOT_STEP.

    An engine's cache, once freed, stays reserved by torch's allocator, which the driver does not count as
    free: on an H100 the engine after a 1,024-row one fitted 586 rows. Unreachable objects are collected and
    reserved blocks released first.
    The decode step is compiled for its number of slots, so the count is rounded: nearby amounts of free memory
    (other work) give the same shape rather than a new compilation (~25 s on an H100) per engine.
    """
    if device.type != "cuda":
        return wanted
    gc.collect()  # an earlier engine still in a reference cycle would keep its cache
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    per_slot = SlotDecoder.cache_bytes(model, 1, capacity)
    fits = int(free * _CACHE_SHARE // per_slot)
    if fits < 1:
        raise RuntimeError(
            f"the GPU has {free / 2**30:.1f} GiB free, less than one slot's cache of {capacity} tokens "
            f"({per_slot / 2**30:.2f} GiB); lower extract.max_length or free the GPU"
        )
    if fits < wanted:
        if fits > SLOT_STEP:
            fits -= fits % SLOT_STEP
        log.warning(
            "%d rows need %.1f GiB of key/value cache; %.1f GiB is free: decoding %d rows at a time",
            wanted, wanted * per_slot / 2**30, free / 2**30, fits,
        )  # fmt: skip
        return fits
    return wanted
