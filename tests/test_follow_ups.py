"""Follow-up turns of self-prompted conversations, end to end on the tiny target: its answers are real (greedy
regeneration), the user turns it writes are scripted (a random model never ends a turn)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from eaglet.config import shared_data_dir
from eaglet.config.schema import SelfPromptConfig
from eaglet.data import follow_ups as follow_ups_module
from eaglet.data import self_prompt as self_prompt_module
from eaglet.data.conversations import Turn
from eaglet.errors import ConfigError
from eaglet.extract.report import print_summary
from eaglet.extract.stage import run_extraction
from eaglet.fsutil import append_jsonl

SHARED = Path(os.environ.get("EAGLET_SHARED_DATA") or shared_data_dir())
PROMPTS = [
    "explain how a rainbow forms in the sky after the rain stops",
    "write a haiku about autumn leaves falling on a quiet river",
    "how many days are there in a leap year and why do we need them",
]
UNFINISHED, TOO_SHORT = "<unfinished>", "ok?"


class Scripted:
    """A decoder writing the next of `texts` for each prompt, recording the prompts it was given."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.prompts = tokenizer, texts, []

    def __call__(self, model, prompts, *, max_new_tokens, **kwargs) -> list[list[int]]:
        out = []
        for prompt in prompts:
            text = self.texts[len(self.prompts) % len(self.texts)]
            self.prompts.append(prompt)
            out.append(
                [0] * max_new_tokens
                if text == UNFINISHED
                else self.tokenizer.encode(text, add_special_tokens=False)
            )
        return out


@pytest.fixture
def tokenizer(compose):
    from eaglet.target_model import load_target

    cfg = compose("model=tiny_llama")
    return load_target(cfg.model, device="cpu", cache_dir=Path(cfg.paths.cache_dir)).tokenizer


def overrides(tmp: Path, *extra: str) -> list[str]:
    data = tmp / "d.jsonl"
    if not data.exists():
        tmp.mkdir(parents=True, exist_ok=True)
        data.write_text((SHARED / "oasst_en100.jsonl").read_text().splitlines(keepends=True)[0])
    return [
        "model=tiny_llama", "dataset=jsonl", f"dataset.paths=[{data}]", f"paths.data_dir={tmp / 'data'}",
        f"extract.output_dir={tmp / 'out'}", "extract.features=tokens", "extract.max_length=512",
        "extract.regenerate.enabled=true", "extract.regenerate.max_new_tokens=4",
        "extract.self_prompt.num_prompts=3", "extract.self_prompt.max_prompt_tokens=24",
        "extract.self_prompt.batch_size=4", *extra,
    ]  # fmt: skip


