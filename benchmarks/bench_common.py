"""What the benchmark scripts share: the machine a row was measured on, and their bench.* options."""

from __future__ import annotations

import platform

import torch


def machine() -> str:
    """The GPU's name, or the CPU's architecture and threads, with torch's version: a row's `machine` column."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"


def parse_bench_options(
    argv: list[str], defaults: dict, paths: tuple[str, ...] = ()
) -> tuple[dict, list[str]]:
    """bench.* options (integers, each one of `defaults`; those named in `paths` kept as text) and the Hydra
    overrides, from the command line."""
    opts, overrides = dict(defaults), []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("bench."):
            name = key.removeprefix("bench.")
            if name not in defaults:
                raise SystemExit(f"{key}: unknown; the bench options are {', '.join(sorted(defaults))}")
            opts[name] = value if name in paths else int(value)
        else:
            overrides.append(arg)
    return opts, overrides


def cuda_milliseconds(fn, replays: int) -> float:
    """Mean time of `fn` over `replays` calls, between CUDA events, after one call to warm up."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays
