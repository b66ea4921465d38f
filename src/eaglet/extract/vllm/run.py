"""Extraction with vLLM computing the hidden states (extract.backend=vllm).

Same inputs, plan, shard format, manifest, token counts and resume as the transformers backend (both run
eaglet.extract.core): eaglet templates and tokenizes every conversation itself (its loss mask), sends the
token ids to vLLM, and turns the file vLLM writes per request into the sequence's features. A sequence whose
ids vLLM tokenizes differently is skipped and counted (an error with extract.strict=true); the shard it was
planned in holds the others, so a rerun recomputes the same plan and resumes after the last recorded shard.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from eaglet.config.schema import HardwareConfig
from eaglet.data.conversations import Conversation
from eaglet.errors import ConfigError
from eaglet.extract import core
from eaglet.extract.budget import DiskBudget
from eaglet.extract.job import ExtractionJob
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
from eaglet.extract.vllm.version import features_for
from eaglet.extract.writer import ShardWriterPool
from eaglet.shards import STORED_DTYPES, Manifest
from eaglet.target_model import load_tokenizer, resolve_aux_layer_ids, tokenizer_hash


class HiddenStateSource(Protocol):
    version: str

    @property
    def description(self) -> str: ...

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def extract(self, prompts: list[list[int]]) -> list[Path]: ...

    def close(self) -> None: ...


def open_source(job: ExtractionJob, plan: LaunchPlan, hardware: HardwareConfig) -> HiddenStateSource:
    """The server at extract.vllm.url (its serve command printed first), else an in-process engine."""
    vc = job.extract.vllm
    if vc.url:
        print("start the vLLM server for this extraction with:\n" + serve_command(plan, vc.url))
        from eaglet.extract.vllm.server import ServerSource  # the HTTP client, only where a server is used

        return ServerSource(vc, architecture=job.model.architecture, max_model_len=plan.max_model_len)
    return EngineSource(plan, hardware, job.model.architecture)


def run_vllm_extraction(job: ExtractionJob, hardware: HardwareConfig, *, seed: int) -> core.ExtractSummary:
    """Extract the job's dataset with vLLM computing the states on `hardware`; returns what was written."""
    if job.extract.self_prompt.num_prompts:
        raise ConfigError(
            "extract.self_prompt runs with the target in this process: run it once with extract.backend=transformers "
            "(it writes data/self_prompted/*.jsonl), then extract that file with dataset=jsonl "
            "dataset.paths=[...] on this backend; conversations with follow-up turns "
            "(extract.self_prompt.follow_up_turns) are extracted with extract.backend=transformers"
        )
    features_for(job.model.architecture)
    aux_ids = resolve_aux_layer_ids(job.model)
    layout = LayerLayout.for_target(aux_ids, job.model.num_layers)
    plan = resolve_launch(job, layout, devices=hardware.devices, seed=seed)
    source = open_source(job, plan, hardware)  # the version gate: before any data or weights are read
    try:
        hf_config = checkpoint.read_config(plan.model)
        checkpoint.check_dims(job.model, hf_config)
        return _run(job, source, plan, layout, aux_ids, hf_config)
    finally:
        source.close()


