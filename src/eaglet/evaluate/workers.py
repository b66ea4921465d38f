"""Evaluation in several processes: each loads the target and the proposers once, then decodes whole prompts
(greedy, then every proposer) as they come, so prompts run side by side.

One prompt's decoding leaves a GPU mostly idle: each target forward is a few hundred small kernels, launched
one by one from Python. N processes keep N prompts in flight, on the one GPU or spread over several. Every count
(acceptance, tokens, forwards, near-ties) is the one process's, since each prompt is still decoded alone; the
wall-clock speedup column is measured under the shared load, greedy and speculative alike.
"""

from __future__ import annotations

import copy
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from eaglet.errors import EagletError
from eaglet.evaluate.loading import Evaluator, load_evaluator
from eaglet.evaluate.metrics import PromptOutcome, evaluate_prompt, summarize, warm_up
from eaglet.evaluate.prompts import PromptSets
from eaglet.run_dir import RunDir
from eaglet.target_model.loader import resolve_device

# The evaluator of this worker process, loaded once by _start.
_worker: dict[str, Any] = {}


def worker_devices(device: str, workers: int) -> list[str]:
    """The device of each worker: eval.device as given, except that "auto" or "cuda" on a machine with several
    GPUs spreads the workers over them, round robin."""
    resolved = resolve_device(device)
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.device_count() > 1:
        return [f"cuda:{i % torch.cuda.device_count()}" for i in range(workers)]
    return [str(resolved)] * workers


def _start(
    cfg: DictConfig, run: str, devices: list[str], counter: Any, threads: int, first: list[int]
) -> None:
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    torch.set_num_threads(threads)
    evaluator = load_evaluator(cfg, RunDir(Path(run)), devices[index % len(devices)])
    ev = cfg.eval
    warm_up(
        evaluator.target,
        evaluator.proposers,
        first,
        num_spec_tokens=ev.num_spec_tokens,
        max_new_tokens=ev.max_new_tokens,
        stop_ids=evaluator.stop_ids,
    )
    _worker.update(evaluator=evaluator, eval=ev)


def _evaluate(name: str, index: int, prompt: list[int]) -> tuple[str, int, PromptOutcome]:
    evaluator: Evaluator = _worker["evaluator"]
    ev = _worker["eval"]
    outcome = evaluate_prompt(
        evaluator.target,
        evaluator.proposers,
        prompt,
        index=index,
        num_spec_tokens=ev.num_spec_tokens,
        max_new_tokens=ev.max_new_tokens,
        stop_ids=evaluator.stop_ids,
        tie_tolerance=ev.tie_tolerance,
        position_accuracy=ev.position_accuracy,
    )
    return name, index, outcome


def evaluate_in_workers(cfg: DictConfig, run: RunDir, prompt_sets: PromptSets) -> dict[str, dict[str, Any]]:
    """Per set name, `summarize` of its prompts, decoded by cfg.eval.workers processes; the first failure (a
    LosslessError among them) stops the others and is raised here."""
    workers = min(cfg.eval.workers, sum(len(prompts) for prompts, _ in prompt_sets.values()))
    settled = copy.deepcopy(cfg)
    OmegaConf.resolve(settled)  # the workers see the values, not interpolations that need this process
    first = next(prompts[0] for prompts, _ in prompt_sets.values())
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    counter = context.Value("i", 0)
    threads = max(1, torch.get_num_threads() // workers)
    devices = worker_devices(cfg.eval.device, workers)
    outcomes: dict[str, dict[int, PromptOutcome]] = {name: {} for name in prompt_sets}
    pool = ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_start,
        initargs=(settled, str(run.path), devices, counter, threads, first),
    )
    try:
        futures = [
            pool.submit(_evaluate, name, index, prompt)
            for name, (prompts, _) in prompt_sets.items()
            for index, prompt in enumerate(prompts)
        ]
        bar = tqdm(
            as_completed(futures), total=len(futures), desc=f"evaluate ({workers} processes)", unit="prompt"
        )
        for future in bar:
            name, index, outcome = future.result()
            outcomes[name][index] = outcome
    except BrokenProcessPool as e:
        raise EagletError(
            f"an evaluation process stopped before its prompts were done ({e}); its own error is printed above. "
            f"Each of the eval.workers={workers} processes holds a copy of the target on {sorted(set(devices))}: "
            "with too little memory for that many, pass a smaller eval.workers"
        ) from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    num_spec_tokens = cfg.eval.num_spec_tokens
    return {
        name: summarize([found[i] for i in sorted(found)], num_spec_tokens)
        for name, found in outcomes.items()
    }
