"""Self-prompting: the user-turn prefix, near-duplicate removal, holdout, resume and reuse, end to end on the
tiny target (its decoder scripted where the test needs chosen texts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglet.config import shared_data_dir
from eaglet.data import self_prompt as sp_module
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.near_duplicates import NearDuplicates, jaccard, shingles
from eaglet.data.self_prompt import next_user_turn_prefix, next_user_turn_prefixes, user_turn_prefix
from eaglet.errors import ConfigError
from eaglet.extract.stage import run_extraction
from eaglet.shards import ShardReader

SHARED = shared_data_dir()
LONG = "please write a short python function that returns the sum of the squares of a list of numbers"


def test_near_duplicates_exact_near_and_distinct() -> None:
    seen = NearDuplicates(0.7)
    seen.add(LONG)
    assert seen.check(LONG) == "exact"
    near = LONG.replace("short", "small")  # one word of 18 changed
    assert jaccard(shingles(LONG), shingles(near)) >= 0.7
    assert seen.check(near) == "near"
    assert seen.check("what is the capital of france and why is it famous") is None
    far = LONG.replace("sum of the squares", "product of the cubes").replace("python", "rust")
    assert jaccard(shingles(LONG), shingles(far)) < 0.7 and seen.check(far) is None
    with pytest.raises(ValueError, match="threshold"):
        NearDuplicates(0)
    # A text added right after another was checked is indexed under its own keys, not the checked one's.
    other = "how do tides work and what role does the moon play in them"
    assert seen.check("what is the capital of france and why is it famous") is None
    seen.add(other)
    assert seen.check(other.replace("work", "happen")) == "near"
    assert seen.check("what is the capital of france and why is it famous") is None


def test_the_prefix_is_the_template_up_to_the_user_text(compose) -> None:
    from eaglet.target_model import load_target

    cfg = compose("model=tiny_llama")
    tokenizer = load_target(cfg.model, device="cpu", cache_dir=Path(cfg.paths.cache_dir)).tokenizer
    ids, end = user_turn_prefix(tokenizer, None, "You answer questions about cooking.")
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\n") and "You answer questions about cooking." in text
    assert end == tokenizer.convert_tokens_to_ids("<|im_end|>")
    # A round's prefixes, tokenized in one call, are each the one-by-one prefix.
    histories = [
        [],
        [Turn("system", "Be brief.")],
        [
            Turn("user", "Wie spät ist es?  \n\n"),
            Turn("assistant", "Sure."),
            Turn("user", "naïve café 🍰 x²"),
        ],
        [Turn("system", "S"), Turn("user", "  leading spaces"), Turn("assistant", "Sure.")],
    ]
    assert next_user_turn_prefixes(tokenizer, tokenizer.chat_template, histories) == [
        next_user_turn_prefix(tokenizer, tokenizer.chat_template, h)[0] for h in histories
    ]
    assert next_user_turn_prefixes(tokenizer, tokenizer.chat_template, []) == []


def scripted(texts: list[str], calls: list[int]):
    """A decoder that answers each prompt with the next of `texts` (cycling), as token ids."""

    def decode_batch(model, prompts, *, max_new_tokens, seeds, **kwargs):
        calls.append(len(prompts))
        tokenizer = scripted.tokenizer
        out = []
        for _ in prompts:
            text = texts[scripted.next % len(texts)]
            scripted.next += 1
            out.append(
                [0] * max_new_tokens
                if text == "<unfinished>"
                else tokenizer.encode(text, add_special_tokens=False)
            )
        return out

    return decode_batch


def overrides(data: Path, tmp: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_llama", "dataset=jsonl", f"dataset.paths=[{data}]", f"paths.data_dir={tmp}",
        f"extract.output_dir={tmp / 'out'}", "extract.max_length=256", "extract.regenerate.enabled=true",
        "extract.regenerate.max_new_tokens=4", "extract.self_prompt.batch_size=4", *extra,
    ]  # fmt: skip


def test_self_prompted_conversations_join_the_dataset_filtered_and_resumable(
    compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eaglet.data.holdout import eval_set_prompts

    data = tmp_path / "d.jsonl"
    data.write_text("".join((SHARED / "oasst_en100.jsonl").read_text().splitlines(keepends=True)[:2]))
    dataset_prompt = json.loads(data.read_text().splitlines()[0])["conversations"][0]["content"]
    cfg = compose(*overrides(data, tmp_path))
    eval_prompt = sorted(eval_set_prompts(cfg.eval.set_defs))[0]
    texts = [
        LONG, LONG, LONG.replace("short", "small"), "hi", "<unfinished>", eval_prompt, dataset_prompt,
        "explain how a rainbow forms in the sky after the rain stops",
        "write a haiku about autumn leaves falling on a quiet river",
        "how many days are there in a leap year and why do we need them",
    ]  # fmt: skip
    calls: list[int] = []
    scripted.next = 0
    from eaglet.target_model import load_target

    scripted.tokenizer = load_target(cfg.model, device="cpu", cache_dir=Path(cfg.paths.cache_dir)).tokenizer
    monkeypatch.setattr(sp_module, "decode_batch", scripted(texts, calls))

    first = run_extraction(compose(*overrides(data, tmp_path, "extract.self_prompt.num_prompts=2")))
    files = list((tmp_path / "self_prompted").glob("*.jsonl"))
    assert len(files) == 1
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [r["conversations"][0]["content"] for r in records] == [LONG, texts[7]]
    assert first.sequences == 2 + 2  # the dataset's two and two prompts, answered
    report = json.loads(files[0].with_suffix(".report.json").read_text())
    # Duplicates: LONG again and the dataset's own first prompt; near: LONG with one word changed.
    assert report["dropped"] == {
        "unfinished": 1,
        "too_short": 1,
        "duplicates": 2,
        "near_duplicates": 1,
        "held_out": 1,
    }
    assert sum(report["categories"].values()) == 2

    # Asking for more extends the same file; what was kept is read back, not generated again.
    scripted.next = 8
    more = run_extraction(
        compose(
            *overrides(
                data, tmp_path, "extract.self_prompt.num_prompts=4", f"extract.output_dir={tmp_path / 'o2'}"
            )
        )
    )
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [r["conversations"][0]["content"] for r in records] == [LONG, texts[7], texts[8], texts[9]]
    assert len({r["id"] for r in records}) == 4
    assert more.sequences == 2 + 4
    assert len(ShardReader(tmp_path / "o2")) == 6

    # A kill mid-append leaves a partial line: it is cut, and the prompts before it are kept.
    with open(files[0], "ab") as fh:
        fh.write(b'{"id": "sp-99", "categ')
    kept = sp_module._read(files[0])
    assert len(kept) == 4 and files[0].read_bytes().endswith(b"\n")


def test_examples_from_the_dataset_come_before_each_prompt_and_are_never_kept(
    compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extract.self_prompt.examples=2: each prompt is written after two of the dataset's user prompts (drawn per
    prompt, the same on a rerun), each answered by example_reply; a prompt that copies one is a duplicate."""
    from eaglet.target_model import load_target

    data = tmp_path / "d.jsonl"
    data.write_text("".join((SHARED / "oasst_en100.jsonl").read_text().splitlines(keepends=True)[:6]))
    users = [
        t["content"]
        for line in data.read_text().splitlines()
        for t in json.loads(line)["conversations"]
        if t["role"] == "user"
    ]
    short = sp_module.example_pool(users)  # every user turn of at most 400 characters
    assert len(short) >= 3
    cfg = compose(*overrides(data, tmp_path))
    tokenizer = load_target(cfg.model, device="cpu", cache_dir=Path(cfg.paths.cache_dir)).tokenizer
    scripted.tokenizer = tokenizer
    texts = [
        short[0],
        "explain how a rainbow forms in the sky after the rain stops",
        "name three rivers of africa",
    ]
    seen_prompts: list[list[int]] = []
    decode = scripted(texts, [])

    def recording(model, prompts, **kwargs):
        seen_prompts.extend(prompts)
        return decode(model, prompts, **kwargs)

    settings = ["extract.self_prompt.num_prompts=2", "extract.self_prompt.examples=2",
                "extract.self_prompt.example_reply=Of course."]  # fmt: skip
    scripted.next = 0
    monkeypatch.setattr(sp_module, "decode_batch", recording)
    run_extraction(compose(*overrides(data, tmp_path, *settings)))
    records = [
        json.loads(line)
        for f in (tmp_path / "self_prompted").glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert [r["conversations"][0]["content"] for r in records] == texts[1:]  # the copied example was dropped
    rendered = [tokenizer.decode(ids) for ids in seen_prompts[:3]]
    for text in rendered:
        assert sum(example in text for example in short) == 2 and text.count("Of course.") == 2
        assert text.endswith("<|im_start|>user\n")
    assert len(set(rendered)) > 1  # drawn afresh for each prompt

    # The same settings draw the same examples: a rerun renders the same prefixes.
    first = list(seen_prompts)
    seen_prompts.clear()
    scripted.next = 0
    monkeypatch.setattr(sp_module, "_read", lambda path: [])  # generate again instead of reading back
    run_extraction(compose(*overrides(data, tmp_path, *settings, f"extract.output_dir={tmp_path / 'o2'}")))
    assert seen_prompts[: len(first)] == first

    # From other files instead of the dataset: their prompts only, never an evaluation prompt.
    from eaglet.data.holdout import eval_set_prompts, normalise_prompt

    eval_prompt = sorted(eval_set_prompts(cfg.eval.set_defs))[0]
    mine = ["name a bird that cannot fly", "what is the boiling point of water", "suggest a name for a cat"]
    pool_file = tmp_path / "pool.jsonl"
    pool_file.write_text(
        "".join(
            json.dumps({"id": str(i), "conversations": [{"role": "user", "content": t}]}) + "\n"
            for i, t in enumerate([*mine, eval_prompt])
        )
    )
    seen_prompts.clear()
    before = set((tmp_path / "self_prompted").glob("*.jsonl"))
    texts[:] = [mine[0], "describe how volcanoes form under the sea", "tell me the history of paper making"]
    scripted.next = 0
    run_extraction(
        compose(
            *overrides(data, tmp_path, *settings, f"extract.output_dir={tmp_path / 'o3'}"),
            f"extract.self_prompt.example_paths=[{pool_file}]",
        )
    )
    (written,) = set((tmp_path / "self_prompted").glob("*.jsonl")) - before  # other examples: another file
    kept = [json.loads(line)["conversations"][0]["content"] for line in written.read_text().splitlines()]
    assert kept == texts[1:]  # a copy of an example is no new prompt
    for ids in seen_prompts:
        text = tokenizer.decode(ids)
        assert sum(t in text for t in mine) == 2 and not any(u in text for u in short)
        assert normalise_prompt(eval_prompt) not in normalise_prompt(text)

    with pytest.raises(ConfigError, match="extract.self_prompt.examples=9 draws"):
        run_extraction(
            compose(
                *overrides(
                    data, tmp_path, "extract.self_prompt.num_prompts=2", "extract.self_prompt.examples=9"
                )
            )
        )


def test_self_prompting_needs_answers_and_valid_settings(compose, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text((SHARED / "oasst_en100.jsonl").read_text().splitlines(keepends=True)[0])
    no_answers = [
        *overrides(data, tmp_path, "extract.self_prompt.num_prompts=2"),
        "extract.regenerate.enabled=false",
    ]
    with pytest.raises(ConfigError, match="extract.regenerate.enabled=true"):
        run_extraction(compose(*no_answers))
    with pytest.raises(ConfigError, match="extract.self_prompt.near_duplicate_jaccard"):
        run_extraction(compose(*overrides(data, tmp_path, "extract.self_prompt.near_duplicate_jaccard=1.5")))
    with pytest.raises(Exception, match="num_prompt"):
        compose(*overrides(data, tmp_path, "extract.self_prompt.num_prompt=2"))  # a typo names the key


def test_the_real_decoder_runs_and_a_target_that_never_ends_a_turn_gives_up(compose, tmp_path: Path) -> None:
    """Through eaglet.generation on the tiny random target (which never writes an end of turn): every prompt is
    dropped as unfinished, and after a few rounds without a new prompt the run stops instead of looping."""
    from eaglet.config.schema import SelfPromptConfig
    from eaglet.target_model import load_target

    cfg = compose("model=tiny_llama")
    target = load_target(cfg.model, device="cpu", cache_dir=Path(cfg.paths.cache_dir))
    settings = SelfPromptConfig(
        num_prompts=2, max_prompt_tokens=3, batch_size=2, categories={"a": None, "b": "Be brief."}
    )
    prompts, stats = sp_module.self_prompt(
        target.model, target.tokenizer, settings, template=None, out_path=tmp_path / "p.jsonl", seed=0,
        held_out=set(),
    )  # fmt: skip
    assert prompts == [] and stats.generated == stats.unfinished > 0


def test_sampled_answers_for_the_datasets_conversations_only(
    compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sampled_from=dataset: people's prompts get sampled answers, the target's own prompts greedy ones only."""
    from eaglet.target_model import load_target

    data = tmp_path / "d.jsonl"
    data.write_text("".join((SHARED / "oasst_en100.jsonl").read_text().splitlines(keepends=True)[:2]))
    dataset_ids = [json.loads(line)["id"] for line in data.read_text().splitlines()]
    texts = [
        "explain how a rainbow forms in the sky after the rain stops",
        "write a haiku about autumn leaves falling on a quiet river",
    ]
    cfg = compose(*overrides(data, tmp_path))
    scripted.tokenizer = load_target(cfg.model, device="cpu", cache_dir=Path(cfg.paths.cache_dir)).tokenizer
    monkeypatch.setattr(sp_module, "decode_batch", scripted(texts, []))
    sampled = ["extract.self_prompt.num_prompts=2", "extract.regenerate.samples_per_prompt=3"]

    def sampled_ids() -> list[str]:
        files = [f for f in (tmp_path / "regenerated").iterdir() if "#s1" in f.read_text()]
        return sorted(json.loads(line)["id"] for f in files for line in f.read_text().splitlines())

    for sampled_from, sequences, out in (("dataset", 2 + 2 + 2 * 2, "o1"), ("all", 2 + 2 + 4 * 2, "o2")):
        scripted.next = 0
        summary = run_extraction(
            compose(
                *overrides(
                    data, tmp_path, *sampled, f"extract.regenerate.sampled_from={sampled_from}",
                    f"extract.output_dir={tmp_path / out}",
                )
            )
        )  # fmt: skip
        assert summary.sequences == sequences, sampled_from
        people = sorted(f"{i}#s{k}" for i in dataset_ids for k in (1, 2))
        own = sorted(f"sp-{a}#s{k}" for a in (0, 1) for k in (1, 2))
        # The second run reuses the dataset's sampled answers and adds the self-prompted ones'.
        assert sampled_ids() == (people if sampled_from == "dataset" else sorted(people + own))
    with pytest.raises(Exception, match="sampled_from"):
        compose(*overrides(data, tmp_path, "extract.regenerate.sampled_from=people"))


def test_a_kept_prompt_with_a_unicode_line_separator_is_read_back_whole(tmp_path: Path) -> None:
    """The target may write U+2028 or U+0085 in a prompt; a resumed run reads the file back record by record."""
    path = tmp_path / "prompts.jsonl"
    prompts = [
        Conversation(id="sp-0", turns=(Turn("user", "first\u2028second\x85third"),), source="", line=0),
        Conversation(id="sp-3", turns=(Turn("user", "plain"),), source="", line=0),
    ]
    with open(path, "ab") as sink:
        sp_module._append(sink, prompts, ["a", "b"])
    assert [(c.id, c.turns[0].content) for c in sp_module._read(path)] == [
        (c.id, c.turns[0].content) for c in prompts
    ]
