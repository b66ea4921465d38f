"""The extraction stage with vLLM computing the hidden states (extract.backend=vllm).

Same inputs, plan, shard format, manifest, token counts and resume as the transformers backend: eaglet
templates and tokenizes every conversation itself (its loss mask), sends the token ids to vLLM, and turns
the file vLLM writes per request into the sequence's features. A sequence whose ids vLLM tokenizes
differently is skipped and counted (an error with extract.strict=true); the shard it was planned in holds
the others, so a rerun recomputes the same plan and resumes after the last recorded shard.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from eaglet.config.schema import EagletConfig
from eaglet.data.conversations import Conversation
from eaglet.data.regenerate import RegenerateStats
from eaglet.data.templating import (
    TokenizedConversation,
    chat_template_hash,
    chat_template_variables,
    resolve_chat_template,
    tokenize_conversation,
)
from eaglet.errors import ConfigError, DataError
from eaglet.extract import pipeline
from eaglet.extract.plan import plan_shards
from eaglet.extract.vllm import checkpoint
from eaglet.extract.vllm.engine import EngineSource
from eaglet.extract.vllm.launch import LaunchPlan, resolve_launch, serve_command
from eaglet.extract.vllm.layers import LayerLayout
from eaglet.extract.vllm.request_file import (
    AlignmentError,
    read_request_file,
    remove_request_file,
    to_sequence_features,
    tokenization_mismatch,
)
from eaglet.extract.vllm.server import ServerSource
from eaglet.extract.vllm.version import features_for
from eaglet.extract.writer import ShardWriterPool
from eaglet.fsutil import atomic_output
from eaglet.shards import (
    MANIFEST_FILE,
    STORED_DTYPES,
    TOKEN_COUNTS_FILE,
    Manifest,
    count_tokens,
    save_token_counts,
    shard_name,
    write_manifest,
)
from eaglet.target_model import LoadedTarget, load_tokenizer, resolve_aux_layer_ids, tokenizer_hash


class HiddenStateSource(Protocol):
    version: str

    @property
    def description(self) -> str: ...

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def extract(self, prompts: list[list[int]]) -> list[Path]: ...

    def close(self) -> None: ...


def open_source(cfg: EagletConfig, plan: LaunchPlan) -> HiddenStateSource:
    """The server at extract.vllm.url (its serve command printed first), else an in-process engine."""
    if cfg.extract.vllm.url:
        print("start the vLLM server for this extraction with:\n" + serve_command(plan, cfg.extract.vllm.url))
        return ServerSource(
            cfg.extract.vllm, architecture=cfg.model.architecture, max_model_len=plan.max_model_len
        )
    return EngineSource(plan, cfg.hardware, cfg.model.architecture)


def run_vllm_extraction(cfg: EagletConfig) -> pipeline.ExtractSummary:
    ext = cfg.extract
    if ext.dtype not in STORED_DTYPES:
        raise ConfigError(f"extract.dtype={ext.dtype!r}: choose one of {sorted(STORED_DTYPES)}")
    features_for(cfg.model.architecture)
    aux_ids = resolve_aux_layer_ids(cfg.model)
    layout = LayerLayout.for_target(aux_ids, cfg.model.num_layers)
    plan = resolve_launch(cfg, layout)
    source = open_source(cfg, plan)  # the version gate: before any data or weights are read
    try:
        hf_config = checkpoint.read_config(plan.model)
        checkpoint.check_dims(cfg.model, hf_config)
        return _run(cfg, source, plan, layout, aux_ids, hf_config)
    finally:
        source.close()


def _run(
    cfg: EagletConfig,
    source: HiddenStateSource,
    plan: LaunchPlan,
    layout: LayerLayout,
    aux_ids: list[int],
    hf_config: dict,
) -> pipeline.ExtractSummary:
    ext = cfg.extract
    out_dir = pipeline.shard_dir(cfg)
    conversations, no_assistant = pipeline.load_dataset(cfg)
    tokenizer = load_tokenizer(cfg.model, Path(cfg.paths.cache_dir))
    template = resolve_chat_template(
        tokenizer, cfg.model.chat_template, chat_template_variables(cfg.model, cfg.extract.regenerate)
    )
    target_hash = checkpoint.checkpoint_config_hash(hf_config)
    regen_stats = None
    if ext.regenerate.enabled:
        conversations, regen_stats = _regenerate(cfg, conversations, tokenizer, template, target_hash)

    samples, conversations, no_masked_token = _tokenize(cfg, tokenizer, template, conversations)
    identity = _identity(cfg, source, target_hash, tokenizer_hash(tokenizer), template, aux_ids)
    manifest = pipeline.start_manifest(cfg, out_dir, identity, samples, aux_ids)
    lengths = [s.num_tokens for s in samples]
    _write_target_head(out_dir, plan.model, cfg)

    print(f"hidden states from {source.description}")
    shards = plan_shards(lengths, ext.shard_tokens)
    _check_resumable(shards, manifest, out_dir)
    resumed = len(manifest.shards)
    start = time.perf_counter()
    render = functools.partial(_rendered, tokenizer, template)
    processed = _write_shards(cfg, source, layout, samples, conversations, render, shards, manifest, out_dir)
    seconds = time.perf_counter() - start

    written = _written_sample_ids(out_dir, manifest)
    mismatched = len(samples) - len(written)
    kept = [samples[i] for i in written]
    counts = count_tokens(
        np.concatenate([s.input_ids for s in kept]),
        np.concatenate([s.loss_mask for s in kept]),
        cfg.model.vocab_size,
    )
    save_token_counts(out_dir, counts)
    skipped = no_assistant + no_masked_token + mismatched
    manifest.token_counts_file = TOKEN_COUNTS_FILE
    manifest.totals = {
        "sequences": len(kept),
        "tokens": int(sum(s.num_tokens for s in kept)),
        "masked_tokens": int(sum(s.num_masked for s in kept)),
        "truncated": int(sum(s.truncated for s in kept)),
        "skipped": skipped,
        "tokenization_mismatches": mismatched,
        "bytes": int(sum(info.bytes for info in manifest.shards)),
        "distinct_masked_tokens": int((counts > 0).sum()),
    }
    manifest.status = "complete"
    write_manifest(out_dir, manifest)
    if mismatched:
        print(f"{mismatched} sequences skipped: vLLM tokenizes them differently from eaglet (listed above)")
    return pipeline.ExtractSummary(
        output_dir=out_dir,
        sequences=len(kept),
        tokens=manifest.totals["tokens"],
        masked_tokens=manifest.totals["masked_tokens"],
        truncated=manifest.totals["truncated"],
        skipped=skipped,
        bytes_on_disk=manifest.totals["bytes"],
        seconds=seconds,
        tokens_per_second=processed / seconds if seconds > 0 else 0.0,
        shards=len(manifest.shards),
        resumed_shards=resumed,
        regenerate=regen_stats,
    )


def _regenerate(
    cfg: EagletConfig, conversations: list[Conversation], tokenizer: Any, template: str, target_hash: str
) -> tuple[list[Conversation], RegenerateStats]:
    """Regeneration goes through an OpenAI-compatible server: vLLM's weights are not loaded in this process."""
    if cfg.extract.regenerate.endpoint is None:
        raise ConfigError(
            "extract.backend=vllm regenerates answers through a server: set "
            "extract.regenerate.endpoint=http://host:8000/v1 (a vLLM or SGLang server of the target), or "
            "extract.regenerate.enabled=false to keep the dataset's answers"
        )
    # The stage's regeneration reads only the tokenizer and the identity of a target; no weights here.
    target = LoadedTarget(
        model=None,  # type: ignore[arg-type]
        tokenizer=tokenizer,
        parts=None,  # type: ignore[arg-type]
        config_hash=target_hash,
        tokenizer_hash=tokenizer_hash(tokenizer),
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
    )
    return pipeline._regenerate(cfg, target, conversations, template)


