"""A loader that builds micro-batches ahead on background threads of the training process.

Threads share the shard maps and hand a finished batch over as it is: no pickling and no copy into shared
memory, as DataLoader worker processes need. Building a batch is numpy copies and checks that release the GIL,
so a few threads keep up with the GPU while the training thread runs.

On a CUDA device the loader also moves the next batch to the GPU on a side stream while the current one trains:
a copy on the training stream (Lightning's `batch_to_device`) would add its time to every step. A `transform`
(online training's target forward) runs on that stream too, after the copy, so the GPU works on it while the
training stream runs the step before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

Batch = dict[str, torch.Tensor]
Transform = Callable[[Batch], Batch]


class DeviceCopier:
    """Copies batches to a CUDA device on its own stream (and applies a transform there); `ready` hands one to
    the current stream."""

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        self.stream = torch.cuda.Stream(self.device)

    def start(self, batch: Batch, transform: Transform | None = None) -> tuple[Batch, torch.cuda.Event]:
        with torch.cuda.stream(self.stream):
            moved = {name: t.to(self.device, non_blocking=True) for name, t in batch.items()}
            if transform is not None:
                moved = transform(moved)
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, done

    def ready(self, moved: Batch, done: torch.cuda.Event) -> Batch:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in moved.values():
            # Allocated on the copy stream, used on this one: the allocator must not hand the memory to a
            # later copy before this stream is done with it.
            t.record_stream(current)
        return moved


class PrefetchLoader:
    """Yields `dataset[indices]` for each `indices` of `sampler`, in order, built `threads` at a time.

    At most `threads + 1` batches are built or waiting at once. `sampler` and `dataset` are exposed as on a
    DataLoader (Lightning calls `sampler.set_epoch`); `in_flight` counts the index lists of the latest
    iteration drawn from the sampler whose batches were not handed out. With a `copier`, batches are handed
    out on its device, and the one after the batch handed out is already on its way there when it is ready.
    `transform` is applied to each batch before it is handed out: on the copier's stream, right after its copy,
    when there is one.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: Sampler,
        threads: int,
        copier: DeviceCopier | None = None,
        transform: Transform | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"PrefetchLoader needs at least one thread, got {threads}")
        self.dataset, self.sampler, self.threads, self.copier = dataset, sampler, threads, copier
        self.transform = transform
        self.batch_sampler = None  # as on a DataLoader with batch_size=None: Lightning looks for it
        self.in_flight = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="eaglet-loader")
        pending: deque[Future] = deque()
        indices = iter(self.sampler)
        copier = self.copier
        ahead = None  # (batch, event): the next batch, on its way to the device

        def submit() -> None:
            batch = next(indices, None)
            if batch is not None:
                pending.append(pool.submit(self.dataset.__getitem__, batch))

        def next_built() -> Batch:
            batch = pending.popleft().result()
            submit()
            return batch

        self.in_flight = 0
        try:
            for _ in range(self.threads + 1):
                submit()
            while pending or ahead is not None:
                if copier is None:
                    batch = next_built()
                    if self.transform is not None:
                        batch = self.transform(batch)
                else:
                    moving, ahead = ahead or copier.start(next_built(), self.transform), None
                    batch = copier.ready(*moving)
                    # The next copy overlaps the step about to run on `batch`. Waiting here for a batch still
                    # being built would stall that step: such a batch is copied when it is asked for.
                    upcoming = pending[0] if pending else None
                    if upcoming is not None and upcoming.done() and upcoming.exception() is None:
                        ahead = copier.start(next_built(), self.transform)
                self.in_flight = len(pending) + (ahead is not None)
                yield batch
        finally:
            # A loop that stops early (max_steps, an error) leaves batches in the pool: drop those not started.
            # in_flight keeps counting them: the sampler counts them as drawn until the next iteration.
            pool.shutdown(wait=True, cancel_futures=True)
