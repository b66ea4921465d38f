"""Regeneration: every assistant turn answered by the target, turn by turn, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.regenerate import regenerate_conversations
from eaglet.errors import DataError
from eaglet.target import load_target


@pytest.fixture(scope="module")
def target(model_cache: Path):
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    import eaglet.config

    with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=["model=tiny_llama"])
    GlobalHydra.instance().clear()
    return load_target(cfg.model, device="cpu", cache_dir=model_cache)


def conv(cid: str, *turns: tuple[str, str]) -> Conversation:
    return Conversation(id=cid, turns=tuple(Turn(r, c) for r, c in turns), source="mem", line=1)


CONVERSATIONS = [
    conv(
        "multi",
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "old"),
        ("user", "And?"),
        ("assistant", "old2"),
    ),
    conv("prompt-only", ("user", "Count to three")),
    conv("ends-with-user", ("user", "A"), ("assistant", "old"), ("user", "B")),
]
SETTINGS = RegenerateConfig(enabled=True, max_new_tokens=5, batch_size=2)


def test_every_user_turn_gets_the_targets_answer(target, tmp_path: Path) -> None:
    out, stats = regenerate_conversations(
        target.model,
        target.tokenizer,
        CONVERSATIONS,
        cfg=SETTINGS,
        out_path=tmp_path / "r.jsonl",
        max_length=512,
    )
    assert [c.id for c in out] == ["multi", "prompt-only", "ends-with-user"]
    roles = [[t.role for t in c.turns] for c in out]
    assert roles == [
        ["system", "user", "assistant", "user", "assistant"],
        ["user", "assistant"],
        ["user", "assistant", "user", "assistant"],
    ]
    assert all(t.content not in ("old", "old2") for c in out for t in c.turns if t.role == "assistant")
    assert [t.content for t in out[0].turns if t.role != "assistant"] == ["Be brief.", "Hi", "And?"]
    assert stats.generated_turns == 5 and 0 < stats.generated_tokens <= 25
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == ["ends-with-user", "multi", "prompt-only"]


def test_greedy_answers_are_deterministic_and_resume_skips_finished(
    target, tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "r.jsonl"
    first, _ = regenerate_conversations(
        target.model, target.tokenizer, CONVERSATIONS, cfg=SETTINGS, out_path=path, max_length=512
    )
    # A killed run leaves a torn last line: it is cut off, the finished records are reused.
    path.write_bytes(path.read_bytes() + b'{"id": "tor')
    calls = []
    original = target.model.generate
    monkeypatch.setattr(target.model, "generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    again, stats = regenerate_conversations(
        target.model, target.tokenizer, CONVERSATIONS, cfg=SETTINGS, out_path=path, max_length=512
    )
    assert stats.resumed == 3 and not calls
    assert [c.turns for c in again] == [c.turns for c in first]
    assert path.read_bytes().endswith(b"\n")


def test_an_edited_prompt_is_generated_again(target, tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    regenerate_conversations(
        target.model, target.tokenizer, CONVERSATIONS, cfg=SETTINGS, out_path=path, max_length=512
    )
    edited = [*CONVERSATIONS[:2], conv("ends-with-user", ("user", "A changed"), ("user", "B"))]
    out, stats = regenerate_conversations(
        target.model, target.tokenizer, edited, cfg=SETTINGS, out_path=path, max_length=512
    )
    assert stats.resumed == 2
    assert out[2].turns[0].content == "A changed"


def test_prompts_longer_than_the_budget_are_cut(target, tmp_path: Path) -> None:
    long = conv("long", ("user", "word " * 50), ("assistant", "x"), ("user", "more " * 200))
    out, stats = regenerate_conversations(
        target.model, target.tokenizer, [long], cfg=SETTINGS, out_path=tmp_path / "r.jsonl", max_length=120
    )
    assert stats.cut_for_length == 1
    assert [t.role for t in out[0].turns] == ["user", "assistant"]


def test_a_damaged_file_is_reported(target, tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "multi"}\n')
    with pytest.raises(DataError, match=r"r.jsonl:1"):
        regenerate_conversations(
            target.model, target.tokenizer, CONVERSATIONS, cfg=SETTINGS, out_path=path, max_length=512
        )


def test_batched_decoding_equals_unbatched_greedy_generate(target) -> None:
    """Left padding, early-finishing rows leaving the batch: same tokens as one-at-a-time `generate`."""
    import torch

    from eaglet.generation import decode_batch

    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42]]
    stop = 3  # a frequent token of this random model stops some rows early
    got = decode_batch(target.model, prompts, max_new_tokens=12, stop_ids={stop}, pad_id=0)
    for prompt, ids in zip(prompts, got, strict=True):
        full = target.model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
        want = full[0, len(prompt) :].tolist()
        assert ids == (want[: want.index(stop)] if stop in want else want)


def test_sampling_is_seeded(target) -> None:
    import torch

    from eaglet.generation import decode_batch

    def sample(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return decode_batch(
            target.model,
            [[1, 2], [3]],
            max_new_tokens=8,
            stop_ids=set(),
            pad_id=0,
            temperature=1.0,
            generator=gen,
        )

    assert sample(0) == sample(0) != sample(1)
