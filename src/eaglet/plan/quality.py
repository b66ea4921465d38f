"""What more training buys: measured τ of earlier heads against log2 of the tokens they trained on.

Acceptance tends to grow by about the same amount per doubling of the training tokens over the range a
recipe measures, so a straight line in log2(tokens) per evaluation set says what τ a planned run should reach
and how many tokens a goal τ needs. Heads come from a recipe's scale.json (recipes/smollm2_scale.py: one head
per evaluated row at the experiment's own settings; ablations and continued heads left out) or from evaluated run folders (eval.json + report.json). The line holds for the measured
target and data only, and extrapolating past the measured range is a guess.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.config.schema import PlanQualityConfig
from eaglet.errors import ConfigError, DataError


@dataclass(frozen=True)
class MeasuredHead:
    """One evaluated head: the tokens it trained on (its own run plus any it continued) and τ per set."""

    label: str
    tokens: float
    tau: dict[str, float]
    baseline_tau: dict[str, float]
    num_spec_tokens: int | None = None  # K of the evaluation, where the file says
    tokens_per_s: float | None = (
        None  # its own run's training rate, where the file says (steps x batch / seconds)
    )


@dataclass(frozen=True)
class SetFit:
    """τ = intercept + slope_per_doubling · log2(tokens) over one evaluation set's heads."""

    name: str
    points: int
    slope_per_doubling: float
    intercept: float
    baseline_tau: float  # mean τ of the baseline proposer over the same heads
    tau_min: float
    tau_max: float

    def tau_at(self, tokens: float) -> float:
        return self.intercept + self.slope_per_doubling * math.log2(tokens)

    def tokens_for(self, tau: float) -> float | None:
        """Tokens the line reaches `tau` at; None when τ does not grow with tokens on this line."""
        if self.slope_per_doubling <= 0:
            return None
        return 2.0 ** ((tau - self.intercept) / self.slope_per_doubling)


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None


def _taus(sets: Any, cfg: PlanQualityConfig, where: str) -> tuple[dict[str, float], dict[str, float]]:
    """τ of the proposer and of the baseline per set of one evaluation (baseline left out where absent)."""
    if not isinstance(sets, dict):
        raise DataError(f"{where}: 'sets' is not a mapping of evaluation sets")
    tau: dict[str, float] = {}
    baseline: dict[str, float] = {}
    for name, entry in sets.items():
        results = entry.get("results") if isinstance(entry, dict) else None
        results = results if isinstance(results, dict) else {}
        found = sorted(results)
        result = results.get(cfg.proposer)
        if not isinstance(result, dict) or not isinstance(result.get("tau"), int | float):
            raise DataError(
                f"{where}: set '{name}' has no τ for proposer '{cfg.proposer}' (has {found}); "
                "set plan.quality.proposer"
            )
        tau[name] = float(result["tau"])
        base = results.get(cfg.baseline)
        if isinstance(base, dict) and isinstance(base.get("tau"), int | float):
            baseline[name] = float(base["tau"])
    return tau, baseline


def _tokens_before(cfg: PlanQualityConfig) -> dict[str, float]:
    """plan.quality.tokens_before "label=tokens" entries by label."""
    before: dict[str, float] = {}
    for entry in cfg.tokens_before:
        label, sep, value = str(entry).rpartition("=")
        try:
            tokens = float(value)
        except ValueError:
            tokens = -1.0
        if not sep or not label or tokens < 0:
            raise ConfigError(
                f"plan.quality.tokens_before entry '{entry}': expected 'label=tokens' (the label a run folder "
                "as given in plan.quality.measured, or <scale.json>:<row>; tokens a number >= 0)"
            )
        before[label] = tokens
    return before


def _rate(tokens: float, seconds: Any) -> float | None:
    """Training tokens per second of one run, where its seconds are recorded."""
    return tokens / seconds if isinstance(seconds, int | float) and seconds > 0 else None


def on_the_curve(row: dict) -> bool:
    """A recipe row at the experiment's own settings (its main store, no overrides): scale_small, scale_mid, main."""
    return row.get("store", "main") == "main" and not row.get("overrides")


def heads_from_rows(
    rows: dict,
    cfg: PlanQualityConfig,
    where: str,
    prefix: str = "",
    before: dict[str, float] | None = None,
    with_copies: bool = False,
) -> list[MeasuredHead]:
    """The heads of a recipe's rows (scale.json's "rows"), labelled prefix + row name; rows off the curve skipped,
    and rows copied from an earlier run unless `with_copies` (one report's own curve, not a fit over files)."""
    before = before or {}
    heads = []
    for row, entry in rows.items():
        if not isinstance(entry, dict) or not entry.get("sets") or not entry.get("steps"):
            continue  # not trained or not evaluated
        if not on_the_curve(entry):
            continue  # an ablation, or a head continued from another: not the same settings on fewer tokens
        if entry.get("earlier") and not with_copies:
            continue  # a copy of an earlier run's row (the recipe's `earlier=`): measured once, counted once
        label = f"{prefix}{row}"
        tokens = entry.get("tokens_seen")
        if not isinstance(tokens, int | float) or tokens <= 0:
            raise DataError(f"{where}: row '{row}' is evaluated but has no tokens_seen")
        tau, baseline = _taus(entry["sets"], cfg, f"{where} row '{row}'")
        rate = _rate(tokens, entry.get("train_s"))
        k = entry.get("num_spec_tokens")  # absent from summaries written before it was recorded
        k = k if isinstance(k, int) else None
        heads.append(MeasuredHead(label, float(tokens) + before.get(label, 0.0), tau, baseline, k, rate))
    return heads


