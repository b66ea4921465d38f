"""Evaluate a draft head by real speculative decoding against the target, with an n-gram baseline."""

from eaglet.evaluate.acceptance import DecodeStats
from eaglet.evaluate.drafter import Eagle3Drafter
from eaglet.evaluate.metrics import check_lossless, evaluate_prompts, format_table
from eaglet.evaluate.proposers import Eagle3Proposer, NgramProposer, Proposer, TargetState
from eaglet.evaluate.speculative import LosslessError, greedy_decode, speculative_decode

__all__ = [
    "DecodeStats",
    "Eagle3Drafter",
    "Eagle3Proposer",
    "LosslessError",
    "NgramProposer",
    "Proposer",
    "TargetState",
    "check_lossless",
    "evaluate_prompts",
    "format_table",
    "greedy_decode",
    "speculative_decode",
]
