"""The report of recipes/smollm2_scale.py: its rows' τ per held-out set beside n-gram lookup, acceptance per draft
position, the lossless count, the ratios against the goal and what was not run, as markdown. Ratios and
differences carry their 95% intervals over the prompts (eaglet.evaluate.intervals) where the evaluations kept
their per-prompt counts: with ten prompts a set, a goal "met" by a few hundredths may not be met on others."""

from __future__ import annotations

import math

from eaglet.config.schema import PlanQualityConfig
from eaglet.errors import ConfigError
from eaglet.evaluate.intervals import difference_interval, ratio_interval
from eaglet.plan.quality import fit_sets, heads_from_rows
from eaglet.plan.report import format_tokens

SET_NAMES = {"mt_bench_like": "chat", "alpaca": "instructions (Alpaca)", "code": "code", "math": "maths"}
# τ at K = 4: at least these multiples of n-gram lookup's, per set; and of the speculators head's.
GOAL_VS_NGRAM = {"mt_bench_like": 2.0, "alpaca": 2.0, "code": 1.5, "math": 1.5}
GOAL_VS_SPECULATORS = 1.1
SPECULATORS = "speculators"
SEED_ROW = "seed_mid"  # another training seed of its reference row: the ablations' luck


def format_report(record: dict, status: dict[str, str]) -> str:
    rows = record["rows"]
    sets = next((list(r["sets"]) for r in rows.values() if r.get("sets")), [])
    parts = [
        "# smollm2_scale: the embedded target at scale, online\n",
        _stores(record["stores"]),
        _taus(rows, sets),
    ]
    if "main" in rows and rows["main"].get("sets"):
        parts.append(_goal(rows, sets))
    parts += [_scaling(rows), _ablations(rows, sets), _acceptance(rows, sets), _left(status)]
    return "\n".join(p for p in parts if p)


def _stores(stores: dict[str, dict | None]) -> str:
    lines = [
        "## Data (token stores)\n",
        "| store | sequences | tokens | answer tokens |",
        "|---|---|---|---|",
    ]
    for name, totals in stores.items():
        if totals is None:
            lines.append(f"| {name} | not extracted yet | | |")
        else:
            lines.append(
                f"| {name} | {totals['sequences']:,} | {totals['tokens']:,} | {totals['masked_tokens']:,} |"
            )
    return "\n".join(lines) + "\n"


def _taus(rows: dict[str, dict], sets: list[str]) -> str:
    names = [SET_NAMES.get(s, s) for s in sets]
    columns = ["row", "question", "data", "overrides", "tokens seen", "steps", "train s", "val τ_sim"]
    columns += [f"τ {n} (× n-gram)" for n in names] + ["lossless"]
    lines = [
        "## τ at K = 4 on held-out prompts, against the real target\n",
        "| " + " | ".join(columns) + " |",
    ]
    lines.append("|" + "---|" * len(columns))
    for name, r in rows.items():
        trained = [f"{r['tokens_seen']:,}", str(r["steps"])] if "steps" in r else ["—", "—"]
        timing = [f"{r['train_s']:.0f}", f"{r['tau_sim']:.2f}"] if "train_s" in r else ["—", "—"]
        cells = [
            _label(name, r),
            r["question"],
            r["store"],
            " ".join(r["overrides"]) or "—",
            *trained,
            *timing,
        ]
        if r.get("sets"):
            for s in sets:
                ours, ngram = _tau(r, s, "eaglet"), _tau(r, s, "ngram")
                cells.append(f"{ours:.2f} ({ours / ngram:.2f}×)")
            cells.append(_lossless(r))
        else:
            cells += ["not evaluated" if i == 0 else "" for i in range(len(sets) + 1)]
        lines.append("| " + " | ".join(cells) + " |")
    ngram_row = next((r for r in rows.values() if r.get("sets")), None)
    if ngram_row is not None:
        taus = " | ".join(f"{_tau(ngram_row, s, 'ngram'):.2f}" for s in sets)
        lines.append(f"| n-gram lookup | prompt lookup, same prompts | — | — | — | — | — | — | {taus} | |")
    prompts = (
        ", ".join(f"{SET_NAMES.get(s, s)} {ngram_row['sets'][s]['prompts']}" for s in sets)
        if ngram_row
        else ""
    )
    note = (
        f"\nPrompts per set: {prompts}. Lossless: prompts whose speculative output equals greedy decoding's."
    )
    if budget := rows.get("main", {}).get("budget"):
        note += (
            f"\nUnder the budget the main head was given {budget['seconds']:.0f} s of training when it started, its "
            f"schedule fitted to that time at its own step rate (planned ~{budget['steps']:,} steps, "
            f"{budget['epochs']:g} epochs"
            + (
                ", whole epochs, the most it may train)."
                if budget["whole_epochs"]
                else ", at the planned rate)."
            )
        )
    return "\n".join(lines) + (note if prompts else "") + "\n"


