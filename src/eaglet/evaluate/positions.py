"""Validation's metric on evaluation text: a head's per-position accuracy on the target's own greedy answer.

Validation (val/acc_k, val/tau_sim) scores every answer position of held-out training sequences; the evaluator
scores verification steps on new prompts. When the two disagree, scoring the evaluation answers position by
position says why. Near validation's numbers on prompts like the training ones but not on others: the prompts
differ, not the features. Below them on prompts like the training ones: the features differ (dtype, attention).

Step k at answer position t, as in training (eaglet.train.ttt): context up to t, chain entries fed the true
tokens x_{t+1+k}; it predicts x_{t+2+k}. acc_k counts positions whose steps 0..k-1 were right. Each position's
context is drafted afresh (chain entries must not see later positions), so the cost grows with the square of
the answer's length: opt-in (eval.position_accuracy).

Beside it, the target's own top-1 probability on the same answer tokens: how sure the target is of what it
wrote. A head far below validation on a set the target is as sure of as of the training text has a data gap
there (prompts unlike its training prompts), not a set that is hard to predict. And the share of those answer
tokens the head's draft vocabulary holds: no draft step can propose a token outside it, so this share bounds acc_0
(a set far below 1 wants a larger draft.vocab_size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from eaglet.evaluate.drafter import Eagle3Drafter
from eaglet.target_model import LoadedTarget, capture_hidden_states


@torch.inference_mode()
def sequence_aux_states(target: LoadedTarget, aux_layer_ids: Sequence[int], tokens: Sequence[int]) -> Tensor:
    """The target's aux states [len(tokens) - 1, n_aux, H] at every position but the last (whose next token is
    unknown), from one forward."""
    ids = torch.tensor([list(tokens[:-1])], device=target.device)
    captured = capture_hidden_states(target.model, target.parts, ids, torch.ones_like(ids), aux_layer_ids)
    return captured.aux_hidden_states[0]


@torch.inference_mode()
def target_top1(target: LoadedTarget, tokens: Sequence[int], answer_start: int) -> tuple[float, int]:
    """(sum over the answer tokens[answer_start:] of the target's top-1 probability where it chose them, how
    many): for greedy answers the probability of the token it wrote."""
    ids = torch.tensor([list(tokens)], device=target.device)
    logits = target.model(input_ids=ids).logits[0, max(answer_start, 1) - 1 : len(tokens) - 1]
    top = (logits.amax(dim=-1).float() - logits.float().logsumexp(dim=-1)).exp()  # no [T, V] softmax kept
    return float(top.sum()), int(logits.shape[0])


@torch.inference_mode()
def chain_logits(drafter: Eagle3Drafter, tokens: Tensor, aux: Tensor, position: int, steps: int) -> Tensor:
    """The head's draft-vocab logits [s, V_d] at `position` t <= len(tokens) - 3 for steps k < s =
    min(steps, len(tokens) - 2 - t): context up to t, chain entries fed the true tokens[t + 1 + k], as TTT step k
    computes them."""
    drafter.reset()
    hidden = drafter.append_context(tokens[1 : position + 2], aux[: position + 1])[-1:]
    logits = []
    for k in range(min(steps, len(tokens) - 2 - position)):
        if k:
            hidden = drafter.chain_step(tokens[position + 1 + k : position + 2 + k], hidden)
        logits.append(drafter.head.logits(hidden)[0])
    drafter.reset()
    return torch.stack(logits)


def position_counts(
    drafter: Eagle3Drafter, tokens: Sequence[int], aux: Tensor, answer_start: int, steps: int
) -> tuple[list[int], list[int]]:
    """Per draft step k < steps: (right, scored) over the answer tokens[answer_start:], `aux` as
    `sequence_aux_states` gives it. Position t predicts tokens[t + 2 + k] at step k; only answer tokens are
    predicted, as only loss-masked tokens are in training; after a one-token prompt the first answer token has
    no position before it that could predict it (training's first prediction is token 2)."""
    seq = torch.tensor(list(tokens))
    right, scored = [0] * steps, [0] * steps
    for t in range(max(answer_start - 2, 0), len(seq) - 2):
        guesses = drafter.head.draft_target_ids[
            chain_logits(drafter, seq, aux, t, steps).argmax(dim=-1)
        ].tolist()
        for k, guess in enumerate(guesses):
            scored[k] += 1
            if guess != int(seq[t + 2 + k]):
                break
            right[k] += 1
    return right, scored


def in_draft_vocab(drafter: Eagle3Drafter, tokens: Sequence[int], answer_start: int) -> tuple[int, int]:
    """(how many of the tokens position_counts predicts at step 0, how many of those the draft vocab holds)."""
    predicted = torch.tensor(list(tokens[max(answer_start, 2) :]), dtype=torch.long)
    vocab = drafter.head.draft_target_ids.to("cpu")
    return int(predicted.numel()), int(torch.isin(predicted, vocab).sum())


def position_summary(
    right: Sequence[int],
    scored: Sequence[int],
    target_top1: tuple[float, int] = (0.0, 0),
    in_vocab: tuple[int, int] = (0, 0),
) -> dict[str, object]:
    """acc_k (0 where nothing was scored), tau_sim = 1 + sum_k prod_{i<=k} acc_i, the positions scored, the
    target's mean top-1 probability on the answer tokens from `target_top1`'s summed (sum, count), and the share
    of the predicted tokens in the draft vocab from `in_vocab`'s summed (predicted, in the vocab)."""
    acc = [r / s if s else 0.0 for r, s in zip(right, scored, strict=True)]
    tau, running = 1.0, 1.0
    for a in acc:
        running *= a
        tau += running
    total, count = target_top1
    predicted, held = in_vocab
    return {
        "accuracy": acc,
        "tau_sim": tau,
        "positions": scored[0] if scored else 0,
        "target_top1": total / count if count else 0.0,
        "in_draft_vocab": held / predicted if predicted else 0.0,
    }
