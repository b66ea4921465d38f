"""The nucleus sampling kernel alone: each method's time per decode step against the argmax greedy decoding takes.

    python benchmarks/bench_sampling.py                                  # SmolLM2's logits, 1,024 rows (CUDA)
    python benchmarks/bench_sampling.py bench.source=random bench.rows=512

The logits are the target's own (bench.source=target): its forward over the first user turns of the shared
prompts, every position a row, so each row is a real next-token distribution (over people's text, flatter than
over answers: more rejections than regeneration meets). bench.source=random draws them from a normal of
standard deviation bench.scale_milli / 1000 instead. Each method (eaglet.generation.sampling_kernel.METHODS) is
timed over bench.replays launches between CUDA events, its picks compared with the reference's
(eaglet.generation.sampling.pick_next on the CPU, float32). For "reject" the table also gives the mean number of
candidates a row tried (each one more pass over the row), counted on the CPU from the same logits and noise.
Needs a CUDA GPU; rows are appended to experiments/BENCHMARKS.md.
"""

from __future__ import annotations

import sys
from datetime import date
from pathlib import Path

import torch
from bench_common import cuda_milliseconds, machine, parse_bench_options  # noqa: E402
from hydra import compose, initialize_config_dir

import eaglet.config
from eaglet.config import check_config
from eaglet.data.conversations import read_jsonl_conversations
from eaglet.generation import sampling, sampling_kernel
from eaglet.target_model import load_target

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS = {"rows": 1024, "temperature_milli": 700, "top_p_milli": 950, "methods": "reject,search",
            "source": "target", "scale_milli": 3000, "replays": 50, "seed": 0, "record": 1}  # fmt: skip
PROMPT_FILES = ("oasst_en100.jsonl", "alpaca_en_demo.jsonl", "self_instruct_seed.jsonl")


def target_logits(cfg, rows: int) -> tuple[torch.Tensor, str]:
    """`rows` next-token logit rows of the target over the shared prompts' first user turns (bf16, on CUDA)."""
    target = load_target(cfg.model, device="cuda", cache_dir=Path(cfg.paths.cache_dir))
    found: list[torch.Tensor] = []
    with torch.inference_mode():
        for name in PROMPT_FILES:
            for conv in read_jsonl_conversations(Path(cfg.paths.shared_data) / name):
                ids = target.tokenizer(conv.turns[0].content, return_tensors="pt").input_ids[:, :512]
                found.append(target.model(input_ids=ids.cuda()).logits[0])
                if sum(len(f) for f in found) >= rows:
                    return torch.cat(found)[:rows].contiguous(), f"{cfg.model.name} ({target.dtype})"
    raise SystemExit(
        f"the shared prompts gave {sum(len(f) for f in found)} positions, fewer than {rows} rows"
    )


def rejection_picks(
    logits: torch.Tensor, temperature: float, top_p: float, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """The rejection method's rule on the CPU: each row's pick and the mean candidates a row tried (each
    candidate, a pass of the kernel over the row)."""
    scores = logits.float() / temperature
    probs = scores.softmax(-1)
    noisy = scores + sampling.gumbel_noise(seeds, steps, logits.shape[-1])
    picks, tried = [], 0
    for p, s in zip(probs, noisy, strict=True):
        pick = s.argmax()
        tried += 1
        while p[p > p[pick]].sum() > top_p:
            pick = torch.where(p > p[pick], s, float("-inf")).argmax()
            tried += 1
        picks.append(int(pick))
    return torch.tensor(picks), tried / len(probs)


def main(argv: list[str]) -> None:
    opts, overrides = parse_bench_options(argv, DEFAULTS, paths=("methods", "source"))
    if not torch.cuda.is_available():
        sys.exit("bench_sampling needs a CUDA GPU (the kernels are Triton's)")
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    check_config(cfg)
    torch.manual_seed(opts["seed"])
    if opts["source"] == "target":
        logits, what = target_logits(cfg, opts["rows"])
    elif opts["source"] == "random":
        vocab = cfg.model.vocab_size
        logits = (torch.randn(opts["rows"], vocab, device="cuda") * opts["scale_milli"] / 1000).to(
            torch.bfloat16
        )
        what = f"random N(0, {opts['scale_milli'] / 1000:g}) (bf16)"
    else:
        sys.exit(f"bench.source={opts['source']}: unknown; the sources are target, random")
    rows, vocab = logits.shape
    temperature, top_p = opts["temperature_milli"] / 1000, opts["top_p_milli"] / 1000
    seeds = torch.randint(0, 2**31, (rows,), device="cuda")
    steps = torch.randint(0, 600, (rows,), device="cuda")
    want = sampling.pick_next(logits.cpu().float(), temperature=temperature, top_p=top_p, seeds=seeds.cpu(),
                              steps=steps.cpu())  # fmt: skip
    greedy = cuda_milliseconds(lambda: logits.argmax(dim=-1), opts["replays"])
    lines = []
    for method in opts["methods"].split(","):

        def run(method: str = method) -> torch.Tensor:
            return sampling_kernel.sample_rows(
                logits, temperature=temperature, top_p=top_p, seeds=seeds, steps=steps, method=method
            )

        ms = cuda_milliseconds(run, opts["replays"])
        equal = (run().cpu() == want).float().mean().item()
        tried = None
        if method == "reject":
            tried = rejection_picks(logits.cpu(), temperature, top_p, seeds.cpu(), steps.cpu())[1]
        lines.append(
            f"| {date.today()} | {machine()} | {what} | {rows:,} × {vocab:,} | {temperature:g} | {top_p:g} | {method} "
            f"| {ms:.3f} | {ms / greedy:.1f}x | {equal:.1%} | {'' if tried is None else f'{tried:.2f}'} |"
        )
    header = (
        "| date | machine | logits | rows × vocab | temperature | top_p | method | ms a step | vs argmax "
        "| picks equal to the reference | candidates a row |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    print(f"argmax: {greedy:.3f} ms")
    print(header)
    print("\n".join(lines))
    if opts["record"]:
        command = "python benchmarks/bench_sampling.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(
                f"\n### Nucleus sampling kernel — `{command.strip()}`\n\nargmax over the same logits: {greedy:.3f} ms."
                f"\n\n{header}\n" + "\n".join(lines) + "\n"
            )
        print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