def _goal(rows: dict[str, dict], sets: list[str]) -> str:
    main = rows["main"]
    lines = ["## Against the goal\n"]
    for s in sets:
        ours = main["sets"][s]["results"]["eaglet"]
        ratio = ours["tau"] / _tau(main, s, "ngram")
        bounds = ours.get("ratio_ci95", {}).get("ngram")
        interval = "" if bounds is None else f" (95% CI {bounds[0]:.2f}-{bounds[1]:.2f})"
        goal = GOAL_VS_NGRAM.get(s)
        verdict = "" if goal is None else f"; goal ≥ {goal}×: {verdict_against(ratio, bounds, goal)}"
        lines.append(f"- main vs n-gram lookup, {SET_NAMES.get(s, s)}: {ratio:.2f}×{interval}{verdict}")
    spec = rows.get(SPECULATORS, {})
    if spec.get("sets"):
        beside = spec["against"]
        for who in dict.fromkeys(["main", beside]):
            if rows.get(who, {}).get("sets"):
                ratios = ", ".join(
                    f"{SET_NAMES.get(s, s)} {_tau(rows[who], s, 'eaglet') / _tau(spec, s, 'eaglet'):.2f}×"
                    + _speculators_bounds(rows[who], spec, s, who == beside)
                    for s in sets
                )
                same = " (same data and steps)" if who == beside else ""
                lines.append(
                    f"- {who} vs the speculators head{same}: {ratios} (goal ≥ {GOAL_VS_SPECULATORS}×)"
                )
    else:
        lines.append("- vs the speculators head: not evaluated yet")
    return "\n".join(lines) + "\n"


def _scaling(rows: dict[str, dict]) -> str:
    """τ against log2 of tokens seen over the rows at the experiment's own settings (scale_small, scale_mid, main)."""
    heads = heads_from_rows(rows, PlanQualityConfig(), "the recipe's rows", with_copies=True)
    heads.sort(key=lambda h: h.tokens)
    try:
        fits = fit_sets(heads)
    except ConfigError:
        return ""  # fewer than two token counts evaluated yet
    lines = [
        f"## Data scaling: τ against log2 of tokens seen ({', '.join(h.label for h in heads)})\n",
        "| set | +τ per doubling | tokens seen for the goal (× n-gram lookup's τ) |",
        "|---|---|---|",
    ]
    for fit in fits:
        goal = GOAL_VS_NGRAM.get(fit.name)
        if goal is None or math.isnan(
            fit.baseline_tau
        ):  # no goal for this set, or no n-gram τ to scale it by
            reach = "—"
        else:
            needed = fit.tokens_for(goal * fit.baseline_tau)
            reach = f"{format_tokens(needed)} ({goal}×)" if needed else f"never on this line ({goal}×)"
        lines.append(f"| {SET_NAMES.get(fit.name, fit.name)} | {fit.slope_per_doubling:+.2f} | {reach} |")
    lines.append(
        "\nA line through few points, extrapolated past them. `python plan.py plan.quality.measured=[<out>/scale.json]` "
        "draws the same line and gives the time to each goal on a machine."
    )
    return "\n".join(lines) + "\n"


def verdict_against(ratio: float, bounds: list[float] | None, goal: float) -> str:
    """Met or not on these prompts, and whether the 95% interval says the same of other prompts."""
    if bounds is None:
        return "met" if ratio >= goal else "not met"
    if bounds[0] >= goal:
        return "met"
    if bounds[1] < goal:
        return "not met"
    told = "met on these prompts" if ratio >= goal else "not met on these prompts"
    return f"{told}, but the interval spans the goal (more prompts would tell)"


def _per_prompt(row: dict, set_name: str) -> dict | None:
    return row["sets"][set_name]["results"]["eaglet"].get("per_prompt")


def _speculators_bounds(row: dict, spec: dict, set_name: str, beside: bool) -> str:
    """ " (low-high)": the 95% interval of the row's τ over the speculators head's on a set; "" without
    per-prompt counts. The row the speculators head was evaluated beside decoded the same prompts in the same
    run (the "baseline" proposer there); any other row is drawn in pairs when it named the same prompts."""
    if beside:
        found = row["sets"][set_name]["results"]["eaglet"].get("ratio_ci95", {}).get("baseline")
    else:
        a, b = _per_prompt(row, set_name), _per_prompt(spec, set_name)
        found = None if a is None or b is None else ratio_interval(a, b)
    return "" if found is None else f" ({found[0]:.2f}-{found[1]:.2f})"


