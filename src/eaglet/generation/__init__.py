"""Batched decoding with the target (regeneration now, speculative-decoding evaluation later)."""

from eaglet.generation.decode import decode_batch

__all__ = ["decode_batch"]
