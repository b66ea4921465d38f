"""τ of a trial's head at draft lengths 1..K_max through a serving engine (eval.backend=vllm_server|sglang_server).

One server drafting K_max tokens, launched with the trial's head, answers the evaluator's prompts; its own
counters give τ(K_max) and the acceptance a_i at every draft position i. Shorter draft lengths are not served
again (a launch per length would cost minutes each for a large target): τ(K) = 1 + Σ_{i<K} a_i, the tokens a
K_max chain accepts within its first K positions. That is exact at K_max; at shorter K it leaves out that a
shorter chain starts its steps at other positions, which the in-process replay (eaglet.sweeps.replay) counts.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from eaglet.config.schema import EagletConfig
from eaglet.errors import DataError
from eaglet.evaluate.server_plan import ENGINE_NAMES, engine_of
from eaglet.evaluate.server_stage import measure_draft_through_server


def prefix_taus(rates: list[float]) -> list[float]:
    """τ(K) for K = 1..len(rates) from the unconditional acceptance per draft position."""
    taus, tau = [], 1.0
    for rate in rates:
        tau += rate
        taus.append(tau)
    return taus


def server_curve(cfg: EagletConfig, draft_dir: Path, k_max: int) -> dict[str, Any]:
    # The engine needs the GPUs this process trained on: hand back what torch still caches.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    counts, prompts = measure_draft_through_server(cfg, draft_dir, k_max)
    rates = counts.acceptance_rates()
    engine = ENGINE_NAMES[engine_of(cfg)]
    if len(rates) != k_max:
        raise DataError(
            f"the {engine} server reported no acceptance per draft position for {draft_dir} (SGLang answers "
            "carry it only from the release with spec_accept_histogram on); use eval.backend=vllm_server or "
            "sweep.tau_source=sim"
        )
    return {
        "prompts": prompts,
        "engine": engine,
        "tau": prefix_taus(rates),
        "acceptance_rates": rates,
        "measured_at_max_draft_length": {
            "tau": counts.tau,
            "acceptance_rates": rates,
            "steps": counts.drafts,
        },
    }