def _difference_bounds(row: dict, other: dict, set_name: str) -> str:
    """ " (low to high)": the 95% interval of the two rows' τ difference on a set; "" as above."""
    a, b = _per_prompt(row, set_name), _per_prompt(other, set_name)
    found = None if a is None or b is None else difference_interval(a, b)
    return "" if found is None else f" ({found[0]:+.2f} to {found[1]:+.2f})"


def _ablations(rows: dict[str, dict], sets: list[str]) -> str:
    def delta(r: dict, base: dict, s: str) -> float:
        return _tau(r, s, "eaglet") - _tau(base, s, "eaglet")

    seed = rows.get(SEED_ROW, {})
    seed_base = rows.get(seed.get("against") or "", {})
    # The seed row's |Δτ| per set: how far one training moves τ by luck alone (one draw of it).
    luck = (
        {s: abs(delta(seed, seed_base, s)) for s in sets}
        if seed.get("sets") and seed_base.get("sets")
        else {}
    )
    lines = []
    for name, r in rows.items():
        base = rows.get(r.get("against") or "", {})
        if name == SPECULATORS or not r.get("sets") or not base.get("sets"):
            continue
        deltas = ", ".join(
            f"{SET_NAMES.get(s, s)} {delta(r, base, s):+.2f}" + _difference_bounds(r, base, s) for s in sets
        )
        line = f"- {name} ({r['question']}) against {_label(r['against'], base)}, equal tokens: Δτ {deltas}"
        if luck and name != SEED_ROW:
            within = [SET_NAMES.get(s, s) for s in sets if abs(delta(r, base, s)) <= luck[s]]
            line += f"; within {SEED_ROW}'s: {', '.join(within) or 'none'}"
        lines.append(line)
    if not lines:
        return ""
    note = (
        "(95% intervals over the prompts: drawn in pairs where both rows were evaluated on the same prompts, "
        "else each row's evaluation on its own)"
    )
    if luck:
        note += (
            f"\n\n{SEED_ROW} differs from {seed['against']} only by the training seed: its |Δτ| on a set is how far "
            "one training moves τ by luck, which the intervals over prompts leave out. An ablation's Δτ within it "
            "is not told apart from luck (one draw of it: a rough bound)."
        )
    return "## Ablations\n\n" + "\n".join(lines) + f"\n\n{note}\n"


def _acceptance(rows: dict[str, dict], sets: list[str]) -> str:
    lines = []
    for name, r in rows.items():
        for s in sets if r.get("sets") else []:
            rates = r["sets"][s]["results"]["eaglet"]["acceptance_rates"]
            lines.append(
                f"| {_label(name, r)} | {SET_NAMES.get(s, s)} | "
                + " | ".join(f"{a:.2f}" for a in rates)
                + " |"
            )
    first = next((r for r in rows.values() if r.get("sets")), None)
    if first is None:
        return ""
    for s in sets:
        rates = first["sets"][s]["results"]["ngram"]["acceptance_rates"]
        lines.append(
            f"| n-gram lookup | {SET_NAMES.get(s, s)} | " + " | ".join(f"{a:.2f}" for a in rates) + " |"
        )
    k = len(first["sets"][sets[0]]["results"]["eaglet"]["acceptance_rates"])
    head = [
        "## Acceptance per draft position\n",
        "| row | set | " + " | ".join(f"pos {i + 1}" for i in range(k)) + " |",
    ]
    return "\n".join([*head, "|" + "---|" * (2 + k), *lines]) + "\n"


def _left(status: dict[str, str]) -> str:
    left = [f"- {name}: {s}" for name, s in status.items() if not s.startswith("done")]
    if not left:
        return "Every row ran.\n"
    return "## Not run (yet)\n\n" + "\n".join(left) + "\nRerun the same command to continue.\n"


def _label(name: str, row: dict) -> str:
    """The row's name, and the earlier scale.json it was taken from (the recipe's `earlier`) if it was."""
    return f"{name} (from {row['earlier']})" if row.get("earlier") else name


def _tau(row: dict, set_name: str, proposer: str) -> float:
    return row["sets"][set_name]["results"][proposer]["tau"]


def _lossless(row: dict) -> str:
    exact = sum(s["prompts"] - s["results"]["eaglet"].get("near_ties", 0) for s in row["sets"].values())
    return f"{exact}/{sum(s['prompts'] for s in row['sets'].values())}"
