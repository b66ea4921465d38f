"""What a process that evaluates needs: the target on its device and the proposers (the head, n-gram lookup,
an optional baseline head)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eaglet.config.schema import EagletConfig
from eaglet.evaluate.proposers import Eagle3Proposer, NgramProposer, Proposer
from eaglet.formats.reader import load_eagle_draft
from eaglet.run_dir import RunDir
from eaglet.target_model import LoadedTarget, load_target


@dataclass
class Evaluator:
    target: LoadedTarget
    proposers: dict[str, Proposer]
    stop_ids: set[int]


def build_proposers(cfg: EagletConfig, run: RunDir, target: LoadedTarget) -> dict[str, Proposer]:
    embed = target.parts.embed_tokens.weight.detach().float().cpu()
    head, _, aux_ids = load_eagle_draft(run.draft_dir, embed_tokens=embed)
    proposers: dict[str, Proposer] = {
        "eaglet": Eagle3Proposer(head.to(target.device), aux_ids),
        "ngram": NgramProposer(min_n=cfg.eval.ngram_min_n, max_n=cfg.eval.ngram_max_n),
    }
    if cfg.eval.baseline_draft:
        other, _, other_ids = load_eagle_draft(cfg.eval.baseline_draft, embed_tokens=embed)
        proposers["baseline"] = Eagle3Proposer(other.to(target.device), other_ids)
    return proposers


def load_evaluator(cfg: EagletConfig, run: RunDir, device: str) -> Evaluator:
    target = load_target(cfg.model, device=device, cache_dir=Path(cfg.paths.cache_dir))
    return Evaluator(target, build_proposers(cfg, run, target), {target.tokenizer.eos_token_id})
