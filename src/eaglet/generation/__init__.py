"""Batched decoding with the target: continuous batching for regeneration, a fixed prompt list for evaluation."""

from eaglet.generation.continuous import DecodeSettings, Request, WorkSource, decode_continuous
from eaglet.generation.decode import decode_batch

__all__ = ["DecodeSettings", "Request", "WorkSource", "decode_batch", "decode_continuous"]
