"""How sure the target is of its own greedy answers, by kind of prompt.

    python benchmarks/target_confidence.py                       # embedded SmolLM2 (fp32), 16 prompts a kind
    python benchmarks/target_confidence.py bench.prompts=8 bench.new_tokens=64

For each evaluation set of `experiments=smollm2_scale` and for prompts the target writes itself (self-prompting
as trained, and after three people's chat prompts as the `seeded` store writes them), the target answers
greedily; over the answer tokens the table gives the target's mean top-1 probability (the probability of the
token it wrote), the share of tokens it wrote with probability >= 0.9, its mean entropy and the share of tokens
that already occur earlier in the conversation. A head that does far worse on one kind than on another the target
is as sure of is missing that kind of data, not facing harder text. Last, the share of the answer tokens that a
draft vocab of 8192 and of 16384 tokens holds (the most frequent tokens of the target's answers to the shared
prompts shipped with the package, the experiment's extract.regenerate.import_from, each answer's text tokenized
alone): no draft can propose a token
outside its vocab, so the share bounds the first draft token's acceptance. Appends the table to
experiments/BENCHMARKS.md with the command, machine and date.
"""

from __future__ import annotations

import gzip
import json
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch
from bench_common import machine, parse_bench_options
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import eaglet.config
from eaglet.config import check_config
from eaglet.data.conversations import load_conversations
from eaglet.data.holdout import eval_set_prompts, normalise_prompt
from eaglet.data.self_prompt import example_pool, self_prompt
from eaglet.data.templating import build_prompt_ids, resolve_chat_template
from eaglet.evaluate.prompts import load_prompt_sets
from eaglet.generation import decode_batch
from eaglet.shards.vocab import build_vocab_mapping, count_tokens
from eaglet.target_model import load_target

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS = {"prompts": 16, "new_tokens": 128, "seed": 11, "record": 1}
# The `seeded` store's examples: first user turns of the shared chat sets (recipes/smollm2_scale.py).
DRAFT_VOCABS = (8192, 16384)  # the scale recipe's draft vocab and its vocab16384 row's
CHAT_PROMPT_FILES = ("alpaca_en_demo", "oasst_en100", "oasst_prompt_lottery", "self_instruct_seed")
SELF_PROMPTED = {
    "self-prompted, as trained (T 1.0)": {},
    "self-prompted after 3 people's prompts (T 0.7, top_p 0.9)": {
        "examples": 3,
        "temperature": 0.7,
        "top_p": 0.9,
    },
}


def written_prompts(cfg, target, template: str, settings: dict, count: int, seed: int) -> list[list[int]]:
    """`count` prompts the target writes with extract.self_prompt plus `settings`, chat-templated for answering."""
    sp = OmegaConf.merge(cfg.extract.self_prompt, {"num_prompts": count, "batch_size": count, **settings})
    pool = []
    if sp.examples:
        shared = Path(cfg.paths.shared_data)
        found, _ = load_conversations(
            [str(shared / f"{name}.jsonl") for name in CHAT_PROMPT_FILES], require_assistant=False
        )
        held_out = eval_set_prompts(
            cfg.eval.set_defs
        )  # as extraction draws them: evaluation prompts left out
        users = [t.content for c in found for t in c.turns if t.role == "user"]
        pool = example_pool([text for text in users if normalise_prompt(text) not in held_out])
    with tempfile.TemporaryDirectory() as folder:
        prompts, _ = self_prompt(
            target.model, target.tokenizer, sp, template=template, out_path=Path(folder) / "prompts.jsonl",
            seed=seed, held_out=eval_set_prompts(cfg.eval.set_defs), examples_from=pool, compile=False,
        )  # fmt: skip
    return [build_prompt_ids(target.tokenizer, [c.turns[0]], chat_template=template) for c in prompts]


