"""A small batched decoding loop over a transformers causal LM with a KV cache.

Rows that finish (end-of-turn or budget) leave the batch and its cache at once, so a batch costs what its
live rows cost; `generate` keeps every row to the end, which on CPU made regeneration several times slower.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def _pick(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Greedy when temperature is 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def decode_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """New token ids for each prompt (left-padded batch), each ending at the first stop id (excluded)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    rows = torch.arange(len(prompts), device=device)
    next_pos = positions[:, -1] + 1
    results: list[list[int]] = [[] for _ in prompts]
    stops = torch.tensor(sorted(stop_ids), device=device)
    for step in range(max_new_tokens):
        tokens = _pick(out.logits[:, -1], temperature, top_p, generator)
        live = ~torch.isin(tokens, stops)
        for row, token, alive in zip(rows.tolist(), tokens.tolist(), live.tolist(), strict=True):
            if alive:
                results[row].append(token)
        if step == max_new_tokens - 1 or not live.any():
            break
        if not live.all():
            keep = live.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, tokens, next_pos, attention_mask = (
                rows[keep],
                tokens[keep],
                next_pos[keep],
                attention_mask[keep],
            )
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
        out = model(
            input_ids=tokens[:, None],
            attention_mask=attention_mask,
            position_ids=next_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
    return results
