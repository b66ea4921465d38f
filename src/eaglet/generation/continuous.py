"""The reference decoder: continuous batching over any transformers causal LM, rows refilled as they finish.

It runs every model transformers runs, on CPU or GPU; eaglet.generation.engine is the fast path for the
architectures it knows and is checked against this one.

Up to `max_rows` requests decode together. Every `refill_every` steps one device sync finds the rows that
met a stop id or their token budget; their tokens go to the work source, which may answer with follow-up
requests (a conversation's next turn), and the free rows are refilled: new prompts are prefilled in
separate forwards (left padded, at most `prefill_tokens` padded tokens each) and join the running cache.
Between syncs the loop only launches work: tokens stay on the device, no Python runs per row, and the cache
is written in place (eaglet.generation.row_cache).

Rows are independent (each attends to its own columns, samples from its own random stream), so a request's
tokens do not depend on which others share the batch, beyond floating-point rounding of batched kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import record_function
from transformers import DynamicCache

from eaglet.generation.gqa_attention import gqa_decode
from eaglet.generation.row_cache import CachedRows, RowCache
from eaglet.generation.sampling import pick_next
from eaglet.generation.work import DecodeSettings, Request, WorkSource, prefill_chunks


@torch.inference_mode()
def decode_reference(model: torch.nn.Module, source: WorkSource, settings: DecodeSettings) -> int:
    """Decode every request `source` hands out until it has no more and no row is running; the rows it
    decoded at once (settings.max_rows)."""
    # The named ranges show up in a torch.profiler trace (benchmarks/bench_regenerate.py bench.profile=1).
    with gqa_decode(model):
        batch = _RunningBatch(model, settings)
        while True:
            with record_function("regen.harvest"):
                finished = batch.harvest()
            with record_function("regen.source"):
                for request, tokens in finished:
                    source.finish(request, tokens)
                incoming = source.take(settings.max_rows - batch.size)
            if not incoming and batch.size == 0:
                return settings.max_rows
            if incoming or batch.changed:
                with record_function("regen.refill"):
                    batch.refill(incoming)
            with record_function("regen.decode"):
                batch.decode()


class _RunningBatch:
    """Per-row state of the running rows; device tensors hold what changes at every step."""

    def __init__(self, model: torch.nn.Module, settings: DecodeSettings) -> None:
        self.model, self.settings = model, settings
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.attn_implementation = _attention_for_4d_masks(model.config)
        self.min_prefill_tokens = settings.min_prefill_tokens
        if self.min_prefill_tokens is None:
            self.min_prefill_tokens = 0 if self.device.type == "cpu" else 16384
        self.stops = torch.tensor(sorted(settings.stop_ids), dtype=torch.long, device=self.device)
        self.requests: list[Request] = []
        # Tokens generated per row (decode runs past a stop until the next check), and cache columns per row.
        self.generated: list[int] = []
        self.lengths: list[int] = []
        self.cache: RowCache | None = None
        self.keep: torch.Tensor | None = None
        self.changed = False
        long = {"dtype": torch.long, "device": self.device}
        self.tokens = torch.zeros(0, **long)  # the last token of each row: the next step's input
        self.positions = torch.zeros(0, **long)  # its position id
        self.counts = torch.zeros(0, **long)  # tokens generated so far (= self.generated, on the device)
        self.stop_at = torch.zeros(0, **long)  # index of the first stop id among them, -1 if none yet
        self.seeds = torch.zeros(0, **long)
        self.out = torch.zeros((0, self._out_width), **long)

    @property
    def _out_width(self) -> int:
        return self.settings.max_new_tokens + self.settings.refill_every

    @property
    def _reserve(self) -> int:
        """Columns a rebuilt cache holds beyond its tokens: a few windows, so an unchanged batch rarely regrows."""
        return 4 * self.settings.refill_every

    @property
    def size(self) -> int:
        return len(self.requests)

    def harvest(self) -> list[tuple[Request, list[int]]]:
        """Remove the rows that are done and return (request, tokens) for each, in row order."""
        if not self.requests:
            return []
        budget = self.settings.max_new_tokens
        stop_at = self.stop_at.tolist()
        done, lengths = [], []
        for row, (stop, count) in enumerate(zip(stop_at, self.generated, strict=True)):
            if stop >= 0 or count >= budget:
                done.append(row)
                lengths.append(min(stop if stop >= 0 else count, budget))
        if not done:
            self.keep, self.changed = None, False
            return []
        index = torch.tensor(done, device=self.device)
        rows = self.out[index, : max(lengths)].tolist()
        finished = [
            (self.requests[row], tokens[:length])
            for row, tokens, length in zip(done, rows, lengths, strict=True)
        ]
        gone = set(done)
        kept = [row for row in range(self.size) if row not in gone]
        self.keep = torch.tensor(kept, dtype=torch.long, device=self.device)
        self.changed = True
        self.requests = [self.requests[row] for row in kept]
        self.generated = [self.generated[row] for row in kept]
        self.lengths = [self.lengths[row] for row in kept]
        return finished

    def refill(self, incoming: list[Request]) -> None:
        """Rebuild the cache from the rows kept by `harvest` and the prefilled `incoming` requests."""
        parts: list[CachedRows] = []
        keep = self.keep
        state = [self.tokens, self.positions, self.counts, self.stop_at, self.seeds, self.out]
        if keep is not None:
            state = [tensor[keep] for tensor in state]
        if self.requests and self.cache is not None:
            parts.append(self.cache.rows(keep, max(self.lengths)))
        else:
            state = [tensor[:0] for tensor in state]
        # Longest first: one chunk holds prompts of similar length, so little padding.
        ordered = sorted(incoming, key=lambda r: -len(r.prompt))
        for chunk in prefill_chunks(ordered, self.settings.prefill_tokens, self.min_prefill_tokens):
            with record_function("regen.prefill"):
                part, first = self._prefill(chunk)
            parts.append(part)
            lengths = torch.tensor([len(r.prompt) for r in chunk], dtype=torch.long, device=self.device)
            hit = torch.isin(first, self.stops)
            out = torch.zeros((len(chunk), self._out_width), dtype=torch.long, device=self.device)
            out[:, 0] = first
            new = [first, lengths, torch.ones_like(lengths), torch.where(hit, 0, -1), self._seeds(chunk), out]
            state = [torch.cat([old, add]) for old, add in zip(state, new, strict=True)]
            self.requests.extend(chunk)
            self.generated.extend([1] * len(chunk))
            self.lengths.extend(len(r.prompt) for r in chunk)
        self.tokens, self.positions, self.counts, self.stop_at, self.seeds, self.out = state
        with record_function("regen.assemble"):
            self.cache = RowCache.assemble(parts, self._reserve)
        self.keep, self.changed = None, False

    def decode(self) -> None:
        """Up to `refill_every` steps (fewer when every row reaches its budget sooner), without a device sync."""
        cache, settings = self.cache, self.settings
        assert cache is not None
        steps = max(0, min(settings.refill_every, max(settings.max_new_tokens - g for g in self.generated)))
        if cache.capacity - cache.width < steps:
            cache = self.cache = RowCache.assemble([cache.rows(None, max(self.lengths))], self._reserve)
        for _ in range(steps):
            logits = self.model(
                input_ids=self.tokens[:, None],
                attention_mask=cache.step_mask(self.attn_implementation, self.dtype),
                position_ids=self.positions[:, None],
                past_key_values=cache.hf,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            token = pick_next(
                logits,
                temperature=settings.temperature,
                top_p=settings.top_p,
                seeds=self.seeds,
                steps=self.counts,
            )
            self.out.scatter_(1, self.counts[:, None], token[:, None])
            first_stop = torch.isin(token, self.stops) & (self.stop_at < 0)
            self.stop_at = torch.where(first_stop, self.counts, self.stop_at)
            self.tokens = token
            self.counts += 1
            self.positions += 1
        self.generated = [g + steps for g in self.generated]
        self.lengths = [n + steps for n in self.lengths]

    def _prefill(self, chunk: list[Request]) -> tuple[CachedRows, torch.Tensor]:
        """The chunk's prompts through the model, left padded: their cache rows and first new tokens."""
        width = max(len(r.prompt) for r in chunk)
        pad = self.settings.pad_id
        ids = torch.tensor(
            [[pad] * (width - len(r.prompt)) + list(r.prompt) for r in chunk], device=self.device
        )
        mask = torch.tensor(
            [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in chunk], device=self.device
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        first = pick_next(
            logits,
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
            seeds=self._seeds(chunk),
            steps=torch.zeros(len(chunk), dtype=torch.long, device=self.device),
        )
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        return CachedRows(kv, mask), first

    def _seeds(self, chunk: list[Request]) -> torch.Tensor:
        return torch.tensor([r.seed for r in chunk], dtype=torch.long, device=self.device)


def _attention_for_4d_masks(config: Any) -> str | None:
    """The attention implementation, when one 4D decode mask serves every layer; else None (2D masks).

    Sliding-window layers need their own mask, which transformers builds from the 2D one.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:  # older configs: a sliding window, if any, applies to every layer
        sliding = getattr(text_config, "sliding_window", None) is not None
    else:
        sliding = any(kind != "full_attention" for kind in layer_types)
    return None if sliding else getattr(config, "_attn_implementation", None)
