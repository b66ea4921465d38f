"""How far a set's τ could move with other prompts of the same kind: percentile bootstrap intervals over prompts.

A set holds a few dozen prompts at most, and τ varies from prompt to prompt far more than between two heads a
few hundred steps apart: without an interval, a difference of 0.05 reads like a result. Prompts are resampled
with replacement; each resample's τ is 1 + Σ accepted / Σ steps over the prompts drawn (the set's own τ, as
`DecodeStats.tau` counts it). Two proposers decoded the same prompts, so their ratio is resampled in pairs (the
same prompts drawn for both): the prompts one finds easy the other mostly does too, so "the head against n-gram
lookup" usually moves less than either τ.
Two heads evaluated in different runs (`difference_interval`, `ratio_interval`) are drawn in pairs too when both
evaluations name the same prompts (each prompt's key, a hash of its tokens), else independently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

SAMPLES = 2000
TAILS = (0.025, 0.975)  # 95% intervals

# Per prompt, in prompt order: accepted draft tokens, verification steps with a proposal, and (optional) "prompts",
# each prompt's key.
PerPrompt = Mapping[str, Sequence]


def prompt_draws(prompts: int, samples: int = SAMPLES, seed: int = 0) -> np.ndarray:
    """[samples, prompts]: how many times each prompt is drawn in each resample."""
    picks = np.random.default_rng(seed).integers(0, prompts, size=(samples, prompts))
    counts = np.zeros((samples, prompts))
    np.add.at(counts, (np.arange(samples)[:, None], picks), 1.0)
    return counts


def resampled_taus(counts: np.ndarray, per_prompt: PerPrompt) -> np.ndarray:
    """[samples]: τ of each resample of `prompt_draws`."""
    accepted = counts @ np.asarray(per_prompt["accepted"], dtype=float)
    steps = counts @ np.asarray(per_prompt["steps"], dtype=float)
    return 1.0 + np.divide(accepted, steps, out=np.zeros_like(accepted), where=steps > 0)


def _interval(values: np.ndarray) -> list[float]:
    low, high = np.quantile(values, TAILS)
    return [float(low), float(high)]


def _check(name: str, per_prompt: PerPrompt, prompts: int) -> None:
    if len(per_prompt["accepted"]) != prompts or len(per_prompt["steps"]) != prompts:
        raise ValueError(
            f"{name}: {len(per_prompt['accepted'])} accepted and {len(per_prompt['steps'])} step counts for "
            f"{prompts} prompts; every proposer must count the same prompts"
        )


def tau_intervals(
    per_proposer: Mapping[str, PerPrompt], *, samples: int = SAMPLES, seed: int = 0
) -> dict[str, dict[str, object]]:
    """Per proposer: "tau_ci95" [low, high], and "ratio_ci95" {other proposer: [low, high]} of its τ over the
    other's, every proposer resampled on the same prompts."""
    if not per_proposer:
        return {}
    prompts = len(next(iter(per_proposer.values()))["accepted"])
    for name, per_prompt in per_proposer.items():
        _check(name, per_prompt, prompts)
    if prompts == 0:
        return {}
    counts = prompt_draws(prompts, samples, seed)
    taus = {name: resampled_taus(counts, per_prompt) for name, per_prompt in per_proposer.items()}
    return {
        name: {
            "tau_ci95": _interval(tau),
            "ratio_ci95": {other: _interval(tau / taus[other]) for other in taus if other != name},
        }
        for name, tau in taus.items()
    }


def difference_interval(
    a: PerPrompt, b: PerPrompt, *, samples: int = SAMPLES, seed: int = 0
) -> list[float] | None:
    """The 95% interval [low, high] of τ(a) - τ(b) for two evaluations (other runs); None when either counted no
    prompt. Drawn in pairs when both counted the same prompts (`same_prompts`), else independently."""
    taus = _two_runs(a, b, samples, seed)
    return None if taus is None else _interval(taus[0] - taus[1])


def ratio_interval(
    a: PerPrompt, b: PerPrompt, *, samples: int = SAMPLES, seed: int = 0
) -> list[float] | None:
    """The 95% interval of τ(a) / τ(b), drawn as `difference_interval` draws."""
    taus = _two_runs(a, b, samples, seed)
    return None if taus is None else _interval(taus[0] / taus[1])


def same_prompts(a: PerPrompt, b: PerPrompt) -> bool:
    """Whether two evaluations name the same prompts (their keys, in any order): then they can be drawn in pairs."""
    keys_a, keys_b = a.get("prompts"), b.get("prompts")
    return bool(keys_a) and bool(keys_b) and sorted(keys_a) == sorted(keys_b)


def _in_key_order(per_prompt: PerPrompt) -> PerPrompt:
    order = np.argsort(np.asarray(per_prompt["prompts"]), kind="stable")
    return {k: np.asarray(per_prompt[k])[order] for k in ("accepted", "steps")}


def _two_runs(a: PerPrompt, b: PerPrompt, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
    if not len(a["accepted"]) or not len(b["accepted"]):
        return None
    if same_prompts(a, b):  # the same prompts in both: each draw takes the same prompts from both
        draws = prompt_draws(len(a["accepted"]), samples, seed)
        return resampled_taus(draws, _in_key_order(a)), resampled_taus(draws, _in_key_order(b))
    return (
        resampled_taus(prompt_draws(len(a["accepted"]), samples, seed), a),
        resampled_taus(prompt_draws(len(b["accepted"]), samples, seed + 1), b),
    )
