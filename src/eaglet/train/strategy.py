"""From a strategy name to the Lightning strategy object eaglet trains with.

DDP keeps a full copy of the head on every device: the fastest choice while parameters + AdamW state fit
(about 16 bytes per trainable parameter). FSDP shards them, each decoder layer its own unit, for heads
whose optimizer state would not fit beside the activations (large vocabularies on smaller cards).
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, Strategy

from eaglet.model.draft_head import Eagle3DecoderLayer


def build_strategy(name: str, world_size: int) -> str | Strategy:
    """`name` is one of eaglet.config.choices.STRATEGIES (hardware.strategy, checked after composition)."""
    if name == "auto" or world_size == 1 and name == "ddp":
        return "auto"
    if name == "ddp":
        # Every parameter gets a gradient each step; the static graph lets DDP skip the unused-parameter scan.
        return DDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True, static_graph=True)
    return FSDPStrategy(
        auto_wrap_policy={Eagle3DecoderLayer},
        sharding_strategy="FULL_SHARD",
        # Frozen (embeddings, lm_head when frozen) and trainable parameters share flat units.
        use_orig_params=True,
        # One consolidated checkpoint on rank 0: export and resume read the same file as after DDP.
        state_dict_type="full",
        limit_all_gathers=True,
    )
