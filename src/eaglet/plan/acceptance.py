"""The acceptance curve behind the serving estimate: assumed, or read from a measured results JSON.

A curve is the per-position conditional acceptance a_i (draft token i accepted given tokens < i were);
τ(K) = 1 + Σ_{i≤K} Π_{j≤i} a_j. Measured results report the unconditional rate per position r_i (accepted /
proposed at i, as eval.json stores it), so a_i = r_i / r_{i−1}. Past the measured or listed positions the
last conditional value repeats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.config.schema import PlanServingConfig
from eaglet.errors import ConfigError, DataError


@dataclass(frozen=True)
class AcceptanceCurve:
    conditional: tuple[float, ...]
    source: str

    def at(self, position: int) -> float:
        """Conditional acceptance of 0-based draft position `position`."""
        return self.conditional[min(position, len(self.conditional) - 1)]

    def tau(self, draft_length: int) -> float:
        tau, survive = 1.0, 1.0
        for i in range(draft_length):
            survive *= self.at(i)
            tau += survive
        return tau


def conditional_from_rates(rates: list[float]) -> tuple[float, ...]:
    """Unconditional per-position acceptance rates -> conditional ones (stops at the first zero)."""
    conditional, previous = [], 1.0
    for rate in rates:
        if previous <= 0:
            break
        conditional.append(min(rate / previous, 1.0))
        previous = rate
    return tuple(conditional)


def _rates_from_json(data: Any, proposer: str, where: str) -> list[float]:
    """acceptance_rates at the top level, or averaged over the sets of an eval.json (weighted by steps)."""
    if isinstance(data, dict) and isinstance(data.get("acceptance_rates"), list):
        return [float(r) for r in data["acceptance_rates"]]
    sets = data.get("sets") if isinstance(data, dict) else None
    if not isinstance(sets, dict) or not sets:
        raise DataError(f"{where}: no 'acceptance_rates' and no 'sets' of an eval.json; cannot read a curve")
    rows = []
    for name, entry in sets.items():
        result = entry.get("results", {}).get(proposer)
        if result is None:
            found = sorted(entry.get("results", {}))
            raise DataError(
                f"{where}: set '{name}' has no proposer '{proposer}' (has {found}); set plan.serving.proposer"
            )
        rows.append((float(result.get("steps", 1)), [float(r) for r in result["acceptance_rates"]]))
    width = min(len(r) for _, r in rows)
    total = sum(w for w, _ in rows)
    return [sum(w * r[i] for w, r in rows) / total for i in range(width)]


def acceptance_curve(serving: PlanServingConfig) -> AcceptanceCurve:
    if serving.acceptance_from:
        path = Path(serving.acceptance_from)
        if not path.is_file():
            raise ConfigError(
                f"plan.serving.acceptance_from={path}: no such file (give an eval.json of a run)"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
        conditional = conditional_from_rates(_rates_from_json(data, serving.proposer, str(path)))
        if not conditional:
            raise DataError(f"{path}: the acceptance rates are empty or start at 0; no curve to extrapolate")
        return AcceptanceCurve(conditional, f"measured: {path} ({serving.proposer})")
    values = tuple(float(a) for a in serving.acceptance)
    if not values or any(not 0.0 <= a <= 1.0 for a in values):
        raise ConfigError(f"acceptance must be a non-empty list of values in [0, 1], got {list(values)}")
    return AcceptanceCurve(values, "assumed: plan.serving.acceptance")