def _from_scale(path: Path, cfg: PlanQualityConfig, before: dict[str, float]) -> list[MeasuredHead]:
    data = _load_json(path)
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, dict):
        raise DataError(f"{path}: no 'rows' of a recipe summary (scale.json)")
    return heads_from_rows(rows, cfg, str(path), prefix=f"{path}:", before=before)


def _from_run(folder: Path, label: str, cfg: PlanQualityConfig, before: dict[str, float]) -> MeasuredHead:
    evaluation = _load_json(folder / "eval.json")
    report = _load_json(folder / "report.json")
    steps = report.get("steps") if isinstance(report, dict) else None
    batch = report.get("global_batch_tokens") if isinstance(report, dict) else None
    if not isinstance(steps, int | float) or not isinstance(batch, int | float) or steps * batch <= 0:
        raise DataError(f"{folder / 'report.json'}: needs 'steps' and 'global_batch_tokens' > 0")
    sets = evaluation.get("sets") if isinstance(evaluation, dict) else None
    if not sets:
        raise DataError(f"{folder / 'eval.json'}: no 'sets' of an evaluation")
    tau, baseline = _taus(sets, cfg, str(folder / "eval.json"))
    k = evaluation.get("num_spec_tokens")
    tokens = float(steps * batch) + before.get(label, 0.0)
    rate = _rate(steps * batch, report.get("seconds"))
    return MeasuredHead(label, tokens, tau, baseline, k if isinstance(k, int) else None, rate)


def read_measured(path: str, cfg: PlanQualityConfig) -> list[MeasuredHead]:
    """The heads of one plan.quality.measured entry: a scale.json, a folder holding one, or a run folder."""
    p = Path(path)
    before = _tokens_before(cfg)
    if not p.exists():
        raise ConfigError(
            f"plan.quality.measured: {path} does not exist (pass an evaluated run folder or a scale.json)"
        )
    if p.is_file():
        return _from_scale(p, cfg, before)
    if (p / "scale.json").is_file():
        return _from_scale(p / "scale.json", cfg, before)
    if (p / "eval.json").is_file() and (p / "report.json").is_file():
        return [_from_run(p, path, cfg, before)]
    raise ConfigError(
        f"plan.quality.measured: {path} holds neither scale.json nor eval.json + report.json (pass an "
        "evaluated run folder, after eval.py, or a recipe's scale.json)"
    )


def fit_sets(heads: list[MeasuredHead]) -> list[SetFit]:
    """Least squares of τ on log2(tokens) per set with at least two distinct token counts."""
    names = sorted({name for head in heads for name in head.tau})
    fits = []
    for name in names:
        points = [(math.log2(h.tokens), h.tau[name]) for h in heads if name in h.tau and h.tokens > 0]
        if len(points) < 2 or len({x for x, _ in points}) < 2:
            continue
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
        baselines = [h.baseline_tau[name] for h in heads if name in h.tau and name in h.baseline_tau]
        taus = [y for _, y in points]
        fits.append(
            SetFit(
                name=name,
                points=n,
                slope_per_doubling=slope,
                intercept=mean_y - slope * mean_x,
                baseline_tau=sum(baselines) / len(baselines) if baselines else math.nan,
                tau_min=min(taus),
                tau_max=max(taus),
            )
        )
    if not fits:
        raise ConfigError(
            f"plan.quality.measured: {len(heads)} measured head(s) give no set to fit; at least two heads "
            "evaluated on the same set and trained on different token counts are needed"
        )
    return fits


def unfitted_sets(heads: list[MeasuredHead], fits: list[SetFit]) -> list[str]:
    """Sets measured but left out of the fit (fewer than two token counts)."""
    fitted = {f.name for f in fits}
    return sorted({name for head in heads for name in head.tau} - fitted)


def num_spec_tokens(heads: list[MeasuredHead]) -> int | None:
    """K of the evaluations when they all agree on one."""
    ks = {h.num_spec_tokens for h in heads if h.num_spec_tokens is not None}
    return ks.pop() if len(ks) == 1 else None


@dataclass(frozen=True)
class QualityFit:
    """What the report prints: the heads, the fitted sets, and the sets left out."""

    heads: list[MeasuredHead]
    fits: list[SetFit]
    unfitted: list[str]
    goal_ratio: float
    baseline: str  # the baseline proposer the goal is a multiple of

    @property
    def num_spec_tokens(self) -> int | None:
        return num_spec_tokens(self.heads)

    @property
    def measured_tokens_per_s(self) -> float | None:
        """The training rate of the longest measured run whose time is known: their machine, as they trained; the
        longest, since a run's start-up (compiling, the first validation) weighs least there, as in the long runs
        the goal takes."""
        timed = [h for h in self.heads if h.tokens_per_s]
        return max(timed, key=lambda h: h.tokens).tokens_per_s if timed else None


def measure_quality(cfg: PlanQualityConfig) -> QualityFit | None:
    """Read and fit plan.quality.measured; None when it is empty (the section is off)."""
    if not cfg.measured:
        return None
    if cfg.goal_ratio <= 0:
        raise ConfigError(f"plan.quality.goal_ratio must be > 0, got {cfg.goal_ratio}")
    heads = [head for path in cfg.measured for head in read_measured(str(path), cfg)]
    unknown = sorted(set(_tokens_before(cfg)) - {h.label for h in heads})
    if unknown:  # a typo would otherwise fit the head on too few tokens
        raise ConfigError(
            f"plan.quality.tokens_before: no measured head is labelled {unknown}; the labels are "
            f"{[h.label for h in heads]}"
        )
    fits = fit_sets(heads)
    return QualityFit(heads, fits, unfitted_sets(heads, fits), cfg.goal_ratio, cfg.baseline)
