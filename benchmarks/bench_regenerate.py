"""In-process regeneration throughput: the generation engine against the reference decoder and older loops.

    python benchmarks/bench_regenerate.py                                   # embedded SmolLM2, 64 conversations
    python benchmarks/bench_regenerate.py bench.conversations=2048 bench.min_user_turns=1 bench.batch_size=1024 \
        bench.max_new_tokens=640 bench.schedulers=engine,engine-sampled,reference,transformers-cb bench.compare=256

Every scheduler answers the same conversations (the shared ShareGPT, OpenAssistant, ... files; with
`bench.min_user_turns=2` only those with two or more user turns), turn by turn, through eaglet's
`regenerate_conversations` unless said otherwise:
- "engine": the generation engine (static slots, CUDA graphs; eaglet.generation.engine), greedy, with the
  settings extraction uses by default (prefills replayed from CUDA graphs).
- "engine-sampled": the same, sampled (`bench.temperature`, `bench.top_p`), `bench.samples` answers per prompt.
- "engine-eager-prefill", "engine-sampled-eager-prefill": the same two with each prefill's kernels launched one by
  one (extract.regenerate.prefill_graphs=false).
- "engine-padded-prefill", "engine-sampled-padded-prefill": the same two with the prompts of a prefill
  right-padded to a common width (extract.regenerate.packed_prefill=false) instead of packed end to end.
- "engine-sampled-search": "engine-sampled" with the nucleus found by the threshold search instead of by
  rejection (eaglet.generation.sampling_kernel.METHODS; the same picks).
- "engine-overlap", "engine-sampled-overlap": the engine with the prefills queued behind each window
  (extract.regenerate.overlap_prefill=true, prefills eager).
- "reference": the reference decoder (eaglet.generation.continuous), greedy.
- "turn-serial": the scheduler before continuous batching, kept for comparison: fixed length-sorted batches in
  which user turn r+1 waits for turn r of all of them, a DynamicCache, Python per row at every step.
- "transformers-cb": transformers' own continuous batching (`generate_batch`, paged attention) on the first
  user turn of each conversation, greedy (one turn: its API takes prompts, not conversations).
`bench.compare=N` decodes the first turn of N conversations with both decoders and counts the answers that
are token-identical; where they differ it reads the target's logits of the two tokens at the first difference
and counts the near-ties (within two bf16 steps of each other). Rows are appended to experiments/BENCHMARKS.md.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch
from bench_common import machine  # noqa: E402
from hydra import compose, initialize_config_dir
from transformers import DynamicCache

import eaglet.config
from eaglet.config import check_config
from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation, Turn, read_jsonl_conversations
from eaglet.data.regenerate import regenerate_conversations
from eaglet.data.regenerated import user_turn_groups
from eaglet.data.templating import build_prompt_ids
from eaglet.generation import decode_batch, sampling_kernel
from eaglet.target_model import load_target

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS = {
    "conversations": 64,
    "min_user_turns": 2,
    # Conversations cut after this many user turns (0: whole): 1 measures answers that need no earlier answer.
    "max_user_turns": 0,
    "max_new_tokens": 64,
    "batch_size": 16,
    "refill_every": 16,
    "max_length": 2048,
    "schedulers": "turn-serial,reference,engine",
    "temperature": "0.7",
    "top_p": "0.95",
    "samples": 1,
    "compare": 0,
    # 1: the engine's decode step through torch.compile (extract.regenerate.compile).
    "compile": 1,
    # 0: print the table without appending it to BENCHMARKS.md.
    "record": 1,
    # 1: also profile the engine (torch.profiler): time per phase and the busiest kernels.
    "profile": 0,
}
SOURCES = ("sharegpt_v3_head.jsonl", "oasst_en100.jsonl", "oasst_prompt_lottery.jsonl", "alpaca_en_demo.jsonl",
           "gpteacher_codegen.jsonl", "self_instruct_seed.jsonl", "gsm8k_train.jsonl")  # fmt: skip


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pick_conversations(shared_data: Path, count: int, min_user_turns: int) -> list[Conversation]:
    """The first `count` conversations with `min_user_turns` user turns or more, alternating between the files."""
    streams = [
        (
            c
            for c in read_jsonl_conversations(shared_data / name)
            if len(user_turn_groups(c)) >= min_user_turns
        )
        for name in SOURCES
    ]
    picked: list[Conversation] = []
    while len(picked) < count and streams:
        for stream in list(streams):
            conv = next(stream, None)
            if conv is None:
                streams.remove(stream)
            elif len(picked) < count:
                picked.append(conv)
    return picked


@torch.inference_mode()
def turn_serial_decode(
    model, prompts: list[list[int]], max_new_tokens: int, stop: int, pad: int
) -> list[list[int]]:
    """The previous decoding loop: left-padded batch, rows leave the DynamicCache as they finish."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    rows = torch.arange(len(prompts), device=device)
    next_pos = positions[:, -1] + 1
    results: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        tokens = out.logits[:, -1].argmax(dim=-1)
        live = tokens != stop
        for row, token, alive in zip(rows.tolist(), tokens.tolist(), live.tolist(), strict=True):
            if alive:
                results[row].append(token)
        if step == max_new_tokens - 1 or not live.any():
            break
        if not live.all():
            keep = live.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, tokens, next_pos, attention_mask = (
                rows[keep],
                tokens[keep],
                next_pos[keep],
                attention_mask[keep],
            )
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
        out = model(
            input_ids=tokens[:, None],
            attention_mask=attention_mask,
            position_ids=next_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
    return results


def turn_serial(
    model, tokenizer, conversations: list[Conversation], opts: dict
) -> tuple[list[list[Turn]], int, int]:
    """The previous scheduler: (turns per conversation, generated tokens)."""
    pending = sorted(
        range(len(conversations)), key=lambda i: (len(conversations[i].turns[0].content), conversations[i].id)
    )
    answers: list[list[Turn]] = [[] for _ in conversations]
    generated = 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for first in range(0, len(pending), opts["batch_size"]):
        batch = pending[first : first + opts["batch_size"]]
        groups = {i: user_turn_groups(conversations[i]) for i in batch}
        alive = set(batch)
        for r in range(max(len(g) for g in groups.values())):
            active, prompts = [], []
            for i in batch:
                if i not in alive or r >= len(groups[i]):
                    continue
                turns = answers[i] + groups[i][r]
                ids = build_prompt_ids(tokenizer, turns)
                if len(ids) + opts["max_new_tokens"] > opts["max_length"]:
                    alive.discard(i)
                    continue
                answers[i] = turns
                active.append(i)
                prompts.append(ids)
            if not active:
                break
            outputs = turn_serial_decode(model, prompts, opts["max_new_tokens"], tokenizer.eos_token_id, pad)
            for i, ids in zip(active, outputs, strict=True):
                answers[i].append(Turn("assistant", tokenizer.decode(ids, skip_special_tokens=True).strip()))
                generated += len(ids)
    return answers, generated, opts["batch_size"]


def regenerate(
    model,
    tokenizer,
    conversations: list[Conversation],
    opts: dict,
    *,
    engine: str,
    sampled: bool = False,
    overlap: bool = False,
    graphs: bool = True,
    packed: bool | None = None,
) -> tuple[list[list[Turn]], int, int]:
    """eaglet's regeneration with the chosen decoder: (turns per conversation, generated tokens, rows decoded at
    once)."""
    # Several answers per prompt: copies under their own ids, so each samples its own stream.
    if sampled and opts["samples"] > 1:
        conversations = [replace(c, id=f"{c.id}#{k}") for c in conversations for k in range(opts["samples"])]
    cfg = RegenerateConfig(
        enabled=True,
        max_new_tokens=opts["max_new_tokens"],
        batch_size=opts["batch_size"],
        refill_every=opts["refill_every"],
        engine=engine,
        compile=bool(opts["compile"]),
        overlap_prefill=overlap,
        prefill_graphs=graphs,
        packed_prefill=packed,
        temperature=float(opts["temperature"]) if sampled else 0.0,
        top_p=float(opts["top_p"]) if sampled else 1.0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out, stats = regenerate_conversations(
            model,
            tokenizer,
            conversations,
            cfg=cfg,
            out_path=Path(tmp) / "r.jsonl",
            max_length=opts["max_length"],
        )
    return [list(c.turns) for c in out], stats.generated_tokens, stats.rows


def sampled_by_search(model, tokenizer, conversations: list[Conversation], opts: dict):
    """ "engine-sampled" with the sampling kernel's threshold search."""
    before, sampling_kernel.default_method = sampling_kernel.default_method, "search"
    try:
        return regenerate(model, tokenizer, conversations, opts, engine="engine", sampled=True)
    finally:
        sampling_kernel.default_method = before


def first_user_turns(conv: Conversation, count: int) -> Conversation:
    """`conv` up to (not including) its user turn number `count` + 1."""
    groups = user_turn_groups(conv)
    if len(groups) <= count:
        return conv
    first_cut = groups[count][0]
    cut = next(i for i, turn in enumerate(conv.turns) if turn is first_cut)
    return replace(conv, turns=conv.turns[:cut])


def first_turn_prompts(tokenizer, conversations: list[Conversation], opts: dict) -> list[list[int]]:
    """The prompt of each conversation's first user turn, where it leaves room for the answer."""
    prompts = [build_prompt_ids(tokenizer, user_turn_groups(c)[0]) for c in conversations]
    return [p for p in prompts if len(p) + opts["max_new_tokens"] <= opts["max_length"]]


def transformers_cb(
    model, tokenizer, conversations: list[Conversation], opts: dict
) -> tuple[list[list[Turn]], int, int]:
    """transformers' generate_batch over the first user turns, greedy (its paged attention, CUDA graphs)."""
    from transformers import GenerationConfig

    prompts = first_turn_prompts(tokenizer, conversations, opts)
    previous = model.config._attn_implementation
    model.set_attn_implementation("paged|sdpa")
    try:
        config = GenerationConfig(
            max_new_tokens=opts["max_new_tokens"], do_sample=False, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )  # fmt: skip
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    finally:
        model.set_attn_implementation(previous)
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return [[Turn("assistant", "")] for _ in results], tokens, opts["batch_size"]


SCHEDULERS = {
    "turn-serial": lambda m, t, c, o: turn_serial(m, t, c, o),
    "reference": lambda m, t, c, o: regenerate(m, t, c, o, engine="reference"),
    "engine": lambda m, t, c, o: regenerate(m, t, c, o, engine="engine"),
    "engine-sampled": lambda m, t, c, o: regenerate(m, t, c, o, engine="engine", sampled=True),
    "engine-eager-prefill": lambda m, t, c, o: regenerate(m, t, c, o, engine="engine", graphs=False),
    "engine-sampled-eager-prefill": lambda m, t, c, o: regenerate(
        m, t, c, o, engine="engine", sampled=True, graphs=False
    ),
    "engine-padded-prefill": lambda m, t, c, o: regenerate(m, t, c, o, engine="engine", packed=False),
    "engine-sampled-padded-prefill": lambda m, t, c, o: regenerate(
        m, t, c, o, engine="engine", sampled=True, packed=False
    ),
    "engine-sampled-search": sampled_by_search,
    "engine-overlap": lambda m, t, c, o: regenerate(m, t, c, o, engine="engine", overlap=True, graphs=False),
    "engine-sampled-overlap": lambda m, t, c, o: regenerate(
        m, t, c, o, engine="engine", sampled=True, overlap=True, graphs=False
    ),
    "transformers-cb": transformers_cb,
}
# Rows counted in answers (several per prompt, or first turns only), not in conversations.
SAMPLED = ("engine-sampled", "engine-sampled-eager-prefill", "engine-sampled-padded-prefill", "engine-sampled-search",
           "engine-sampled-overlap", "transformers-cb")  # fmt: skip


@torch.inference_mode()
def compare_decoders(model, tokenizer, conversations: list[Conversation], opts: dict) -> str:
    """Greedy first-turn answers of the engine against the reference decoder: identical, near-ties, the rest."""
    prompts = first_turn_prompts(tokenizer, conversations[: opts["compare"]], opts)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    common = {"max_new_tokens": opts["max_new_tokens"], "stop_ids": {eos}, "pad_id": pad}
    reference = decode_batch(model, prompts, engine="reference", **common)
    # The engine as regeneration runs it (rows, compiled step): the same arithmetic as the timed rows.
    engine = decode_batch(
        model, prompts, engine="engine", max_rows=opts["batch_size"], compile=bool(opts["compile"]), **common
    )
    differ, near_ties, widest = 0, 0, 0.0
    device = next(model.parameters()).device
    for prompt, ours, theirs in zip(prompts, engine, reference, strict=True):
        if ours == theirs:
            continue
        differ += 1
        at = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        picks = [seq[at] if at < len(seq) else eos for seq in (ours, theirs)]
        logits = model(torch.tensor([prompt + theirs[:at]], device=device)).logits[0, -1].float()
        a, b = logits[picks[0]].item(), logits[picks[1]].item()
        # Two bf16 steps at this magnitude: bf16 keeps 8 significant bits.
        step = 2.0 ** (math.floor(math.log2(max(abs(a), abs(b), 1e-30))) - 7)
        near_ties += abs(a - b) <= 2 * step
        widest = max(widest, abs(a - b))
    return (
        f"Greedy first-turn answers, engine against the reference decoder: {len(prompts) - differ}/{len(prompts)} "
        f"token-identical; of the {differ} that differ, {near_ties} part at a near-tie (the two tokens' logits within "
        f"two bf16 steps; widest gap {widest:.3g})."
    )


def profile_engine(model, tokenizer, conversations: list[Conversation], opts: dict) -> None:
    """One engine run under torch.profiler: wall time per phase (engine.* ranges) and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        regenerate(model, tokenizer, conversations, opts, engine="engine")
        sync()
    events = prof.key_averages()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("| phase | calls | CPU s | device s |\n|---|---|---|---|")
    for event in sorted((e for e in events if e.key.startswith("engine.")), key=lambda e: -e.cpu_time_total):
        device_us = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0))
        print(f"| {event.key} | {event.count} | {event.cpu_time_total / 1e6:.2f} | {device_us / 1e6:.2f} |")
    print(events.table(sort_by=f"self_{device}_time_total", row_limit=20))


def main(argv: list[str]) -> None:
    opts = dict(DEFAULTS)
    overrides = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("bench."):
            name = key.removeprefix("bench.")
            if name not in DEFAULTS:
                sys.exit(f"unknown option {key}; the options are {', '.join('bench.' + k for k in DEFAULTS)}")
            opts[name] = value if isinstance(DEFAULTS[name], str) else int(value)
        else:
            overrides.append(arg)
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    check_config(cfg)
    target = load_target(cfg.model, device="auto", cache_dir=Path(cfg.paths.cache_dir))
    conversations = pick_conversations(
        Path(cfg.paths.shared_data), opts["conversations"], opts["min_user_turns"]
    )
    if opts["max_user_turns"]:
        conversations = [first_user_turns(c, opts["max_user_turns"]) for c in conversations]
    chosen = opts["schedulers"].split(",")
    unknown = [name for name in chosen if name not in SCHEDULERS]
    if unknown:
        sys.exit(f"unknown scheduler {unknown}; the schedulers are {', '.join(SCHEDULERS)}")
    model, tokenizer = target.model, target.tokenizer
    # Warm-up: kernels, allocator, tokenizer caches, and the engine's compiled step (compiled once per shape:
    # the same rows as the timed runs; the time it took is printed). Each run captures its graph again.
    for name in chosen:
        start = time.perf_counter()
        SCHEDULERS[name](model, tokenizer, conversations[:2], {**opts, "max_new_tokens": 4})
        print(f"{name}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
    if opts["profile"]:
        profile_engine(model, tokenizer, conversations, opts)
    results = {}
    for name in chosen:
        sync()
        start = time.perf_counter()
        try:
            answers, tokens, slots = SCHEDULERS[name](model, tokenizer, conversations, opts)
        except Exception as error:  # a comparison row (transformers' own API) may not run on this version
            print(f"{name}: failed: {type(error).__name__}: {error}")
            continue
        sync()
        results[name] = (answers, tokens, time.perf_counter() - start, slots)
        print(f"{name}: {tokens:,} tokens in {results[name][2]:.1f} s", flush=True)

    header = (
        "| date | machine | target | scheduler | conversations | answered turns | generated tokens | rows "
        "| seconds | new tokens/s | vs first row |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    base = next(iter(results.values()))
    rows = []
    for name, (answers, tokens, seconds, slots) in results.items():
        turns = sum(t.role == "assistant" for a in answers for t in a)
        count = len(answers) if name in SAMPLED else len(conversations)
        rows.append(
            f"| {date.today()} | {machine()} | {cfg.model.name} ({target.dtype}) | {name} | {count:,} "
            f"| {turns:,} | {tokens:,} | {slots:,} | {seconds:,.1f} | {tokens / seconds:,.0f} "
            f"| {base[2] / seconds * tokens / base[1]:.2f}x |"
        )
    print(header)
    print("\n".join(rows))
    notes = []
    greedy = (
        "reference",
        "engine",
        "engine-eager-prefill",
        "engine-padded-prefill",
        "engine-overlap",
        "turn-serial",
    )
    for kind, names in (("Greedy", greedy), ("Sampled", ("engine-sampled", "engine-sampled-search"))):
        runs = [results[n][0] for n in names if n in results]
        if len(runs) >= 2:
            pairs = [
                (a, b) for x, y in zip(runs[0], runs[1], strict=True) for a, b in zip(x, y, strict=False)
            ]
            same = sum(a == b for a, b in pairs if a.role == "assistant")
            total = sum(a.role == "assistant" for a, _ in pairs)
            notes.append(
                f"{kind} answers identical between the first two {kind.lower()} schedulers: {same}/{total} turns."
            )
            print(notes[-1])
    if opts["compare"]:
        notes.append(compare_decoders(model, tokenizer, conversations, opts))
        print(notes[-1])
    if not opts["record"]:
        return
    command = "python benchmarks/bench_regenerate.py " + " ".join(argv)
    settings = (
        f"max_new_tokens {opts['max_new_tokens']}, max_length {opts['max_length']}, refill_every "
        f"{opts['refill_every']}; sampled: temperature {opts['temperature']}, top_p {opts['top_p']}, "
        f"{opts['samples']} answer(s) per prompt"
    )
    with open(BENCH_FILE, "a") as fh:
        fh.write(f"\n### Regeneration throughput — `{command.strip()}`\n\n{settings}. {' '.join(notes)}\n\n")
        fh.write(f"{header}\n" + "\n".join(rows) + "\n")
    print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
