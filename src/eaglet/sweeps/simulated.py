"""The simulated τ of a served head at draft lengths 1..K_max, on the validation shards of its run.

The exported head (bf16 weights, as servers load them) is unrolled K_max training-time-test steps over
every validation row, whatever K it trained with. acc_k is the share of positions whose step-k draft equals
the target's argmax given steps 0..k-1 did (eaglet.train.ttt), so with greedy drafting of K tokens

    τ_sim(K) = 1 + Σ_{k<K} Π_{i≤k} acc_i,

the same measure as val/tau_sim, at every K. It reads no target, only the shards.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from eaglet.formats.reader import load_eagle_draft
from eaglet.shards import TARGET_HEAD_FILE
from eaglet.train.datamodule import ShardDataModule
from eaglet.train.ttt import ttt_forward


def tau_curve(step_accuracy: list[float]) -> list[float]:
    """τ at draft lengths 1..len(step_accuracy) from conditional per-step accuracies."""
    taus, tau, survive = [], 1.0, 1.0
    for acc in step_accuracy:
        survive *= acc
        tau += survive
        taus.append(tau)
    return taus


@torch.inference_mode()
def simulated_curve(
    draft_dir: Path,
    shards: Path,
    *,
    k_max: int,
    target_norm_eps: float,
    tokens_per_batch: int,
    val_fraction: float,
    seed: int,
    chunk_tokens: int,
    device: torch.device,
) -> dict[str, list[float] | int]:
    """{"tau": τ_sim(1..k_max), "step_accuracy": acc_0..acc_{k_max-1}, "positions": positions counted at step 0}."""
    target_head = load_file(shards / TARGET_HEAD_FILE)
    head, _, _ = load_eagle_draft(draft_dir, embed_tokens=target_head["embed_tokens.weight"].float())
    head = head.to(device)
    data = ShardDataModule(shards, tokens_per_batch, val_fraction=val_fraction, seed=seed, num_workers=0)
    data.setup()
    correct = torch.zeros(k_max, dtype=torch.float64)
    counts = torch.zeros(k_max, dtype=torch.float64)
    loader = data.val_dataloader()
    for batch in loader or []:
        out = ttt_forward(
            head,
            {key: value.to(device) for key, value in batch.items()},
            target_norm_weight=target_head["norm.weight"].to(device),
            target_norm_eps=target_norm_eps,
            target_lm_head=target_head["lm_head.weight"].to(device),
            ttt_steps=k_max,
            step_loss_decay=1.0,
            chunk_tokens=chunk_tokens,
        )
        correct += out.step_correct.double().cpu()
        counts += out.step_counts.double().cpu()
    accuracy = [float(c / n) if n else 0.0 for c, n in zip(correct.tolist(), counts.tolist(), strict=True)]
    return {"tau": tau_curve(accuracy), "step_accuracy": accuracy, "positions": int(counts[0])}
