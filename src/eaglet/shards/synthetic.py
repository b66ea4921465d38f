"""Shard folders of random features at a target's true shapes: benchmarks and planning checks train on them
through the real reader and train.py without running (or owning) the target."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglet.config.schema import ModelConfig
from eaglet.fsutil import atomic_output
from eaglet.shards.format import SequenceFeatures, write_shard
from eaglet.shards.layout import TARGET_HEAD_FILE
from eaglet.shards.manifest import MANIFEST_VERSION, Manifest, write_manifest
from eaglet.shards.vocab import count_tokens, save_token_counts
from eaglet.target_model.capture import resolve_aux_layer_ids


def write_synthetic_shards(
    directory: Path,
    model: ModelConfig,
    *,
    docs: int,
    doc_tokens: int,
    prompt_fraction: float = 0.4,
    docs_per_shard: int = 16,
    seed: int = 0,
    device: str = "cpu",
) -> Manifest:
    """`docs` documents of `doc_tokens` tokens, the first `prompt_fraction` of each a prompt (loss mask 0)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    aux_ids = resolve_aux_layer_ids(model)
    hidden, vocab = model.hidden_size, model.vocab_size
    gen = torch.Generator(device).manual_seed(seed)
    prompt = int(prompt_fraction * doc_tokens)
    shards, counts = [], torch.zeros(vocab, dtype=torch.int64)
    for first in range(0, docs, docs_per_shard):
        seqs = []
        for i in range(first, min(docs, first + docs_per_shard)):
            ids = torch.randint(0, vocab, (doc_tokens,), generator=gen, device=device).cpu()
            mask = torch.arange(doc_tokens) >= prompt
            feats = torch.randn(doc_tokens, len(aux_ids) + 1, hidden, generator=gen, device=device)
            feats = feats.to(torch.bfloat16).cpu()
            seqs.append(SequenceFeatures(i, ids, mask, feats[:, :-1], feats[:, -1]))
            counts += count_tokens(ids, mask, vocab)
        shards.append(write_shard(directory, len(shards), seqs, torch.bfloat16))
    save_token_counts(directory, counts + 1)  # every id seen once: any draft vocab size is valid
    head = {
        "embed_tokens.weight": torch.randn(vocab, hidden, generator=gen, device=device)
        .to(torch.bfloat16)
        .cpu(),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=gen, device=device) * hidden**-0.5)
        .to(torch.bfloat16)
        .cpu(),
    }
    with atomic_output(directory / TARGET_HEAD_FILE) as tmp:
        save_file(head, tmp)
    manifest = Manifest(
        version=MANIFEST_VERSION,
        status="complete",
        target={
            "name": model.name,
            "architecture": model.architecture,
            "num_layers": model.num_layers,
            "hidden_size": hidden,
            "vocab_size": vocab,
            "synthetic": True,
        },  # fmt: skip
        aux_layer_ids=aux_ids,
        last_layer_id=model.num_layers,
        last_hidden_pre_norm=True,
        hidden_size=hidden,
        vocab_size=vocab,
        dtype="bfloat16",
        inputs_fingerprint=f"synthetic-{seed}-{docs}x{doc_tokens}",
        shards=shards,
        token_counts_file="token_counts.safetensors",
    )
    write_manifest(directory, manifest)
    return manifest
