"""Regeneration: every assistant turn answered by the target, turn by turn, resumable."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from eaglet.config.schema import RegenerateConfig
from eaglet.data.conversations import Conversation, Turn
from eaglet.data.regenerate import regenerate_conversations
from eaglet.errors import DataError
from eaglet.target_model import load_target


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
    assert stats.rows == SETTINGS.batch_size, "the rows decoded at once are reported"
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
    original = target.model.forward
    monkeypatch.setattr(target.model, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
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


def test_a_conversation_that_gained_a_turn_goes_on_from_its_recorded_answers(target, tmp_path: Path) -> None:
    """Only the new turn is answered; the earlier answer stays as recorded, as answering every turn gives."""
    path = tmp_path / "r.jsonl"
    sampled = replace(SETTINGS, temperature=1.0)  # sampled: a wrong seed or history would change the answers
    first, _ = regenerate_conversations(
        target.model, target.tokenizer, CONVERSATIONS[1:2], cfg=sampled, out_path=path, max_length=512
    )
    longer = [conv("prompt-only", ("user", "Count to three"), ("user", "And to four?"))]
    out, stats = regenerate_conversations(
        target.model, target.tokenizer, longer, cfg=sampled, out_path=path, max_length=512
    )
    assert stats.generated_turns == 1 and stats.reused_turns == 1 and stats.resumed == 0
    assert out[0].turns[:2] == first[0].turns and [t.role for t in out[0].turns[2:]] == ["user", "assistant"]
    whole, _ = regenerate_conversations(
        target.model, target.tokenizer, longer, cfg=sampled, out_path=tmp_path / "whole.jsonl", max_length=512
    )
    assert whole[0].turns == out[0].turns


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


@pytest.mark.parametrize("attention", ["sdpa", "eager", "2d masks"])
def test_batched_decoding_equals_unbatched_greedy_generate(target, attention: str, monkeypatch) -> None:
    """Left padding, early-finishing rows leaving the batch: same tokens as one-at-a-time `generate`.

    Decode steps pass a ready 4D mask for sdpa and eager attention; "2d masks" is the path of models with
    sliding-window layers, where transformers builds the masks."""
    import torch

    from eaglet.generation import continuous, decode_batch

    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42]]
    stop = 3  # a frequent token of this random model stops some rows early
    if attention == "2d masks":
        monkeypatch.setattr(continuous, "_attention_for_4d_masks", lambda config: None)
        attention = "sdpa"
    target.model.set_attn_implementation(attention)
    try:
        got = decode_batch(target.model, prompts, max_new_tokens=12, stop_ids={stop}, pad_id=0)
    finally:
        target.model.set_attn_implementation("sdpa")
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


# ---------------------------------------------------------------- continuous batching over turns


class _StopAt:
    """The tokenizer, but its end-of-turn id is a token the random model emits often: answers stop at varied
    lengths, so rows finish at different steps and next turns join a running batch."""

    def __init__(self, tokenizer, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.pad_token_id = tokenizer.pad_token_id

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


TALKS = [
    conv(f"talk{i}", *[("user", f"{word} number {i}, turn {t}") for t in range(turns)])
    for i, (word, turns) in enumerate(
        [
            ("Hi", 1),
            ("Write a poem", 4),
            ("A", 2),
            ("Count", 3),
            ("What is the capital of France?", 1),
            ("B", 2),
        ]
    )
]
STOP = 3932  # " hous": the random model says it after a prompt-dependent number of tokens, or never
CONTINUOUS = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size=3, refill_every=4)


def _turn_by_turn_greedy(model, tokenizer, conversation: Conversation, max_new_tokens: int) -> list[Turn]:
    """The reference: one conversation at a time, one turn at a time, with `generate`."""
    import torch

    from eaglet.data.regenerated import user_turn_groups
    from eaglet.data.templating import build_prompt_ids

    history: list[Turn] = []
    for group in user_turn_groups(conversation):
        history = history + group
        ids = build_prompt_ids(tokenizer, history)
        full = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
        )
        new = full[0, len(ids) :].tolist()
        new = new[: new.index(STOP)] if STOP in new else new
        history.append(Turn("assistant", tokenizer.decode(new, skip_special_tokens=True).strip()))
    return history


def test_continuous_batching_equals_turn_by_turn_greedy(target, tmp_path: Path) -> None:
    tokenizer = _StopAt(target.tokenizer, STOP)
    out, stats = regenerate_conversations(
        target.model, tokenizer, TALKS, cfg=CONTINUOUS, out_path=tmp_path / "r.jsonl", max_length=512
    )
    want = [_turn_by_turn_greedy(target.model, tokenizer, c, CONTINUOUS.max_new_tokens) for c in TALKS]
    assert [list(c.turns) for c in out] == want
    assert stats.generated_turns == 13
    # The answers stop at different lengths (else rows would never finish apart).
    lengths = {
        len(target.tokenizer(t.content)["input_ids"])
        for turns in want
        for t in turns
        if t.role == "assistant"
    }
    assert len(lengths) > 2


@pytest.mark.parametrize(
    "overlap, graphs, packed",
    [(False, False, None), (True, False, None), (False, True, None), (False, True, True)],
)
def test_the_engine_answers_as_turn_by_turn_greedy_however_it_prefills(
    target, tmp_path: Path, overlap: bool, graphs: bool, packed: bool | None
) -> None:
    tokenizer = _StopAt(target.tokenizer, STOP)
    cfg = replace(
        CONTINUOUS, engine="engine", overlap_prefill=overlap, prefill_graphs=graphs, packed_prefill=packed
    )
    out, _ = regenerate_conversations(
        target.model, tokenizer, TALKS, cfg=cfg, out_path=tmp_path / "r.jsonl", max_length=512
    )
    want = [_turn_by_turn_greedy(target.model, tokenizer, c, CONTINUOUS.max_new_tokens) for c in TALKS]
    assert [list(c.turns) for c in out] == want


def test_when_the_engine_prefills_is_not_part_of_the_folders_identity(compose) -> None:
    from eaglet.extract.core import regenerate_settings
    from eaglet.extract.job import ExtractionJob

    def settings(*overrides: str) -> dict:
        cfg = compose("extract.regenerate.enabled=true", *overrides)
        job = ExtractionJob(cfg.model, cfg.dataset, cfg.extract, Path("d"), Path("c"), {}, seed=cfg.seed)
        return regenerate_settings(job)

    assert settings("extract.regenerate.overlap_prefill=true") == settings()
    assert settings("extract.regenerate.prefill_graphs=true") == settings()
    assert settings("extract.regenerate.packed_prefill=false") == settings()
    assert settings("extract.regenerate.max_new_tokens=7") != settings()


def test_a_killed_run_resumes_to_the_same_answers(target, tmp_path: Path, monkeypatch) -> None:
    tokenizer = _StopAt(target.tokenizer, STOP)
    reference, _ = regenerate_conversations(
        target.model, tokenizer, TALKS, cfg=CONTINUOUS, out_path=tmp_path / "whole.jsonl", max_length=512
    )
    path = tmp_path / "r.jsonl"
    original = target.model.forward
    calls: list[int] = []

    def dying_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) > 20:
            raise KeyboardInterrupt  # as a kill would, mid-batch
        return original(*args, **kwargs)

    monkeypatch.setattr(target.model, "forward", dying_forward)
    with pytest.raises(KeyboardInterrupt):
        regenerate_conversations(
            target.model, tokenizer, TALKS, cfg=CONTINUOUS, out_path=path, max_length=512
        )
    written = len(path.read_text().splitlines())
    assert 0 < written < len(TALKS)
    monkeypatch.setattr(target.model, "forward", original)
    again, stats = regenerate_conversations(
        target.model, tokenizer, TALKS, cfg=CONTINUOUS, out_path=path, max_length=512
    )
    assert stats.resumed == written
    assert [c.turns for c in again] == [c.turns for c in reference]
    assert len(path.read_text().splitlines()) == len(TALKS)


def test_sampled_answers_do_not_depend_on_batching_or_resume(target, tmp_path: Path) -> None:
    def run(path: Path, conversations, seed: int = 0, **overrides) -> list[tuple[Turn, ...]]:
        cfg = RegenerateConfig(enabled=True, max_new_tokens=8, temperature=1.0, top_p=0.9, **overrides)
        out, _ = regenerate_conversations(
            target.model, target.tokenizer, conversations, cfg=cfg, out_path=path, max_length=512, seed=seed
        )
        return [c.turns for c in out]

    batched = run(tmp_path / "a.jsonl", TALKS, batch_size=4, refill_every=3)
    assert run(tmp_path / "b.jsonl", TALKS, batch_size=1) == batched
    # A run that stopped after some conversations, then resumed over all of them.
    run(tmp_path / "c.jsonl", TALKS[1:3], batch_size=2)
    assert run(tmp_path / "c.jsonl", TALKS, batch_size=2) == batched
    assert run(tmp_path / "d.jsonl", TALKS, batch_size=4, seed=1) != batched


def test_sampling_follows_the_nucleus_distribution() -> None:
    import torch

    from eaglet.generation.sampling import pick_next

    rows = 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0]).repeat(rows, 1)
    seeds = torch.arange(rows)
    steps = torch.zeros(rows, dtype=torch.long)
    probs = logits[0].softmax(-1)
    got = torch.bincount(pick_next(logits, temperature=1.0, top_p=1.0, seeds=seeds, steps=steps), minlength=5)
    assert torch.allclose(got / rows, probs, atol=0.01)
    # top_p = 0.8 keeps the two most likely tokens (0.61 < 0.8 <= 0.61 + 0.22), renormalised.
    got = torch.bincount(pick_next(logits, temperature=1.0, top_p=0.8, seeds=seeds, steps=steps), minlength=5)
    assert got[2:].sum() == 0
    assert torch.allclose(got[:2] / rows, probs[:2] / probs[:2].sum(), atol=0.01)
    # The next token index draws independently: two draws differ with probability 1 - sum(p^2).
    first = pick_next(logits, temperature=1.0, top_p=1.0, seeds=seeds, steps=steps)
    again = pick_next(logits, temperature=1.0, top_p=1.0, seeds=seeds, steps=steps + 1)
    assert abs((again != first).float().mean() - (1 - (probs**2).sum())) < 0.02


def test_the_noise_is_finite_for_every_hash_value() -> None:
    import torch

    from eaglet.generation.sampling import uniform_from_bits

    bits = torch.tensor([0, 1, 2**31, 2**32 - 2**9, 2**32 - 1], dtype=torch.long)
    uniform = uniform_from_bits(bits)
    assert (uniform > 0).all() and (uniform < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(uniform))).all()


def test_no_noise_brings_a_token_outside_the_nucleus_back(monkeypatch) -> None:
    import torch

    from eaglet.generation import sampling

    logits = torch.tensor([[4.0, 3.0, -20.0, -20.0]]).log_softmax(-1)
    noise = torch.tensor([[0.0, 0.0, float("inf"), 0.0]])  # the largest noise on a token of mass ~1e-10
    monkeypatch.setattr(sampling, "gumbel_noise", lambda seeds, steps, vocab: noise)
    one = torch.zeros(1, dtype=torch.long)
    assert sampling.pick_next(logits, temperature=1.0, top_p=0.9, seeds=one, steps=one).item() in (0, 1)


def test_bad_scheduler_settings_are_reported(target, tmp_path: Path) -> None:
    from eaglet.errors import ConfigError

    with pytest.raises(ConfigError, match="refill_every"):
        regenerate_conversations(
            target.model,
            target.tokenizer,
            CONVERSATIONS,
            cfg=RegenerateConfig(enabled=True, refill_every=0),
            out_path=tmp_path / "r.jsonl",
            max_length=512,
        )


def test_prefill_batches_hold_prompts_of_similar_length() -> None:
    from eaglet.generation.work import Request
    from eaglet.generation.work import prefill_chunks as _chunks

    requests = [Request([0] * n) for n in (100, 90, 80, 70, 20, 19, 18, 5)]
    lengths = lambda chunks: [[len(r.prompt) for r in chunk] for chunk in chunks]  # noqa: E731
    # Under 3/4 of the batch's longest prompt starts a new batch; the padded-token budget caps each one.
    assert lengths(_chunks(requests, budget=1000, min_tokens=0)) == [[100, 90, 80], [70], [20, 19, 18], [5]]
    assert lengths(_chunks(requests, budget=250, min_tokens=0)) == [[100, 90], [80, 70], [20, 19, 18], [5]]
    # A batch under min_tokens padded tokens takes any prompt (a GPU forward costs its launches).
    assert lengths(_chunks(requests, budget=1000, min_tokens=300)) == [[100, 90, 80], [70, 20, 19, 18, 5]]


def test_a_prompt_with_no_room_keeps_its_turns_unanswered_and_the_file_stays_a_dataset(target, tmp_path):
    from eaglet.data.conversations import read_jsonl_conversations

    long_prompt = conv("long", ("user", "word " * 300), ("assistant", "old"))
    out, stats = regenerate_conversations(
        target.model,
        target.tokenizer,
        [CONVERSATIONS[1], long_prompt],
        cfg=SETTINGS,
        out_path=tmp_path / "r.jsonl",
        max_length=128,
    )
    assert stats.cut_for_length == 1
    assert [t.role for t in out[1].turns] == ["user"]  # the prompt, unanswered
    # The output reads back as a dataset: the unanswered conversation is one without an assistant turn.
    rows = {c.id: c for c in read_jsonl_conversations(tmp_path / "r.jsonl")}  # in the order they finished
    assert set(rows) == {"prompt-only", "long"}
    assert [t.role for t in rows["long"].turns] == ["user"]


def test_answers_imported_from_another_machine_are_reused_and_the_rest_generated(
    target, tmp_path: Path, monkeypatch
) -> None:
    elsewhere = tmp_path / "gpu.jsonl"
    first, _ = regenerate_conversations(
        target.model, target.tokenizer, CONVERSATIONS, cfg=SETTINGS, out_path=elsewhere, max_length=512
    )
    # The file as brought back: gzipped, with the last conversation's prompt edited since (so not reused).
    records = [json.loads(line) for line in elsewhere.read_text().splitlines()]
    packed = tmp_path / "gpu.jsonl.gz"
    packed.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    edited = [*CONVERSATIONS[:2], conv("ends-with-user", ("user", "A changed"), ("user", "B"))]
    generated = []
    original = target.model.forward
    monkeypatch.setattr(target.model, "forward", lambda *a, **k: generated.append(1) or original(*a, **k))
    here = tmp_path / "here.jsonl"
    settings = replace(SETTINGS, import_from=str(packed))
    out, stats = regenerate_conversations(
        target.model, target.tokenizer, edited, cfg=settings, out_path=here, max_length=512
    )
    assert stats.resumed == 2 and generated  # the edited one was generated here
    assert [c.turns for c in out[:2]] == [c.turns for c in first[:2]]
    assert out[2].turns[0].content == "A changed"
    # Importing again copies nothing twice.
    regenerate_conversations(
        target.model, target.tokenizer, edited, cfg=settings, out_path=here, max_length=512
    )
    assert len(here.read_text().splitlines()) == 3


def test_an_unreadable_import_is_reported(target, tmp_path: Path) -> None:
    missing = replace(SETTINGS, import_from=str(tmp_path / "nowhere.jsonl.gz"))
    with pytest.raises(DataError, match=r"import_from=.*nowhere.jsonl.gz.* is not a file"):
        regenerate_conversations(
            target.model,
            target.tokenizer,
            CONVERSATIONS,
            cfg=missing,
            out_path=tmp_path / "r.jsonl",
            max_length=512,
        )
    torn = tmp_path / "torn.jsonl.gz"
    torn.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(DataError, match=r"torn.jsonl.gz: cannot read"):
        regenerate_conversations(
            target.model,
            target.tokenizer,
            CONVERSATIONS,
            cfg=replace(SETTINGS, import_from=str(torn)),
            out_path=tmp_path / "r.jsonl",
            max_length=512,
        )
