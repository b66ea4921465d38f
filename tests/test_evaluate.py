"""Speculative-decoding evaluation: losslessness, acceptance bookkeeping, n-gram lookup, the draft loader, and
train/serve consistency of the incremental draft inference."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import eaglet.evaluate.acceptance as acceptance
from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError, DataError
from eaglet.evaluate import (
    DecodeStats,
    Eagle3Drafter,
    Eagle3Proposer,
    LosslessError,
    NgramProposer,
    TargetState,
    evaluate_prompts,
    format_table,
    greedy_decode,
    speculative_decode,
)
from eaglet.evaluate.metrics import format_positions
from eaglet.evaluate.positions import chain_logits, in_draft_vocab, position_counts, position_summary
from eaglet.evaluate.record import eval_summary
from eaglet.formats.reader import load_eagle_draft
from eaglet.formats.writer import export_eagle
from eaglet.generation import decode_batch
from eaglet.model.draft_head import Eagle3DraftHead
from eaglet.plan.configs import load_draft
from eaglet.target_model import capture_hidden_states, load_target, resolve_aux_layer_ids
from eaglet.train.ttt import ttt_forward

NEW_TOKENS = 24
VOCAB = 49152  # conf/model/tiny_llama.yaml


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to split: a second thread only adds spin-waits, badly so on a
    shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(model_cache: Path):
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    import eaglet.config

    with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=["model=tiny_llama"])
    GlobalHydra.instance().clear()
    return cfg.model, load_target(cfg.model, device="cpu", cache_dir=model_cache)


@pytest.fixture(scope="module")
def target(tiny):
    return tiny[1]


def _vocab_map(vocab: int, draft_vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    used = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab), t2d


def _randomise_norms(head: Eagle3DraftHead, seed: int) -> None:
    """Norm weights away from 1, so a swapped or skipped norm changes the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in (
            head.midlayer.input_layernorm,
            head.midlayer.hidden_norm,
            head.midlayer.post_attention_layernorm,
        ):
            norm.weight.copy_(1.0 + 0.3 * torch.randn(norm.weight.shape, generator=gen))
        head.norm.weight.copy_(1.0 + 0.3 * torch.randn(head.norm.weight.shape, generator=gen))


@pytest.fixture(scope="module")
def eagle_head(tiny) -> tuple[Eagle3DraftHead, list[int]]:
    """A random-weight head on the tiny target's embeddings and lm_head rows."""
    cfg, loaded = tiny
    draft = load_draft(cfg.name)
    torch.manual_seed(0)
    head = Eagle3DraftHead(
        draft,
        target_hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=draft.vocab_size,
    )
    d2t, t2d = _vocab_map(cfg.vocab_size, draft.vocab_size, seed=1)
    head.init_from_target(
        loaded.parts.embed_tokens.weight, loaded.parts.lm_head.weight, d2t, t2d, lm_head_trainable=False
    )
    _randomise_norms(head, seed=2)
    return head.eval(), resolve_aux_layer_ids(cfg)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 20)]
    # Repeats give the n-gram proposer matches inside the prompt too.
    return [*prompts, prompts[1] * 3]


# ---------------------------------------------------------------- greedy reference and losslessness


