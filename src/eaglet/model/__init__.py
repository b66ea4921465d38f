"""The EAGLE-3 draft head and its training-time-test attention."""

from eaglet.model.attention import context_attention, document_causal_mask, ttt_attention
from eaglet.model.draft_head import Eagle3DraftHead, rms_norm

__all__ = ["Eagle3DraftHead", "context_attention", "document_causal_mask", "rms_norm", "ttt_attention"]