def _tokenize(
    cfg: EagletConfig, tokenizer: Any, template: str, conversations: list[Conversation]
) -> tuple[list[TokenizedConversation], list[Conversation], int]:
    """Samples with at least one loss-masked token, their conversations, and how many had none."""
    samples, kept, skipped = [], [], 0
    for conv in tqdm(conversations, desc="tokenize", unit="conv", leave=False):
        sample = tokenize_conversation(
            tokenizer, conv, max_length=cfg.extract.max_length, chat_template=template
        )
        if sample.num_masked == 0:
            skipped += 1
            continue
        samples.append(sample)
        kept.append(conv)
    if not samples:
        raise DataError(
            f"no conversation of dataset {cfg.dataset.name!r} has an assistant token within "
            f"extract.max_length={cfg.extract.max_length}; check the files {list(cfg.dataset.paths)}"
        )
    return samples, kept, skipped


def _identity(
    cfg: EagletConfig,
    source: HiddenStateSource,
    target_hash: str,
    tok_hash: str,
    template: str,
    aux_ids: list[int],
) -> dict:
    ext = cfg.extract
    return {
        "target": {
            "name": cfg.model.name,
            "architecture": cfg.model.architecture,
            "config_hash": target_hash,
            "tokenizer_hash": tok_hash,
            "chat_template_hash": chat_template_hash(template),
            "num_layers": cfg.model.num_layers,
            "hidden_size": cfg.model.hidden_size,
            "vocab_size": cfg.model.vocab_size,
        },
        "settings": {
            "backend": "vllm",
            "vllm_version": source.version,
            "dataset": cfg.dataset.name,
            "dataset_paths": list(cfg.dataset.paths),
            "aux_layer_ids": aux_ids,
            "dtype": ext.dtype,
            "max_length": ext.max_length,
            "shard_tokens": ext.shard_tokens,
            "target_dtype": cfg.model.dtype,
            "check_tokenization": ext.vllm.check_tokenization,
            "regenerate": dict(ext.regenerate) if ext.regenerate.enabled else None,
        },
    }