def test_greedy_decode_equals_the_batched_decoder(target) -> None:
    prompt = _prompts()[2]
    output, seconds = greedy_decode(target, prompt, NEW_TOKENS)
    assert len(output) == NEW_TOKENS and seconds > 0
    (batched,) = decode_batch(target.model, [prompt], max_new_tokens=NEW_TOKENS, stop_ids=set(), pad_id=0)
    assert output == batched
    # A stop id ends the output before it, as in decode_batch.
    stop = output[7]
    stopped, _ = greedy_decode(target, prompt, NEW_TOKENS, {stop})
    assert stopped == output[: output.index(stop)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_output_equals_greedy(target, eagle_head, k: int) -> None:
    prompts = _prompts()
    reference, _ = greedy_decode(target, prompts[2], NEW_TOKENS)
    # A stop id met mid-sequence: the last accepted block must be cut where greedy stops.
    stop_ids = {reference[11]}
    head, aux_ids = eagle_head
    proposers = {"ngram": NgramProposer(min_n=1, max_n=3), "eagle3": Eagle3Proposer(head, aux_ids)}
    results = evaluate_prompts(
        target, proposers, prompts, num_spec_tokens=k, max_new_tokens=NEW_TOKENS, stop_ids=stop_ids
    )
    greedy_tokens = sum(len(greedy_decode(target, p, NEW_TOKENS, stop_ids)[0]) for p in prompts)
    for name, r in results.items():
        assert r["new_tokens"] == greedy_tokens, name
        assert len(r["acceptance_rates"]) == k and r["near_ties"] == 0
    # The n-gram proposer is right often enough here to exercise accepted blocks, with several tokens at once.
    assert results["ngram"]["accepted"] > 0 and results["ngram"]["tokens_per_forward"] > 1.0
    assert results["eagle3"]["steps"] > 0
    for name, r in results.items():  # per-prompt counts add up to the totals; the interval holds the set's τ
        assert len(r["per_prompt"]["accepted"]) == len(set(r["per_prompt"]["prompts"])) == len(prompts)
        assert (
            sum(r["per_prompt"]["accepted"]) == r["accepted"] and sum(r["per_prompt"]["steps"]) == r["steps"]
        )
        assert r["tau_ci95"][0] <= r["tau"] <= r["tau_ci95"][1], name
    low, high = results["eagle3"]["ratio_ci95"]["ngram"]
    assert low <= results["eagle3"]["tau"] / results["ngram"]["tau"] <= high
    table = format_table(results)
    assert "| ngram |" in table and "| eagle3 |" in table and f"acc@{k}" in table
    assert "tau 95% CI" in table and "x ngram (95% CI)" in table
    eagle_row = next(line for line in table.splitlines() if line.startswith("| eagle3 |"))
    assert f"| {results['eagle3']['tau'] / results['ngram']['tau']:.2f} ({low:.2f}-{high:.2f}) |" in eagle_row


def test_progress_is_shown_prompt_by_prompt(target, capsys) -> None:
    """Issue 22: nothing was shown until a whole prompt set had been decoded."""
    evaluate_prompts(
        target, {"ngram": NgramProposer()}, _prompts()[:2], num_spec_tokens=2, max_new_tokens=4, desc="code"
    )
    assert re.search(r"code: .*2/2 .*prompt", capsys.readouterr().err)


def test_acceptance_plot_numbers_the_draft_positions(tmp_path: Path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    from eaglet.evaluate.stage import plot_acceptance

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    rates = {
        "eaglet": {"tau": 1.6, "acceptance_rates": [0.5, 0.3, 0.1]},
        "ngram": {"tau": 1.2, "acceptance_rates": [0.2, 0.1, 0.0]},
    }
    plot_acceptance({"sets": {"code": {"prompts": 2, "results": rates}}}, tmp_path / "acceptance.png")
    assert list(figures[0].axes[0].get_xticks()) == [1, 2, 3]  # not 1.0, 1.25, 1.5, ...


def test_a_verifier_that_accepts_one_token_too_many_is_caught(target, eagle_head, monkeypatch) -> None:
    real = acceptance.accepted_length
    monkeypatch.setattr(
        acceptance,
        "accepted_length",
        lambda proposals, argmax: min(len(proposals), real(proposals, argmax) + 1),
    )
    head, aux_ids = eagle_head
    with pytest.raises(LosslessError, match=r"'eagle3', prompt 0: .* new token 1 "):
        evaluate_prompts(
            target,
            {"eagle3": Eagle3Proposer(head, aux_ids)},
            _prompts(),
            num_spec_tokens=3,
            max_new_tokens=NEW_TOKENS,
        )
    # The same differences, tolerated as near-ties (for bf16 targets): counted, one per prompt.
    results = evaluate_prompts(
        target,
        {"eagle3": Eagle3Proposer(head, aux_ids)},
        _prompts(),
        num_spec_tokens=3,
        max_new_tokens=NEW_TOKENS,
        tie_tolerance=float("inf"),
    )
    assert results["eagle3"]["near_ties"] == len(_prompts())


def test_invalid_requests_raise(target) -> None:
    with pytest.raises(ConfigError, match="num_spec_tokens"):
        speculative_decode(target, NgramProposer(), [1, 2], num_spec_tokens=0, max_new_tokens=4)
    with pytest.raises(ConfigError, match="prompt is empty"):
        speculative_decode(target, NgramProposer(), [], num_spec_tokens=2, max_new_tokens=4)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        greedy_decode(target, [1, 2], 0)


# ---------------------------------------------------------------- acceptance bookkeeping


class ScriptedProposer:
    """Proposes the greedy continuation, except a wrong token at draft position `wrong_at` (None: never)."""

    aux_layer_ids = None

    def __init__(self, prompt: list[int], continuation: list[int], wrong_at: int | None) -> None:
        self.prompt, self.continuation, self.wrong_at = prompt, continuation, wrong_at

    def reset(self, tokens: list[int], state: TargetState) -> None:
        self.done = len(tokens) - len(self.prompt)

    def accept(self, tokens: list[int], state: TargetState) -> None:
        self.done += len(tokens)

    def propose(self, k: int) -> list[int]:
        guess = self.continuation[self.done : self.done + k]
        if self.wrong_at is not None and self.wrong_at < len(guess):
            guess[self.wrong_at] = (guess[self.wrong_at] + 1) % VOCAB
        return guess


@pytest.mark.parametrize(
    ("wrong_at", "tau", "rates"),
    [(None, 4.0, [1.0, 1.0, 1.0]), (0, 1.0, [0.0, 0.0, 0.0]), (1, 2.0, [1.0, 0.0, 0.0])],
)
def test_tau_and_per_position_rates(target, wrong_at, tau: float, rates: list[float]) -> None:
    k, steps = 3, 5
    prompt = _prompts()[1]
    # Every step adds (accepted + 1) tokens, the prefill one more: a budget that ends on a full step.
    per_step = {None: k + 1, 0: 1, 1: 2}[wrong_at]
    budget = 1 + steps * per_step
    continuation, _ = greedy_decode(target, prompt, budget + k)
    output, stats = speculative_decode(
        target,
        ScriptedProposer(prompt, continuation, wrong_at),
        prompt,
        num_spec_tokens=k,
        max_new_tokens=budget,
    )
    assert output == continuation[:budget]
    assert stats.new_tokens == budget
    assert [stats.acceptance_rate(i) for i in range(k)] == rates
    if wrong_at is None:
        # Full steps only: no proposal was cut by the budget.
        assert stats.steps == steps and stats.tau == tau and stats.target_forwards == steps + 1
        assert stats.per_position_proposed == [steps] * k and stats.per_position_accepted == [steps] * k
    elif wrong_at == 0:
        # One token per forward; the budget trims proposals near the end (k <= tokens left - 1).
        assert stats.tau == tau and stats.accepted == 0 and stats.target_forwards == budget
        assert stats.per_position_proposed == [budget - 2 - i for i in range(k)]
    else:
        assert stats.tau == tau and stats.steps == steps and stats.accepted == steps
        assert stats.per_position_accepted == [steps, 0, 0]


def test_decode_stats_add_up() -> None:
    a = DecodeStats(2, 3, 6, [2, 1, 0], [2, 2, 2], 8, 3, 1.0)
    b = DecodeStats(1, 1, 1, [1], [1], 3, 2, 0.5)
    total = a + b
    assert (total.steps, total.accepted, total.proposed, total.new_tokens, total.target_forwards) == (
        3,
        4,
        7,
        11,
        5,
    )
    assert total.per_position_accepted == [3, 1, 0] and total.per_position_proposed == [3, 2, 2]
    assert total.tau == pytest.approx(1 + 4 / 3) and total.acceptance_rate(1) == 0.5
    assert DecodeStats().tau == 1.0 and DecodeStats().acceptance_rate(4) == 0.0


# ---------------------------------------------------------------- n-gram lookup


def _ngram(tokens: list[int], k: int, **sizes: int) -> list[int]:
    proposer = NgramProposer(**sizes)
    proposer.reset(tokens, TargetState())
    return proposer.propose(k)


def test_ngram_longest_suffix_wins() -> None:
    tokens = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert _ngram(tokens, 3, min_n=1, max_n=3) == [9, 5, 3]  # suffix [1, 2, 3], not the later [3]
    assert _ngram(tokens, 3, min_n=1, max_n=1) == [7, 1, 2]  # only [3]: its most recent earlier match


def test_ngram_most_recent_match_fewer_than_k_and_no_match() -> None:
    assert _ngram([4, 5, 6, 4, 5, 7, 4, 5], 3, max_n=2) == [7, 4, 5]
    assert _ngram([1, 2, 1], 5) == [2, 1]
    assert _ngram([1, 2, 3], 3) == []
    assert _ngram([1], 3) == []
    assert _ngram([1, 2, 3, 1], 3, min_n=2) == []
    assert _ngram([1, 2, 3, 1], 3, min_n=1) == [2, 3, 1]


def test_ngram_follows_accepted_tokens_and_checks_sizes() -> None:
    proposer = NgramProposer()
    proposer.reset([1, 2], TargetState())
    assert proposer.propose(2) == []
    proposer.accept([1], TargetState())
    assert proposer.propose(2) == [2, 1]
    for sizes in ({"min_n": 0}, {"min_n": 3, "max_n": 2}):
        with pytest.raises(ConfigError, match="min_n"):
            NgramProposer(**sizes)


# ---------------------------------------------------------------- train/serve consistency

H, HEADS, KV_HEADS, HEAD_DIM, V, VD, T, STEPS = 16, 4, 2, 8, 40, 24, 10, 3


def _small_head(norm_before_residual: bool) -> Eagle3DraftHead:
    cfg = DraftConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=24,
        rope_theta=50.0,
        norm_before_residual=norm_before_residual,
    )
    torch.manual_seed(3)
    head = Eagle3DraftHead(cfg, target_hidden_size=H, vocab_size=V, draft_vocab_size=VD).double()
    gen = torch.Generator().manual_seed(4)
    d2t, t2d = _vocab_map(V, VD, seed=5)
    head.init_from_target(
        torch.randn(V, H, generator=gen, dtype=torch.float64),
        torch.randn(V, H, generator=gen, dtype=torch.float64),
        d2t,
        t2d,
        lm_head_trainable=False,
    )
    _randomise_norms(head, seed=6)
    return head.eval()


def _document(seed: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, V, (T,), generator=gen),
        "loss_mask": torch.ones(T, dtype=torch.bool),
        "document_ids": torch.zeros(T, dtype=torch.int64),
        "position_ids": torch.arange(T),
        "aux_hidden_states": torch.randn(T, 3 * H, generator=gen, dtype=torch.float64),
        "last_hidden_state": torch.randn(T, H, generator=gen, dtype=torch.float64),
    }


