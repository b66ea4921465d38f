"""Self-prompting throughput: distinct, deduplicated user prompts written by the target per second.

    python benchmarks/bench_self_prompt.py                                          # embedded SmolLM2, 64 prompts
    python benchmarks/bench_self_prompt.py bench.prompts=200000 extract.self_prompt.batch_size=2048   # one GPU

Runs eaglet.data.self_prompt as extraction would (the target loaded here, the engine on CUDA), into a fresh file,
and appends a row to experiments/BENCHMARKS.md with the command, machine and date; the category histogram and a
few prompts are printed.
"""

from __future__ import annotations

import sys
import tempfile
from datetime import date
from pathlib import Path

from bench_common import machine  # noqa: E402
from hydra import compose, initialize_config_dir

import eaglet.config
from eaglet.config import check_config
from eaglet.data.dataset import load_dataset
from eaglet.data.holdout import eval_set_prompts
from eaglet.data.self_prompt import example_pool, format_self_prompt_report, self_prompt, self_prompt_report
from eaglet.target_model import load_target

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS = {"prompts": 64, "record": 1}


def main(argv: list[str]) -> None:
    opts, overrides = dict(DEFAULTS), []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("bench."):
            if key.removeprefix("bench.") not in DEFAULTS:
                sys.exit(f"unknown option {key}; the options are {', '.join('bench.' + k for k in DEFAULTS)}")
            opts[key.removeprefix("bench.")] = int(value)
        else:
            overrides.append(arg)
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"extract.self_prompt.num_prompts={opts['prompts']}", *overrides])
    check_config(cfg)
    target = load_target(cfg.model, device="auto", cache_dir=Path(cfg.paths.cache_dir))
    rg = cfg.extract.regenerate
    examples_from = []
    if cfg.extract.self_prompt.examples:  # drawn from the dataset's user prompts, as extraction draws them
        conversations, _ = load_dataset(
            cfg.dataset, require_assistant=False, strict=False, max_conversations=None,
            held_out_sets=cfg.eval.set_defs,
        )  # fmt: skip
        examples_from = example_pool([t.content for c in conversations for t in c.turns if t.role == "user"])
    with tempfile.TemporaryDirectory() as folder:
        prompts, stats = self_prompt(
            target.model, target.tokenizer, cfg.extract.self_prompt, template=cfg.model.chat_template,
            out_path=Path(folder) / "prompts.jsonl", seed=cfg.seed, held_out=eval_set_prompts(cfg.eval.set_defs),
            examples_from=examples_from,
            engine=str(rg.engine), compile=rg.compile, overlap_prefill=rg.overlap_prefill,
            prefill_graphs=rg.prefill_graphs, packed_prefill=rg.packed_prefill,
        )  # fmt: skip
    print(format_self_prompt_report(self_prompt_report(stats, prompts)))
    sp = cfg.extract.self_prompt
    header = (
        "| date | machine | target | asked | kept | generated | seconds (incl. compile) | kept prompts/s | new tokens/s "
        "| rows | temperature |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    row = (
        f"| {date.today()} | {machine()} | {cfg.model.name} ({target.dtype}) | {opts['prompts']:,} | {stats.kept:,} "
        f"| {stats.generated:,} | {stats.seconds:,.1f} | {stats.kept / stats.seconds:,.1f} "
        f"| {stats.tokens / stats.seconds:,.0f} | {sp.batch_size} | {sp.temperature} |"
    )
    print(header + "\n" + row)
    if opts["record"]:
        command = "python benchmarks/bench_self_prompt.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(f"\n### Self-prompting — `{command.strip()}`\n\n{header}\n{row}\n")
        print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