def self_prompted_records(data_dir: Path) -> dict[str, list[list[Turn]]]:
    """Every regenerated record of a self-prompted conversation, by id, shortest first."""
    records: dict[str, list[list[Turn]]] = {}
    for path in sorted((data_dir / "regenerated").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["id"].startswith("sp-"):
                turns = [Turn(t["role"], t["content"]) for t in record["conversations"]]
                records.setdefault(record["id"], []).append(turns)
    return {conv_id: sorted(versions, key=len) for conv_id, versions in records.items()}


def test_follow_ups_grow_the_conversations_from_their_rendered_history(
    compose, tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(self_prompt_module, "decode_batch", Scripted(tokenizer, PROMPTS))
    single = run_extraction(compose(*overrides(tmp_path / "single")))
    assert single.follow_ups is None
    one_turn = {
        conv_id: versions[-1]
        for conv_id, versions in self_prompted_records(tmp_path / "single" / "data").items()
    }

    monkeypatch.setattr(self_prompt_module, "decode_batch", Scripted(tokenizer, PROMPTS))
    # Round one: two follow-ups kept, one never ends; round two: one kept, one too short.
    follow = ["could you give me a concrete example of that", "and what about the opposite case", UNFINISHED,
              "thanks, now explain it to a child", TOO_SHORT]  # fmt: skip
    writer = Scripted(tokenizer, follow)
    monkeypatch.setattr(follow_ups_module, "decode_batch", writer)
    summary = run_extraction(compose(*overrides(tmp_path / "multi", "extract.self_prompt.follow_up_turns=2")))

    assert summary.follow_ups["user_turns"] == {"1": 1, "2": 1, "3": 1}
    assert summary.follow_ups["written"] == 3
    assert summary.follow_ups["dropped"] == {
        "unfinished": 1, "too_short": 1, "held_out": 0, "no_room": 0, "unanswered": 0,
    }  # fmt: skip
    assert summary.sequences == 1 + 3  # the dataset's conversation and three self-prompted ones
    report = json.loads(
        next((tmp_path / "multi" / "data" / "self_prompted").glob("*.report.json")).read_text()
    )
    assert report["follow_ups"]["written"] == 3
    assert "follow-up turns: 3 written" in self_prompt_module.format_self_prompt_report(report)
    console = Console(record=True, width=240)
    print_summary(summary, console)
    assert "3 turns written, 2 dropped; conversations by user turns 1: 1, 2: 1, 3: 1" in console.export_text()

    longest = {
        conv_id: versions[-1]
        for conv_id, versions in self_prompted_records(tmp_path / "multi" / "data").items()
    }
    user_texts = sorted([t.content for t in turns if t.role == "user"] for turns in longest.values())
    assert user_texts == sorted([[PROMPTS[0], follow[0], follow[3]], [PROMPTS[1], follow[1]], [PROMPTS[2]]])
    for conv_id, turns in longest.items():
        assert [t.role for t in turns] == ["user", "assistant"] * (len(turns) // 2)
        # The first turn and its greedy answer are exactly the one-turn run's.
        assert turns[:2] == one_turn[conv_id]

    # Each follow-up was written after the category's system prompt and the conversation so far, rendered by the
    # template up to where the next user message starts.
    names = sorted(SelfPromptConfig().categories)
    histories = [
        [Turn("system", SelfPromptConfig().categories[self_prompt_module.prompt_category(conv_id, names)]),
         *turns[: 2 * answered]]
        for answered in (1, 2)
        for conv_id, turns in sorted(longest.items(), key=lambda item: int(item[0][3:]))
        if len(turns) >= 2 * answered  # it had that many answers when the round began
    ]  # fmt: skip
    assert len(writer.prompts) == len(histories) == 5
    for prompt, history in zip(writer.prompts, histories, strict=True):
        rendered = tokenizer.apply_chat_template(
            [{"role": t.role, "content": t.content} for t in history], tokenize=False
        )
        assert prompt == tokenizer(rendered + "<|im_start|>user\n", add_special_tokens=False)["input_ids"]


def test_an_interrupted_run_resumes_without_writing_or_answering_finished_turns_again(
    compose, tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(self_prompt_module, "decode_batch", Scripted(tokenizer, PROMPTS))
    follow = [f"please tell me more about point number {n} of that" for n in range(6)]
    settings = overrides(tmp_path, "extract.self_prompt.follow_up_turns=2")

    class Killed(Exception):
        pass

    def dies_in_round_two(model, prompts, **kwargs):
        if writer.prompts:
            raise Killed  # as a kill would, after round one's turns were written and answered
        return writer(model, prompts, **kwargs)

    writer = Scripted(tokenizer, follow)
    monkeypatch.setattr(follow_ups_module, "decode_batch", dies_in_round_two)
    with pytest.raises(Killed):
        run_extraction(compose(*settings))
    assert len(writer.prompts) == 3

    writer = Scripted(tokenizer, follow[3:])
    monkeypatch.setattr(follow_ups_module, "decode_batch", writer)
    resumed = run_extraction(compose(*settings))
    # Only round two: its three follow-ups written, and answered; every earlier answer is read back.
    assert len(writer.prompts) == 3
    assert resumed.regenerate.generated_turns == 3 and resumed.regenerate.reused_turns == 2 * 3
    assert resumed.follow_ups["resumed"] == 3 and resumed.follow_ups["user_turns"] == {"3": 3}

    writer = Scripted(tokenizer, ["anything else"])
    monkeypatch.setattr(follow_ups_module, "decode_batch", writer)
    again = run_extraction(compose(*settings))
    assert not writer.prompts and again.regenerate.generated_turns == 0
    assert again.follow_ups == resumed.follow_ups | {
        "resumed": 6,
        "generated": 0,
        "seconds": again.follow_ups["seconds"],
    }


def test_sampled_answers_answer_the_follow_ups_too(
    compose, tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(self_prompt_module, "decode_batch", Scripted(tokenizer, PROMPTS))
    monkeypatch.setattr(
        follow_ups_module, "decode_batch", Scripted(tokenizer, ["and why is that so, exactly?"])
    )
    settings = overrides(
        tmp_path, "extract.self_prompt.follow_up_turns=1", "extract.regenerate.samples_per_prompt=2"
    )
    summary = run_extraction(compose(*settings))
    assert summary.sequences == 2 * (1 + 3)
    sampled = {i: v[-1] for i, v in self_prompted_records(tmp_path / "data").items() if "#s" in i}
    assert sorted(sampled) == ["sp-0#s1", "sp-1#s1", "sp-2#s1"]
    assert all([t.role for t in turns] == ["user", "assistant"] * 2 for turns in sampled.values())


def test_a_larger_share_follows_up_the_conversations_a_smaller_one_chose() -> None:
    ids = [f"sp-{n}" for n in range(400)]
    few = {i for i in ids if follow_ups_module._chosen(0, i, 0.25)}
    more = {i for i in ids if follow_ups_module._chosen(0, i, 0.5)}
    assert few < more and 60 < len(few) < 140 and 150 < len(more) < 250
    assert all(follow_ups_module._chosen(0, i, 1.0) for i in ids)
    assert not any(follow_ups_module._chosen(0, i, 0.0) for i in ids)


@pytest.mark.parametrize(
    ("setting", "key"),
    [("follow_up_turns=-1", "extract.self_prompt.follow_up_turns"),
     ("follow_up_fraction=1.5", "extract.self_prompt.follow_up_fraction")],
)  # fmt: skip
def test_a_bad_follow_up_setting_names_its_key(compose, tmp_path: Path, setting: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        compose(*overrides(tmp_path, f"extract.self_prompt.{setting}"))


def test_a_follow_up_with_a_unicode_line_separator_is_read_back_whole(tmp_path: Path) -> None:
    """The target may write U+2028 or U+0085 in a follow-up; a resumed run reads the file back record by record."""
    path = tmp_path / "follow_ups.jsonl"
    records = [
        {"id": "a", "turn": 1, "history": "h1", "text": "one\u2028two\x85three", "finished": True},
        {"id": "b", "turn": 1, "history": "h2", "text": "plain", "finished": False},
    ]
    with open(path, "ab") as sink:
        append_jsonl(sink, records)
    assert follow_ups_module._read(path) == {(r["id"], r["turn"], r["history"]): r for r in records}
