"""In-process regeneration throughput: the turn-serial scheduler eaglet had before against continuous batching.

    python benchmarks/bench_regenerate.py                                   # embedded SmolLM2, 64 conversations
    python benchmarks/bench_regenerate.py bench.conversations=512 bench.batch_size=512 bench.max_new_tokens=640

Both schedulers answer the same multi-turn conversations (ShareGPT and OpenAssistant, at least two user turns
each) greedily, turn by turn. "turn-serial" is the previous scheduler, kept here for comparison: fixed
length-sorted batches in which user turn r+1 of every conversation waits for turn r of all of them, decoded
with a DynamicCache, Python per row at every step, and a cache copy whenever a row finishes. "continuous" is
eaglet's `regenerate_conversations` (rows refilled with the next turn or conversation as answers finish; it
also writes and fsyncs the output file, which the turn-serial timing leaves out). The row is appended to
experiments/BENCHMARKS.md.
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers import DynamicCache

import eaglet.config
from eaglet.config import check_config
from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation, Turn, read_jsonl_conversations
from eaglet.data.regenerate import regenerate_conversations
from eaglet.data.regenerated import user_turn_groups
from eaglet.data.templating import build_prompt_ids
from eaglet.target_model import load_target

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
DEFAULTS = {
    "conversations": 64,
    "max_new_tokens": 64,
    "batch_size": 16,
    "refill_every": 16,
    "max_length": 2048,
    "schedulers": "turn-serial,continuous",
    # 0: print the table without appending it to BENCHMARKS.md.
    "record": 1,
    # 1: also profile the continuous scheduler (torch.profiler): time per phase and the busiest kernels.
    "profile": 0,
}
SOURCES = ("sharegpt_v3_head.jsonl", "oasst_en100.jsonl")


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads (torch {torch.__version__})"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def multi_turn(shared_data: Path, count: int) -> list[Conversation]:
    """The first `count` conversations with two or more user turns, alternating between the source files."""
    streams = [
        (c for c in read_jsonl_conversations(shared_data / name) if len(user_turn_groups(c)) >= 2)
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
) -> tuple[list[list[Turn]], int]:
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
    return answers, generated


def continuous(
    model, tokenizer, conversations: list[Conversation], opts: dict
) -> tuple[list[list[Turn]], int]:
    cfg = RegenerateConfig(
        enabled=True,
        max_new_tokens=opts["max_new_tokens"],
        batch_size=opts["batch_size"],
        refill_every=opts["refill_every"],
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
    return [list(c.turns) for c in out], stats.generated_tokens


def profile_continuous(model, tokenizer, conversations: list[Conversation], opts: dict) -> None:
    """One continuous run under torch.profiler: wall time per phase (regen.* ranges) and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        continuous(model, tokenizer, conversations, opts)
        sync()
    events = prof.key_averages()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("| phase | calls | CPU s | device s |\n|---|---|---|---|")
    for event in sorted((e for e in events if e.key.startswith("regen.")), key=lambda e: -e.cpu_time_total):
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
    conversations = multi_turn(Path(cfg.paths.shared_data), opts["conversations"])
    runners = {"turn-serial": turn_serial, "continuous": continuous}
    chosen = opts["schedulers"].split(",")
    # Warm-up: kernels, allocator, tokenizer caches.
    for name in chosen:
        runners[name](target.model, target.tokenizer, conversations[:2], {**opts, "max_new_tokens": 4})
    if opts["profile"]:
        profile_continuous(target.model, target.tokenizer, conversations, opts)
    results = {}
    for name in chosen:
        sync()
        start = time.perf_counter()
        answers, tokens = runners[name](target.model, target.tokenizer, conversations, opts)
        sync()
        results[name] = (answers, tokens, time.perf_counter() - start)

    header = (
        "| date | machine | target | scheduler | conversations | answered turns | generated tokens | batch "
        "| seconds | tokens/s | speed-up |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    base = next(iter(results.values()))
    rows = []
    for name, (answers, tokens, seconds) in results.items():
        turns = sum(t.role == "assistant" for a in answers for t in a)
        rows.append(
            f"| {date.today()} | {machine()} | {cfg.model.name} ({target.dtype}) | {name} | {len(conversations)} "
            f"| {turns:,} | {tokens:,} | {opts['batch_size']} | {seconds:,.1f} | {tokens / seconds:,.0f} "
            f"| {base[2] / seconds:.2f}x |"
        )
    print(header)
    print("\n".join(rows))
    notes = []
    if len(results) == 2:
        (first, second) = (r[0] for r in results.values())
        pairs = [(a, b) for x, y in zip(first, second, strict=True) for a, b in zip(x, y, strict=False)]
        same = sum(a == b for a, b in pairs if a.role == "assistant")
        total = sum(a.role == "assistant" for a, _ in pairs)
        notes.append(f"Greedy answers identical between the schedulers: {same}/{total} turns.")
        print(notes[-1])
    if not opts["record"]:
        return
    command = "python benchmarks/bench_regenerate.py " + " ".join(argv)
    settings = f"max_new_tokens {opts['max_new_tokens']}, max_length {opts['max_length']}, refill_every {opts['refill_every']}"
    with open(BENCH_FILE, "a") as fh:
        fh.write(f"\n### Regeneration throughput — `{command.strip()}`\n\n{settings}. {' '.join(notes)}\n\n")
        fh.write(f"{header}\n" + "\n".join(rows) + "\n")
    print(f"appended to {BENCH_FILE}")


if __name__ == "__main__":
    main(sys.argv[1:])