def _write_target_head(out_dir: Path, model_path: str, cfg: EagletConfig) -> None:
    path = out_dir / pipeline.TARGET_HEAD_FILE
    if path.exists():
        return
    tensors = checkpoint.read_target_head(model_path, cfg.model)
    with atomic_output(path) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})


def _check_resumable(shards: list[range], manifest: Manifest, out_dir: Path) -> None:
    """Recorded shards must lie in the plan (a shard may start after its first planned sequence, if that one
    was skipped); a missing or truncated one is written again."""
    for index, info in enumerate(manifest.shards):
        if index >= len(shards) or info.file != shard_name(index) or info.first_sample not in shards[index]:
            raise DataError(
                f"{out_dir / MANIFEST_FILE} records shard {info.file} that does not match this run's plan; "
                "re-run with extract.overwrite=true"
            )
        path = out_dir / info.file
        if not path.exists() or path.stat().st_size != info.bytes:
            print(f"{path} is missing or damaged: extracting again from shard {index}")
            del manifest.shards[index:]
            return


def _write_shards(
    cfg: EagletConfig,
    source: HiddenStateSource,
    layout: LayerLayout,
    samples: list[TokenizedConversation],
    conversations: list[Conversation],
    render: Callable[[Conversation], str],
    shards: list[range],
    manifest: Manifest,
    out_dir: Path,
) -> int:
    """Write every planned shard the manifest does not record yet; returns the tokens sent to vLLM."""
    ext = cfg.extract
    dtype = STORED_DTYPES[ext.dtype]
    todo = shards[len(manifest.shards) :]
    total = sum(samples[i].num_tokens for r in todo for i in r)
    processed = 0
    with (
        tqdm(total=total, desc="extract (vLLM)", unit="tok", unit_scale=True) as bar,
        ShardWriterPool(out_dir, manifest, dtype) as writer,
    ):
        for index in range(len(manifest.shards), len(shards)):
            ids = list(shards[index])
            if ext.vllm.check_tokenization:
                ids = _agreeing(cfg, source, samples, conversations, render, ids)
            if not ids:
                raise AlignmentError(
                    f"vLLM tokenizes every conversation of shard {index} differently from eaglet: the server's "
                    "tokenizer or chat template is not eaglet's (check model.path, model.tokenizer_path)"
                )
            files = source.extract([samples[i].input_ids.tolist() for i in ids])
            features = []
            for i, file in zip(ids, files, strict=True):
                where = f"{conversations[i].where}: conversation {conversations[i].id!r} ({file})"
                features.append(to_sequence_features(i, samples[i], read_request_file(file), layout, where))
            writer.submit(index, features)
            if not ext.vllm.keep_request_files:
                for file in files:
                    remove_request_file(file)
            n = sum(samples[i].num_tokens for i in shards[index])
            processed += sum(samples[i].num_tokens for i in ids)
            bar.update(n)
    return processed


def _agreeing(
    cfg: EagletConfig,
    source: HiddenStateSource,
    samples: list[TokenizedConversation],
    conversations: list[Conversation],
    render: Callable[[Conversation], str],
    ids: list[int],
) -> list[int]:
    """The sequences whose rendered text vLLM tokenizes into eaglet's ids; the others are reported and dropped."""
    texts = [render(conversations[i]) for i in ids]
    theirs = source.tokenize(texts)
    agreeing = []
    for i, vllm_ids in zip(ids, theirs, strict=True):
        why = tokenization_mismatch(samples[i], vllm_ids)
        if why is None:
            agreeing.append(i)
            continue
        message = f"{conversations[i].where}: conversation {conversations[i].id!r}: vLLM tokenizes it differently ({why})"
        if cfg.extract.strict:
            raise AlignmentError(message + "; extract.strict=true stops here")
        print(f"skipped: {message}")
    return agreeing


def _rendered(tokenizer: Any, template: str, conversation: Conversation) -> str:
    """The whole conversation as eaglet's chat template renders it (what tokenize_conversation tokenizes)."""
    messages = [{"role": turn.role, "content": turn.content} for turn in conversation.turns]
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)


def _written_sample_ids(out_dir: Path, manifest: Manifest) -> list[int]:
    """The samples the recorded shards hold (planned ones minus those skipped for their tokenization)."""
    ids: list[int] = []
    for info in manifest.shards:
        with safe_open(out_dir / info.file, framework="pt") as handle:
            ids.extend(handle.get_tensor("sample_ids").tolist())
    return ids
