"""Batched decoding with the target: continuous batching for regeneration, a fixed prompt list for evaluation."""

from eaglet.generation.decode import chosen_engine, decode_batch, decode_continuous
from eaglet.generation.work import DecodeSettings, Request, WorkSource

__all__ = ["DecodeSettings", "Request", "WorkSource", "chosen_engine", "decode_batch", "decode_continuous"]