def draft_vocabs(answers_file: Path, tokenizer, vocab_size: int) -> dict[int, torch.Tensor]:
    """Per size in DRAFT_VOCABS, the bool [vocab_size] mask of the ids a draft vocab of that size holds, built as
    extraction builds it from the counts of the tokens of the answers (assistant turns) in `answers_file`."""
    with gzip.open(answers_file, "rt", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    answers = [t["content"] for r in records for t in r["conversations"] if t["role"] == "assistant"]
    ids = torch.tensor([i for a in tokenizer(answers, add_special_tokens=False)["input_ids"] for i in a])
    counts = count_tokens(ids, torch.ones_like(ids), vocab_size)
    return {size: build_vocab_mapping(counts, size)[1] for size in DRAFT_VOCABS}


@torch.inference_mode()
def confidence(
    target, prompts: list[list[int]], new_tokens: int, vocabs: dict[int, torch.Tensor]
) -> dict[str, float]:
    """The target's greedy answers to `prompts`, how sure it was of each answer token, and the share of them
    each draft vocab of `vocabs` holds."""
    eos = int(target.tokenizer.eos_token_id)
    answers = decode_batch(target.model, prompts, max_new_tokens=new_tokens, stop_ids={eos}, pad_id=eos)
    top1, entropy, copied = [], [], 0
    held = dict.fromkeys(vocabs, 0)
    for prompt, answer in zip(prompts, answers, strict=True):
        for size, mask in vocabs.items():
            held[size] += int(mask[torch.tensor(answer, dtype=torch.long)].sum())
        ids = torch.tensor([prompt + answer], device=target.device)
        logits = (
            target.model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(answer) - 1].float()
        )
        probs = logits.softmax(dim=-1)
        top1 += probs.amax(dim=-1).tolist()
        entropy += (-(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)).tolist()
        copied += sum(token in set(prompt + answer[:i]) for i, token in enumerate(answer))
    n = len(top1)
    return {
        "prompts": len(prompts),
        "tokens": n,
        "top1": sum(top1) / n,
        "sure": sum(p >= 0.9 for p in top1) / n,
        "entropy": sum(entropy) / n,
        "copied": copied / n,
        **{f"in_vocab_{size}": count / n for size, count in held.items()},
    }


def main(argv: list[str]) -> None:
    opts, overrides = parse_bench_options(argv, DEFAULTS)
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["experiments=smollm2_scale", "model.dtype=float32", f"eval.prompts_per_set={opts['prompts']}", *overrides],
        )  # fmt: skip
    check_config(cfg)
    target = load_target(cfg.model, device="auto", cache_dir=Path(cfg.paths.cache_dir))
    template = resolve_chat_template(target.tokenizer, cfg.model.chat_template)
    answers_file = Path(cfg.extract.regenerate.import_from)
    vocabs = draft_vocabs(answers_file, target.tokenizer, int(target.model.config.vocab_size))
    kinds = {name: prompts for name, (prompts, _) in load_prompt_sets(cfg, target.tokenizer).items()}
    for name, settings in SELF_PROMPTED.items():
        kinds[name] = written_prompts(cfg, target, template, settings, opts["prompts"], opts["seed"])
    header = (
        "| date | machine | target | prompts | kind of prompt | answer tokens | mean top-1 probability "
        "| written at p >= 0.9 | mean entropy (nats) | already in the conversation "
        + "".join(f"| in a {size:,}-token draft vocab " for size in DRAFT_VOCABS)
        + "|\n"
        + "|---" * (10 + len(DRAFT_VOCABS))
        + "|"
    )
    rows = []
    for name, prompts in kinds.items():
        c = confidence(target, prompts[: opts["prompts"]], opts["new_tokens"], vocabs)
        rows.append(
            f"| {date.today()} | {machine()} | {cfg.model.name} ({target.dtype}) | {c['prompts']} | {name} "
            f"| {c['tokens']:,} | {c['top1']:.3f} | {c['sure']:.1%} | {c['entropy']:.2f} | {c['copied']:.1%} |"
            + "".join(f" {c[f'in_vocab_{size}']:.1%} |" for size in DRAFT_VOCABS)
        )
        print(rows[-1], flush=True)
    table = header + "\n" + "\n".join(rows)
    print(table)
    if opts["record"]:
        command = "python benchmarks/target_confidence.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(
                f"\n### How sure the target is of its answers, by kind of prompt — `{command.strip()}`\n\n{table}\n"
            )
        print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