def _run(
    job: ExtractionJob,
    source: HiddenStateSource,
    plan: LaunchPlan,
    layout: LayerLayout,
    aux_ids: list[int],
    hf_config: dict,
) -> core.ExtractSummary:
    ext, out_dir = job.extract, job.out_dir
    conversations, no_assistant = job.load_conversations()
    tokenizer = load_tokenizer(job.model, job.cache_dir)
    template = core.chat_template(job, tokenizer)
    identity = core.TargetIdentity(
        config_hash=checkpoint.checkpoint_config_hash(hf_config),
        tokenizer_hash=tokenizer_hash(tokenizer),
        # No weights are loaded here, so no precision or device of our own: regeneration files keep the key
        # this backend always gave them (bf16 on cuda), so earlier ones are reused.
        dtype=str(torch.bfloat16),
        device="cuda",
    )
    if ext.regenerate.enabled and ext.regenerate.endpoint is None:
        raise ConfigError(
            "extract.backend=vllm regenerates answers through a server: set "
            "extract.regenerate.endpoint=http://host:8000/v1 (a vLLM or SGLang server of the target), or "
            "extract.regenerate.enabled=false to keep the dataset's answers"
        )
    samples = core.prepare_samples(job, conversations, no_assistant, tokenizer, template, identity)
    settings = {
        "backend": "vllm",
        "vllm_version": source.version,
        **core.shared_settings(job, aux_ids),
        "target_dtype": job.model.dtype,
        "check_tokenization": ext.vllm.check_tokenization,
        "regenerate": core.regenerate_settings(job, without=()),
    }
    folder = core.start_folder(
        job,
        core.inputs_identity(job.model, identity, template, settings),
        samples.tokenized,
        aux_ids,
        read_head=lambda: checkpoint.read_target_head(plan.model, job.model),
    )
    manifest = folder.manifest

    print(f"hidden states from {source.description}")
    shards = plan_shards([s.num_tokens for s in samples.tokenized], ext.shard_tokens)
    todo = core.check_resumable(shards, manifest, out_dir, sequences_may_be_skipped=True)
    start = time.perf_counter()
    render = functools.partial(_rendered, tokenizer, template)
    with folder.writing():
        processed = _write_shards(
            job, source, layout, samples, render, shards, todo, manifest, budget=folder.budget(job)
        )
        seconds = time.perf_counter() - start

        mismatched = len(samples.tokenized) - sum(info.num_sequences for info in manifest.shards)
        # Under extract.max_disk_gb training deletes shards once trained on: the totals count the truncated
        # sequences of every planned one, those vLLM tokenized differently included.
        written = (
            range(len(samples.tokenized)) if folder.budget(job) else _written_sample_ids(out_dir, manifest)
        )
        summary = core.finish(
            job,
            manifest,
            [samples.tokenized[i] for i in written],
            skipped=samples.skipped + mismatched,
            seconds=seconds,
            processed_tokens=processed,
            resumed_shards=len(shards) - len(todo),
            regenerated=samples.regenerated,
            extra_totals={"tokenization_mismatches": mismatched},
        )
    if mismatched:
        print(f"{mismatched} sequences skipped: vLLM tokenizes them differently from eaglet (listed above)")
    return summary


def _write_shards(
    job: ExtractionJob,
    source: HiddenStateSource,
    layout: LayerLayout,
    samples: core.Samples,
    render: Callable[[Conversation], str],
    shards: list[range],
    todo: list[int],
    manifest: Manifest,
    budget: DiskBudget | None = None,
) -> int:
    """Write the planned shards `todo` names, within `budget` (extract.max_disk_gb); returns the tokens sent to
    vLLM."""
    ext, out_dir = job.extract, job.out_dir
    tokenized, conversations = samples.tokenized, samples.conversations
    dtype = STORED_DTYPES[ext.dtype]
    total = sum(tokenized[i].num_tokens for index in todo for i in shards[index])
    processed = 0
    with (
        tqdm(total=total, desc="extract (vLLM)", unit="tok", unit_scale=True) as bar,
        ShardWriterPool(out_dir, manifest, dtype, budget=budget) as writer,
    ):
        for index in todo:
            ids = list(shards[index])
            if ext.vllm.check_tokenization:
                ids = _agreeing(source, samples, render, ids, strict=ext.strict)
            if not ids:
                raise AlignmentError(
                    f"vLLM tokenizes every conversation of shard {index} differently from eaglet: the server's "
                    "tokenizer or chat template is not eaglet's (check model.path, model.tokenizer_path)"
                )
            files = source.extract([tokenized[i].input_ids.tolist() for i in ids])
            features = []
            for i, file in zip(ids, files, strict=True):
                where = f"{conversations[i].where}: conversation {conversations[i].id!r} ({file})"
                features.append(to_sequence_features(i, tokenized[i], read_request_file(file), layout, where))
            writer.submit(index, features)
            if not ext.vllm.keep_request_files:
                for file in files:
                    remove_request_file(file)
            n = sum(tokenized[i].num_tokens for i in shards[index])
            processed += sum(tokenized[i].num_tokens for i in ids)
            bar.update(n)
    return processed


def _agreeing(
    source: HiddenStateSource,
    samples: core.Samples,
    render: Callable[[Conversation], str],
    ids: list[int],
    *,
    strict: bool,
) -> list[int]:
    """The sequences whose rendered text vLLM tokenizes into eaglet's ids; the others are reported and dropped."""
    conversations = samples.conversations
    texts = [render(conversations[i]) for i in ids]
    theirs = source.tokenize(texts)
    agreeing = []
    for i, vllm_ids in zip(ids, theirs, strict=True):
        why = tokenization_mismatch(samples.tokenized[i], vllm_ids)
        if why is None:
            agreeing.append(i)
            continue
        message = f"{conversations[i].where}: conversation {conversations[i].id!r}: vLLM tokenizes it differently ({why})"
        if strict:
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