def _training_logits(head: Eagle3DraftHead, doc: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The logits ttt_forward computes at each step: step k at positions t = 0..T-3-k (those with a teacher)."""
    recorded: list[torch.Tensor] = []
    logits = head.logits
    head.logits = lambda hidden: recorded.append(logits(hidden).detach()) or recorded[-1]
    try:
        ttt_forward(
            head,
            doc,
            target_norm_weight=torch.ones(H, dtype=torch.float64),
            target_norm_eps=1e-6,
            target_lm_head=torch.randn(V, H, dtype=torch.float64),
            ttt_steps=STEPS,
            step_loss_decay=1.0,
        )
    finally:
        del head.logits
    n = doc["input_ids"].shape[0]
    assert [r.shape[0] for r in recorded] == [n - 2 - k for k in range(STEPS)]
    return recorded


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_incremental_draft_inference_matches_training(norm_before_residual: bool) -> None:
    head = _small_head(norm_before_residual)
    doc = _document()
    training = _training_logits(head, doc)
    ids, aux = doc["input_ids"], doc["aux_hidden_states"].view(T, 3, H)

    # Step 0: context entries appended in uneven chunks (the causal mask inside a chunk matters).
    drafter = Eagle3Drafter(head)
    outputs = [drafter.append_context(ids[a + 1 : b + 1], aux[a:b]) for a, b in ((0, 3), (3, 4), (4, T - 1))]
    step0 = head.logits(torch.cat(outputs))
    torch.testing.assert_close(step0[: T - 2], training[0], rtol=1e-9, atol=1e-10)

    # Step k at t: context up to t, then chain entries fed the ground-truth tokens, as in training.
    for t in range(T - 2):
        drafter.reset()
        hidden = drafter.append_context(ids[1 : t + 2], aux[: t + 1])[-1:]
        for k in range(1, STEPS):
            if t > T - 3 - k:
                break
            hidden = drafter.chain_step(ids[t + 1 + k : t + 2 + k], hidden)
            torch.testing.assert_close(head.logits(hidden)[0], training[k][t], rtol=1e-9, atol=1e-10)


def test_position_accuracy_scores_what_training_predicts() -> None:
    """eval.position_accuracy: per answer position and step, the head's guess is the one TTT makes there (the
    chain sees no later position), and acc_k counts only positions whose earlier steps were right."""
    head, gen = _small_head(False), torch.Generator().manual_seed(11)
    n, answer_start = 18, 5
    aux = torch.randn(n, 3, H, generator=gen, dtype=torch.float64)
    # Answer tokens: mostly the head's own step-0 guess (so steps are often right), every third one random.
    tokens = torch.randint(0, V, (answer_start,), generator=gen).tolist()
    drafter = Eagle3Drafter(head)
    while len(tokens) < n:
        drafter.reset()
        hidden = drafter.append_context(torch.tensor(tokens[1:]), aux[: len(tokens) - 1])[-1:]
        guess = int(head.draft_target_ids[head.logits(hidden).argmax(-1)])
        tokens.append(guess if len(tokens) % 3 else int(torch.randint(0, V, (1,), generator=gen)))
    doc = {
        "input_ids": torch.tensor(tokens),
        "loss_mask": torch.ones(n, dtype=torch.bool),  # training's guesses at every position; scored below
        "document_ids": torch.zeros(n, dtype=torch.int64),
        "position_ids": torch.arange(n),
        "aux_hidden_states": aux.view(n, 3 * H),
        "last_hidden_state": torch.randn(n, H, generator=gen, dtype=torch.float64),
    }
    training = _training_logits(head, doc)
    for t in range(n - 2):  # the chain at t sees no later position: its logits are training's
        expected = torch.stack([training[k][t] for k in range(min(STEPS, n - 2 - t))])
        got = chain_logits(drafter, torch.tensor(tokens), aux[: n - 1], t, STEPS)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
    guesses = [head.draft_target_ids[logits.argmax(-1)].tolist() for logits in training]
    right, scored = [0] * STEPS, [0] * STEPS
    for t in range(answer_start - 2, n - 2):
        for k in range(min(STEPS, n - 2 - t)):
            scored[k] += 1
            if guesses[k][t] != tokens[t + 2 + k]:
                break
            right[k] += 1
    assert position_counts(drafter, tokens, aux[: n - 1], answer_start, STEPS) == (right, scored)
    assert scored[0] == n - answer_start and 0 < right[0] < scored[0] and right[1] > 0
    summary = position_summary(right, scored)
    acc = [r / s for r, s in zip(right, scored, strict=True)]
    assert summary["accuracy"] == acc and summary["positions"] == n - answer_start
    assert summary["tau_sim"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])


def test_in_draft_vocab_counts_the_predicted_answer_tokens_the_vocab_holds() -> None:
    drafter = SimpleNamespace(head=SimpleNamespace(draft_target_ids=torch.tensor([3, 5, 8])))
    # Answer from index 4: tokens 5 8 9 3 predicted, three of them in the vocab.
    assert in_draft_vocab(drafter, [1, 2, 3, 4, 5, 8, 9, 3], answer_start=4) == (4, 3)
    # After a one-token prompt the first answer token is not predicted (training's first prediction is token 2).
    assert in_draft_vocab(drafter, [7, 3, 5, 6], answer_start=1) == (2, 1)
    summary = position_summary([1], [2], in_vocab=(4, 3))
    assert summary["in_draft_vocab"] == 0.75
    assert position_summary([1], [2])["in_draft_vocab"] == 0.0


def test_evaluation_scores_positions_when_asked(target, eagle_head, capsys) -> None:
    head, aux_ids = eagle_head
    proposers = {"ngram": NgramProposer(), "eagle3": Eagle3Proposer(head, aux_ids)}
    prompts = _prompts()[1:3]
    results = evaluate_prompts(
        target, proposers, prompts, num_spec_tokens=3, max_new_tokens=6, position_accuracy=True
    )
    assert "positions" not in results["ngram"]
    answers = sum(len(greedy_decode(target, p, 6)[0]) for p in prompts)
    positions = results["eagle3"]["positions"]
    assert positions["positions"] == answers and len(positions["accuracy"]) == 3
    assert "eagle3, per answer position as in validation: acc_k" in format_positions(results)
    # The target's top-1 probability on its answers, against one full forward per answer token.
    probs = []
    for p in prompts:
        answer = greedy_decode(target, p, 6)[0]
        for i, token in enumerate(answer):
            with torch.no_grad():
                step = (
                    target.model(input_ids=torch.tensor([p + answer[:i]])).logits[0, -1].float().softmax(-1)
                )
            assert int(step.argmax()) == token
            probs.append(float(step[token]))
    assert positions["target_top1"] == pytest.approx(sum(probs) / len(probs), rel=1e-5)
    assert 0 < positions["target_top1"] < 1
    # The share of the answer tokens the head's draft vocab holds, against a plain set lookup.
    vocab = set(head.draft_target_ids.tolist())
    answer_tokens = [t for p in prompts for t in greedy_decode(target, p, 6)[0]]
    held = sum(t in vocab for t in answer_tokens)
    assert positions["in_draft_vocab"] == pytest.approx(held / len(answer_tokens))
    assert max(positions["accuracy"]) <= positions["in_draft_vocab"]
    summary = eval_summary(
        {"num_spec_tokens": 3, "sets": {"s": {"prompts": 2, "overlap_dropped": 0, "results": results}}}
    )
    assert summary["eval/s/eagle3/target_top1"] == positions["target_top1"]
    assert summary["eval/s/eagle3/in_draft_vocab"] == positions["in_draft_vocab"]
    assert summary["eval/s/eagle3/position_acc_0"] == positions["accuracy"][0]
    assert "eval/s/ngram/target_top1" not in summary
    plain = evaluate_prompts(target, proposers, prompts, num_spec_tokens=3, max_new_tokens=6)
    assert "positions" not in plain["eagle3"] and plain["eagle3"]["tau"] == results["eagle3"]["tau"]


def test_greedy_chain_feeds_back_its_own_target_ids() -> None:
    head = _small_head(False)
    doc = _document(seed=9)
    ids, aux = doc["input_ids"], doc["aux_hidden_states"].view(T, 3, H)
    drafter = Eagle3Drafter(head)
    drafter.append_context(ids[1:6], aux[:5])
    proposed = drafter.propose(3)
    # By hand: argmax over the draft vocab, mapped through d2t, fed back as the next input token.
    drafter.reset()
    hidden = drafter.append_context(ids[1:6], aux[:5])[-1:]
    expected = []
    for _ in range(3):
        token = head.draft_target_ids[head.logits(hidden).argmax(-1)]
        expected.append(int(token))
        hidden = drafter.chain_step(token, hidden)
    assert proposed == expected and all(head.t2d[expected])
    # Proposing again (after a rejected chain) gives the same chain: the speculative entries were dropped.
    drafter.reset()
    drafter.append_context(ids[1:6], aux[:5])
    assert drafter.propose(3) == proposed and drafter.propose(3) == proposed


def test_eagle_proposer_state_equals_a_fresh_recomputation(target, eagle_head) -> None:
    """During decoding with acceptance lengths 0..K, each Eagle3Proposer chain equals the chain drafted
    from scratch over the full sequence's aux states: the incremental context lines up token for token."""
    head, aux_ids = eagle_head
    k, prompt = 3, _prompts()[1]
    continuation, _ = greedy_decode(target, prompt, 40)
    inner = Eagle3Proposer(head, aux_ids)
    log: list[tuple[list[int], list[int]]] = []

    class Recording(ScriptedProposer):
        aux_layer_ids = aux_ids

        def reset(self, tokens, state):
            super().reset(tokens, state)
            self.tokens = list(tokens)
            inner.reset(tokens, state)

        def accept(self, tokens, state):
            super().accept(tokens, state)
            self.tokens += tokens
            inner.accept(tokens, state)

        def propose(self, n):
            log.append((list(self.tokens), inner.propose(n)))
            self.wrong_at = len(log) % (k + 1)  # accept 0, 1, 2, 3 tokens in turn
            return super().propose(n)

    output, stats = speculative_decode(
        target, Recording(prompt, continuation, None), prompt, num_spec_tokens=k, max_new_tokens=20
    )
    assert output == continuation[:20] and stats.accepted > 0
    fresh = Eagle3Drafter(head)
    for tokens, chain in log:
        ids = torch.tensor([tokens[:-1]])
        captured = capture_hidden_states(target.model, target.parts, ids, torch.ones_like(ids), aux_ids)
        fresh.reset()
        fresh.append_context(torch.tensor(tokens[1:]), captured.aux_hidden_states[0])
        assert fresh.propose(len(chain)) == chain


