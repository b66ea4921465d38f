"""The training metric on evaluation text: a head's per-position draft accuracy on the target's own greedy answers.

    python experiments/heldout_accuracy.py experiments=smollm2_scale eval.run=<run> eval.prompts_per_set=6
    python experiments/heldout_accuracy.py ... model.dtype=bfloat16 'eval.sets=[mt_bench_like]'

Validation (val/acc_k, val/tau_sim) scores the head at every answer position of held-out training sequences;
evaluate.py scores it per verification step on new prompts. When the two disagree, this script says why: it
scores every answer position of each evaluation prompt's greedy answer (max_new_tokens, on eval.device) the way
validation does (step k at position t: context up to t, ground-truth chain tokens; acc_k conditional on steps
0..k-1 right, tau_sim = 1 + sum_k prod_{i<=k} acc_i over the first num_spec_tokens steps). Near validation's
numbers on prompts like the training ones but not on others: the prompts differ, not the features. Below
validation on prompts like the training ones: the features differ (dtype, attention path). The cost is
quadratic in the answer's length (each position's context is drafted afresh), fine for 128-token answers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from eaglet.config import CONF_DIR, check_config
from eaglet.evaluate.drafter import Eagle3Drafter
from eaglet.evaluate.prompts import load_prompt_sets
from eaglet.evaluate.speculative import greedy_decode
from eaglet.formats.reader import load_eagle_draft
from eaglet.run_dir import RunDir
from eaglet.target_model import capture_hidden_states, load_target


@torch.inference_mode()
def position_counts(drafter: Eagle3Drafter, seq: torch.Tensor, aux: torch.Tensor, first: int, steps: int):
    """Per step: (right, scored) over the answer positions; seq [T] ids, aux [T-1, n_aux, H] at positions 0..T-2."""
    head = drafter.head
    right, scored = torch.zeros(steps), torch.zeros(steps)
    for t in range(first - 2, len(seq) - 2):  # position t predicts x_{t+2}, an answer token when t+2 >= first
        drafter.reset()
        hidden = drafter.append_context(seq[1 : t + 2], aux[: t + 1])[-1:]
        for k in range(min(steps, len(seq) - 2 - t)):
            if k:
                hidden = drafter.chain_step(seq[t + 1 + k : t + 2 + k], hidden)
            guess = int(head.draft_target_ids[head.logits(hidden).argmax(-1)])
            scored[k] += 1
            if guess != int(seq[t + 2 + k]):
                break
            right[k] += 1
    return right, scored


def main(overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    check_config(cfg)
    ev = cfg.eval
    target = load_target(cfg.model, device=ev.device, cache_dir=Path(cfg.paths.cache_dir))
    run = RunDir.resolve(ev.run, Path(cfg.paths.output_dir), key="eval.run")
    embed = target.parts.embed_tokens.weight.detach().float().cpu()
    head, _, aux_ids = load_eagle_draft(run.draft_dir, embed_tokens=embed)
    drafter = Eagle3Drafter(head.to(target.device).eval())
    steps, stops = ev.num_spec_tokens, {target.tokenizer.eos_token_id}
    print(f"| set | prompts | answer positions | {' | '.join(f'acc_{k}' for k in range(steps))} | tau_sim |")
    print("|---|---|---|" + "---|" * steps + "---|")
    for name, (prompts, _) in load_prompt_sets(cfg, target.tokenizer).items():
        right, scored = torch.zeros(steps), torch.zeros(steps)
        for prompt in prompts:
            answer, _ = greedy_decode(target, prompt, ev.max_new_tokens, stops)
            seq = torch.tensor(prompt + answer, device=target.device)
            ids = seq[None, :-1]
            aux = capture_hidden_states(target.model, target.parts, ids, torch.ones_like(ids), aux_ids)
            r, s = position_counts(drafter, seq, aux.aux_hidden_states[0], len(prompt), steps)
            right, scored = right + r, scored + s
        acc = (right / scored.clamp(min=1)).tolist()
        tau = 1 + sum(torch.tensor(acc).cumprod(0).tolist())
        cells = " | ".join(f"{a:.3f}" for a in acc)
        print(f"| {name} | {len(prompts)} | {int(scored[0])} | {cells} | {tau:.2f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
