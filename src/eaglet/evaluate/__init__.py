"""Evaluate a draft head by real speculative decoding against the target, with an n-gram baseline."""

from eaglet.evaluate.drafter import Eagle3Drafter
from eaglet.evaluate.metrics import evaluate_prompts, format_table
from eaglet.evaluate.proposers import Eagle3Proposer, NgramProposer, Proposer, TargetState
from eaglet.evaluate.speculative import DecodeStats, LosslessError, greedy_decode, speculative_decode

__all__ = [
    "DecodeStats",
    "Eagle3Drafter",
    "Eagle3Proposer",
    "LosslessError",
    "NgramProposer",
    "Proposer",
    "TargetState",
    "evaluate_prompts",
    "format_table",
    "greedy_decode",
    "speculative_decode",
]