def test_eagle_proposer_checks_its_aux_ids(eagle_head) -> None:
    head, _ = eagle_head
    with pytest.raises(ConfigError, match="3 aux states but 2"):
        Eagle3Proposer(head, [1, 2])


# ---------------------------------------------------------------- draft loader


def _exported(tmp_path: Path, **kwargs) -> tuple[Eagle3DraftHead, DraftConfig, Path]:
    head = _small_head(False).float()
    cfg = DraftConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=24,
        rope_theta=50.0,
    )
    folder = export_eagle(
        head, cfg, tmp_path / "draft", aux_layer_ids=[1, 2, 3], dtype=torch.float32, **kwargs
    )
    return head, cfg, folder


def _assert_same_state(a: Eagle3DraftHead, b: Eagle3DraftHead) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_loader_round_trips_an_export(tmp_path: Path) -> None:
    head, cfg, folder = _exported(tmp_path)
    loaded, loaded_cfg, aux_ids = load_eagle_draft(folder)
    assert loaded_cfg == cfg and aux_ids == [1, 2, 3] and not loaded.training
    _assert_same_state(head, loaded)


def test_loader_takes_the_targets_embedding_when_none_is_shipped(tmp_path: Path) -> None:
    head, _, folder = _exported(tmp_path, include_embed=False)
    with pytest.raises(DataError, match="no embed_tokens.weight"):
        load_eagle_draft(folder)
    loaded, _, _ = load_eagle_draft(folder, embed_tokens=head.embed_tokens.weight)
    _assert_same_state(head, loaded)


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_loader_maps_other_exporters_names(tmp_path: Path) -> None:
    head, _, folder = _exported(tmp_path)

    def rename(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["t2d"]  # servers ignore it; rebuilt from d2t
        for name in list(tensors):
            tensors["model." + name.replace("midlayer.", "layers.0.")] = tensors.pop(name)

    _edit_weights(folder, rename)
    loaded, _, _ = load_eagle_draft(folder)
    _assert_same_state(head, loaded)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.update({"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
            "unknown tensors ['midlayer.self_attn.rotary_emb.inv_freq']",
        ),
        (lambda t: t.pop("norm.weight"), "missing tensors ['norm.weight']"),
        (
            lambda t: t.update({"fc.weight": torch.ones(H, 2 * H)}),
            "fc.weight: shape (16, 32), expected (16, 48)",
        ),
        (lambda t: t.update({"d2t": torch.zeros(VD, dtype=torch.int64)}), "t2d does not mark exactly"),
    ],
)
def test_loader_rejects_tensors_that_break_the_contract(tmp_path: Path, edit, message: str) -> None:
    _, _, folder = _exported(tmp_path)
    _edit_weights(folder, edit)
    with pytest.raises(DataError, match=re.escape(message)):
        load_eagle_draft(folder)


def test_loader_needs_aux_ids_and_reads_them_from_eagle_config(tmp_path: Path) -> None:
    _, _, folder = _exported(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_eagle_draft(folder)[2] == [1, 2, 3]
    del config["eagle_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match="eagle_aux_hidden_state_layer_ids"):
        load_eagle_draft(folder)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "16"}, "must be positive integers"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"num_hidden_layers": 2}, "one layer"),
    ],
)
def test_loader_rejects_bad_config_values(tmp_path: Path, change: dict, message: str) -> None:
    _, _, folder = _exported(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(DataError, match=rf"config\.json: .*{message}"):
        load_eagle_draft(folder)


def test_loader_reports_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_eagle_draft(tmp_path / "nowhere")
    _, _, folder = _exported(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(DataError, match="model.safetensors does not exist"):
        load_eagle_draft(folder)
    (folder / "config.json").unlink()
    with pytest.raises(DataError, match="config.json does not exist"):
        load_eagle_draft(folder)
