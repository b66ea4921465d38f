"""Two evaluated runs side by side: τ per prompt set, their difference and its 95% interval over the prompts.

    python -m eaglet.evaluate.compare outputs/train/<run A> outputs/train/<run B>
    python -m eaglet.evaluate.compare a/eval.json b/eval.json --proposer ngram

Each argument is a run folder (its eval.json) or an eval.json. Sets both evaluated are compared; when both named
the same prompts (the keys eval.json keeps), each resample draws the same prompts from both ("paired"), which
takes the prompts' own spread out of the difference; else each run's prompts are drawn on their own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from eaglet.errors import DataError, EagletError
from eaglet.evaluate.intervals import difference_interval, same_prompts
from eaglet.run_dir import RunDir


def read_results(where: Path) -> dict[str, Any]:
    """An evaluation's results: `where` is an eval.json or a folder holding one."""
    path = RunDir(where).results_file if where.is_dir() else where
    if not path.is_file():
        raise DataError(
            f"{where}: no {RunDir.RESULTS_FILE} there; evaluate the run first (python evaluate.py eval.run={where})"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None


def compare(a: dict[str, Any], b: dict[str, Any], proposer: str = "eaglet") -> list[dict[str, Any]]:
    """Per set evaluated in both: prompts, τ of each, Δτ = τ(a) - τ(b), its interval (None without per-prompt
    counts, as a server's or an earlier evaluation's) and whether the draws were paired."""
    rows = []
    for name in (s for s in a["sets"] if s in b["sets"]):
        ra, rb = (r["sets"][name]["results"].get(proposer) for r in (a, b))
        if ra is None or rb is None:
            raise DataError(f"set {name!r}: no proposer {proposer!r} in both evaluations; pass --proposer")
        counts_a, counts_b = ra.get("per_prompt"), rb.get("per_prompt")
        counted = counts_a is not None and counts_b is not None
        rows.append({
            "set": name,
            "prompts": (a["sets"][name]["prompts"], b["sets"][name]["prompts"]),
            "tau": (ra["tau"], rb["tau"]),
            "difference": ra["tau"] - rb["tau"],
            "interval": difference_interval(counts_a, counts_b) if counted else None,
            "paired": counted and same_prompts(counts_a, counts_b),
        })  # fmt: skip
    return rows


def format_comparison(rows: list[dict[str, Any]], names: tuple[str, str]) -> str:
    lines = [
        f"| set | prompts | τ {names[0]} | τ {names[1]} | Δτ | 95% interval | prompts drawn |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        interval = "n/a" if r["interval"] is None else "{:+.2f} to {:+.2f}".format(*r["interval"])
        drawn = "n/a" if r["interval"] is None else "in pairs" if r["paired"] else "each run's own"
        lines.append(
            f"| {r['set']} | {r['prompts'][0]}, {r['prompts'][1]} | {r['tau'][0]:.2f} | {r['tau'][1]:.2f} "
            f"| {r['difference']:+.2f} | {interval} | {drawn} |"
        )
    return "\n".join(lines)


def _label(where: Path) -> str:
    """A run's name: its folder's, whether the folder or its eval.json was named."""
    return where.parent.name if where.suffix == ".json" else where.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eaglet.evaluate.compare", description=__doc__.split("\n")[0]
    )
    parser.add_argument("a", type=Path, help="a run folder or its eval.json")
    parser.add_argument("b", type=Path, help="the run to compare it with")
    parser.add_argument("--proposer", default="eaglet", help="whose τ: eaglet (default), ngram or baseline")
    args = parser.parse_args(argv)
    try:
        a, b = read_results(args.a), read_results(args.b)
        rows = compare(a, b, args.proposer)
        if not rows:
            raise DataError(
                f"no prompt set evaluated in both ({sorted(a['sets'])} and {sorted(b['sets'])}); evaluate them on "
                "the same eval.sets"
            )
    except EagletError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_comparison(rows, (_label(args.a), _label(args.b))))
    if any(r["interval"] is None for r in rows):
        print("n/a: an evaluation without per-prompt counts (through a server, or before they were kept)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
