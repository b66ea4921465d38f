"""What both extraction backends do around the forward: conversations to samples (regeneration, tokenization),
the inputs' identity, and the shard folder from its first manifest to its last (target head, resume, totals).

Crash safety: shards are written atomically and recorded in the manifest one by one; a rerun of the
same command recomputes the same deterministic plan, checks every recorded shard against the sha256 the
manifest holds, rewrites the missing or damaged ones and continues after the last recorded shard. A full
disk ends in one message (ShardFolder.writing); what was written before it stays complete.

Under extract.max_disk_gb (trainer.features=window) the folder also gets window.json (the bound and the
stream's plan) and its token counts when it starts, since training reads them while shards are still coming;
shards training retired (retired.json) are neither checked nor written again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from tqdm.auto import tqdm

from eaglet.config.schema import DatasetConfig, ModelConfig, RegenerateConfig, SelfPromptConfig
from eaglet.data.conversations import Conversation, load_conversations
from eaglet.data.follow_ups import add_follow_ups, follow_up_report
from eaglet.data.holdout import eval_set_prompts, normalise_prompt
from eaglet.data.regenerate import regenerate_conversations
from eaglet.data.regenerate_stats import RegenerateStats
from eaglet.data.self_prompt import (
    SelfPromptStats,
    example_pool,
    format_self_prompt_report,
    self_prompt,
    self_prompt_report,
    settings_key,
)
from eaglet.data.templating import (
    TokenizedConversation,
    chat_template_hash,
    chat_template_variables,
    resolve_chat_template,
    tokenize_conversations,
)
from eaglet.errors import ConfigError, DataError
from eaglet.extract.budget import DiskBudget
from eaglet.extract.job import ExtractionJob
from eaglet.extract.plan import plan_shards
from eaglet.fsutil import (
    DiskFullError,
    atomic_output,
    atomic_write_json,
    free_bytes,
    human_bytes,
    is_disk_full,
    remove_temporaries,
    sha256_file,
)
from eaglet.generation import chosen_engine
from eaglet.shards import (
    MANIFEST_FILE,
    MANIFEST_VERSION,
    STORED_DTYPES,
    TARGET_HEAD_FILE,
    TOKEN_COUNTS_FILE,
    Manifest,
    ShardInfo,
    bytes_per_token,
    count_tokens,
    load_token_counts,
    read_manifest,
    save_token_counts,
    shard_name,
    write_manifest,
)
from eaglet.shards.window import (
    StreamPlan,
    estimated_shard_bytes,
    read_retired,
    read_stream_plan,
    write_stream_plan,
)
from eaglet.target_model import LoadedTarget, load_target


@dataclass
class ExtractSummary:
    output_dir: Path
    sequences: int
    tokens: int
    masked_tokens: int
    truncated: int
    skipped: int
    bytes_on_disk: int
    seconds: float
    tokens_per_second: float
    shards: int
    resumed_shards: int
    regenerate: RegenerateStats | None
    # The follow-up turns of self-prompted conversations (eaglet.data.follow_ups.follow_up_report); None: off.
    follow_ups: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class TargetIdentity:
    """The target that answers and computes: its weights' config, its tokenizer, its precision and device."""

    config_hash: str
    tokenizer_hash: str
    dtype: str
    device: str


@dataclass
class ShardFolder:
    """A shard folder being written: its manifest, and the bytes this run still had to write when it began."""

    path: Path
    manifest: Manifest
    needed: int

    def budget(self, job: ExtractionJob) -> DiskBudget | None:
        """extract.max_disk_gb's bound on this folder, for the shard writers; None: unbounded."""
        limit = max_disk_bytes(job)
        return None if limit is None else DiskBudget(self.path, limit, job.extract.window_timeout_s)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """A write inside that finds the disk full ends in one message: where, free and needed, what to do."""
        with _full_disk_reported(
            self.path,
            f"this extraction needed about {human_bytes(self.needed)} there when it started",
            "free space, or set extract.output_dir to a folder on a larger disk, then re-run the same command: "
            "it keeps every complete shard",
        ):
            yield


@dataclass
class Samples:
    """The tokenized conversations to extract, the conversation of each, and how many were left out."""

    tokenized: list[TokenizedConversation]
    conversations: list[Conversation]
    # Conversations without an assistant token to learn (none in the data, or none within max_length).
    skipped: int
    regenerated: RegenerateStats | None
    follow_ups: Mapping[str, Any] | None = None


@dataclass
class SelfPrompted:
    """The prompts the target wrote (extract.self_prompt), the file that keeps them and what their report says."""

    prompts: list[Conversation]
    path: Path
    stats: SelfPromptStats
    settings: dict[str, Any]

    def write_report(self, follow_ups: Mapping[str, Any] | None = None) -> None:
        """The report beside the prompts (`.report.json`), printed."""
        report = self_prompt_report(self.stats, self.prompts, follow_ups=follow_ups)
        atomic_write_json(self.path.with_suffix(".report.json"), {"settings": self.settings, **report})
        print(format_self_prompt_report(report))


def chat_template(job: ExtractionJob, tokenizer: Any) -> str:
    """The template every conversation is rendered with (the model's, or model.chat_template)."""
    return resolve_chat_template(
        tokenizer, job.model.chat_template, chat_template_variables(job.model, job.extract.regenerate)
    )


@dataclass
class LoadedJob:
    """The target loaded here for a job, its chat template and identity, and the job's samples to write."""

    target: LoadedTarget
    template: str
    identity: TargetIdentity
    samples: Samples


def load_job(job: ExtractionJob) -> LoadedJob:
    """Load the target where extract.device says and prepare the job's samples with it (self-prompts and
    regenerated answers written in-process): what both in-process backends start from."""
    conversations, no_assistant = job.load_conversations()
    target = load_target(job.model, device=job.extract.device, cache_dir=job.cache_dir)
    template = chat_template(job, target.tokenizer)
    identity = TargetIdentity(
        config_hash=target.config_hash,
        tokenizer_hash=target.tokenizer_hash,
        dtype=str(target.dtype),
        device=target.device.type,
    )
    samples = prepare_samples(
        job, conversations, no_assistant, target.tokenizer, template, identity, model=target.model
    )
    return LoadedJob(target, template, identity, samples)


def new_manifest(
    job: ExtractionJob, identity: dict[str, Any], aux_ids: list[int], fingerprint: str
) -> Manifest:
    """The manifest of a folder this run starts, in progress (both backends store the last layer's output
    before the final norm)."""
    model = job.model
    return Manifest(
        version=MANIFEST_VERSION,
        status="in_progress",
        target=identity["target"],
        aux_layer_ids=aux_ids,
        last_layer_id=model.num_layers,
        last_hidden_pre_norm=True,
        hidden_size=model.hidden_size,
        vocab_size=model.vocab_size,
        dtype=job.extract.dtype,
        inputs_fingerprint=fingerprint,
        settings=identity["settings"],
    )


def prepare_samples(
    job: ExtractionJob,
    conversations: list[Conversation],
    no_assistant: int,
    tokenizer: Any,
    template: str,
    target: TargetIdentity,
    *,
    model: torch.nn.Module | None = None,
) -> Samples:
    """The conversations (with the prompts the target writes itself, extract.self_prompt; their answers
    regenerated when extract.regenerate.enabled), tokenized.

    `model` answers in-process; without it regeneration needs extract.regenerate.endpoint.
    """
    regenerated, follow_ups = None, None
    rg, sp = job.extract.regenerate, job.extract.self_prompt
    prompted = None
    if sp.num_prompts and model is not None:
        prompted = self_prompted(job, conversations, tokenizer, template, target, model)
        conversations = conversations + prompted.prompts
    if rg.enabled:
        originals = conversations
        conversations, regenerated = _regenerate(job, originals, tokenizer, template, target, model)
        if prompted is not None and sp.follow_up_turns:
            conversations, stats, follow_ups = followed_up(
                job, prompted, conversations, tokenizer, template, target, model
            )
            regenerated = regenerated.merged(stats)
            # The sampled answers answer the follow-ups too, though these were written after the first answers:
            # user turns are not learned from, and each sampled answer is still the target's to its context.
            ids = {c.id for c in prompted.prompts}
            longer = {c.id: c for c in conversations if c.id in ids}
            originals = [longer.get(c.id, c) for c in originals]
        if rg.samples_per_prompt > 1:
            if rg.sampled_from == "dataset":  # the dataset's come first, then the self-prompted ones
                originals = originals[: len(originals) - (len(prompted.prompts) if prompted else 0)]
            sampled, stats = _regenerate(
                job,
                sample_copies(originals[: rg.sampled_conversations], rg.samples_per_prompt),
                tokenizer,
                template,
                target,
                model,
                rg=OmegaConf.merge(rg, {"temperature": rg.sample_temperature, "top_p": rg.sample_top_p}),
            )
            conversations = conversations + sampled
            regenerated = regenerated.merged(stats)
    tokenized, kept, no_masked_token = _tokenize(
        conversations,
        tokenizer,
        template,
        max_length=job.extract.max_length,
        dataset=job.dataset,
        workers=job.extract.tokenize_workers,
    )
    return Samples(tokenized, kept, no_assistant + no_masked_token, regenerated, follow_ups)


def shared_settings(job: ExtractionJob, aux_ids: list[int]) -> dict[str, Any]:
    """The settings every backend records: the data, the layers and the shard layout."""
    ext = job.extract
    return {
        "dataset": job.dataset.name,
        "dataset_paths": list(job.dataset.paths),
        "aux_layer_ids": aux_ids,
        "dtype": ext.dtype,
        "max_length": ext.max_length,
        "shard_tokens": ext.shard_tokens,
    }


def regenerate_settings(
    job: ExtractionJob, *, without: tuple[str, ...] = ("import_from",)
) -> dict[str, Any] | None:
    """Regeneration's settings as the manifest records them (None when it is off).

    Where imported answers came from is not part of them (the samples' tokens are hashed; the vLLM backend, which
    always recorded it, passes `without=()`). The run's seed sits where regeneration's own seed was, and the
    sampled-answer keys count only when used, so earlier fingerprints still match.
    """
    regen = job.extract.regenerate
    if not regen.enabled:
        return None
    sampling = (
        "samples_per_prompt",
        "sample_temperature",
        "sample_top_p",
        "sampled_conversations",
        "sampled_from",
    )
    unused = sampling if regen.samples_per_prompt == 1 else ()
    if regen.sampled_conversations is None:  # every conversation sampled: as before the key existed
        unused += ("sampled_conversations",)
    if regen.sampled_from == "all":  # as before the key existed
        unused += ("sampled_from",)
    # How the engine prefills, not what it answers.
    unused += ("overlap_prefill", "prefill_graphs", "packed_prefill")
    return {k: v for k, v in dict(regen).items() if k not in without + unused} | {"seed": job.seed}


def inputs_identity(
    model: ModelConfig, target: TargetIdentity, template: str, settings: dict[str, Any]
) -> dict[str, Any]:
    """Everything besides the samples' tokens that determines the shards: the target and the settings."""
    return {
        "target": {
            "name": model.name,
            "architecture": model.architecture,
            "config_hash": target.config_hash,
            "tokenizer_hash": target.tokenizer_hash,
            "chat_template_hash": chat_template_hash(template),
            "num_layers": model.num_layers,
            "hidden_size": model.hidden_size,
            "vocab_size": model.vocab_size,
        },
        "settings": settings,
    }


def start_folder(
    job: ExtractionJob,
    identity: dict[str, Any],
    samples: list[TokenizedConversation],
    aux_ids: list[int],
    read_head: Callable[[], Mapping[str, torch.Tensor]],
) -> ShardFolder:
    """The folder's manifest for these inputs (resumed), or a new one once the disk is known to hold the
    whole folder; the target head (`read_head`, read only when the folder lacks it) is written beside it.

    Both backends store the last layer's output before the final norm (vLLM's id L is that state too).
    """
    ext, out_dir = job.extract, job.out_dir
    fingerprint = _fingerprint(identity, samples)
    manifest = _prepare_output(out_dir, fingerprint, overwrite=ext.overwrite)
    head_path = out_dir / TARGET_HEAD_FILE
    head = None if head_path.exists() else {name: t.contiguous() for name, t in read_head().items()}
    sizes, shard_bytes = _folder_sizes(job, samples, aux_ids, head)
    budget = max_disk_bytes(job)
    folder = ShardFolder(out_dir, manifest, _check_disk(out_dir, sizes, budget))
    with folder.writing():
        if manifest is None:
            folder.manifest = new_manifest(job, identity, aux_ids, fingerprint)
            write_manifest(out_dir, folder.manifest)
        if head is not None:
            with atomic_output(head_path) as tmp:
                save_file(head, tmp, metadata={"format": "pt"})
        if budget is not None:
            _start_window(job, samples, shard_bytes, sizes, budget)
    return folder


def max_disk_bytes(job: ExtractionJob) -> int | None:
    """extract.max_disk_gb in bytes; None: no bound."""
    gb = job.extract.max_disk_gb
    return None if gb is None else int(gb * 1e9)


def _start_window(
    job: ExtractionJob,
    samples: list[TokenizedConversation],
    shard_bytes: list[int],
    sizes: Mapping[str, int],
    budget: int,
) -> None:
    """window.json and the token counts, before any shard: training reads both while the shards come."""
    out_dir = job.out_dir
    fixed = sum(size for name, size in sizes.items() if name != "shards") + 2 * _BLOCK  # + the two records
    # Two shards: one training reads while the next is written; the trainer checks its own window's needs.
    need = fixed + 2 * max(shard_bytes)
    if budget < need:
        raise ConfigError(
            f"extract.max_disk_gb={job.extract.max_disk_gb} cannot hold the folder's fixed part "
            f"({human_bytes(fixed)}: target head, token counts, manifests) and two shards of up to "
            f"{human_bytes(max(shard_bytes))}: raise it to at least {need / 1e9:.3g}, or lower extract.shard_tokens"
        )
    counts = count_tokens(
        np.concatenate([s.input_ids for s in samples]),
        np.concatenate([s.loss_mask for s in samples]),
        job.model.vocab_size,
    )
    save_token_counts(out_dir, counts)
    plan = plan_shards([s.num_tokens for s in samples], job.extract.shard_tokens)
    tokens = [sum(samples[i].num_tokens for i in r) for r in plan]
    write_stream_plan(out_dir, StreamPlan(budget, shard_bytes, tokens, [len(r) for r in plan], fixed))
    print(
        f"window: at most {human_bytes(budget)} in {out_dir} ({len(plan)} shards of up to "
        f"{human_bytes(max(shard_bytes))}); train beside it with python train.py trainer.features=window"
    )


def check_resumable(
    plan: list[range], manifest: Manifest, out_dir: Path, *, sequences_may_be_skipped: bool = False
) -> list[int]:
    """The planned shards still to write, in order: every recorded shard whose file is missing or differs
    from the sha256 the manifest records (written again in its place), then those after the last recorded.

    Recorded shards must sit where the plan puts them. With `sequences_may_be_skipped` a shard may start
    after its first planned sequence (that one was skipped).
    """
    for index, info in enumerate(manifest.shards):
        fits = index < len(plan) and (
            info.first_sample in plan[index]
            if sequences_may_be_skipped
            else info.first_sample == plan[index].start
        )
        if not fits or info.file != shard_name(index):
            raise DataError(
                f"{out_dir / MANIFEST_FILE} records shard {info.file} that does not match this run's plan; "
                "re-run with extract.overwrite=true"
            )
    # Every recorded shard is hashed, on every rerun: a flipped byte keeps the size, and only its hash tells.
    # Hashing reads at disk speed (sha256 runs at over 1 GB/s a core), far faster than the target produced
    # those bytes, so it costs a small fraction of the extraction it guards. Shards window training retired
    # (deleted once trained on) are done with.
    retired = set(read_retired(out_dir))
    kept = [index for index in range(len(manifest.shards)) if index not in retired]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        intact = list(
            pool.map(lambda i: _intact(out_dir / manifest.shards[i].file, manifest.shards[i]), kept)
        )
    damaged = [index for index, ok in zip(kept, intact, strict=True) if not ok]
    for index in damaged:
        print(
            f"{out_dir / shard_name(index)} is missing or damaged (not the recorded sha256): writing it again"
        )
    return [*damaged, *range(len(manifest.shards), len(plan))]


def finish(
    job: ExtractionJob,
    manifest: Manifest,
    written: list[TokenizedConversation],
    *,
    skipped: int,
    seconds: float,
    processed_tokens: int,
    resumed_shards: int,
    regenerated: RegenerateStats | None,
    extra_totals: Mapping[str, int] | None = None,
    follow_ups: Mapping[str, Any] | None = None,
) -> ExtractSummary:
    """Token counts and totals of the `written` samples recorded, the manifest marked complete.

    A folder extracted under extract.max_disk_gb keeps the token counts it started with (training built its
    draft vocabulary from them), and its totals come from the manifest: shards retired are gone from the disk.
    """
    out_dir = job.out_dir
    if read_stream_plan(out_dir) is not None:
        counts = load_token_counts(out_dir)
    else:
        counts = count_tokens(
            np.concatenate([s.input_ids for s in written]),
            np.concatenate([s.loss_mask for s in written]),
            job.model.vocab_size,
        )
        save_token_counts(out_dir, counts)
    manifest.token_counts_file = TOKEN_COUNTS_FILE
    totals = {
        "sequences": sum(info.num_sequences for info in manifest.shards),
        "tokens": sum(info.num_tokens for info in manifest.shards),
        "masked_tokens": sum(info.num_masked for info in manifest.shards),
        "truncated": int(sum(s.truncated for s in written)),
        "skipped": skipped,
        **(extra_totals or {}),
        "bytes": int(sum(info.bytes for info in manifest.shards)),
        "distinct_masked_tokens": int((counts > 0).sum()),
    }
    manifest.totals = totals
    manifest.status = "complete"
    write_manifest(out_dir, manifest)
    return ExtractSummary(
        output_dir=out_dir,
        sequences=totals["sequences"],
        tokens=totals["tokens"],
        masked_tokens=totals["masked_tokens"],
        truncated=totals["truncated"],
        skipped=skipped,
        bytes_on_disk=totals["bytes"],
        seconds=seconds,
        tokens_per_second=processed_tokens / seconds if seconds > 0 else 0.0,
        shards=len(manifest.shards),
        resumed_shards=resumed_shards,
        regenerate=regenerated,
        follow_ups=follow_ups,
    )


def _regenerate(
    job: ExtractionJob,
    conversations: list[Conversation],
    tokenizer: Any,
    template: str,
    target: TargetIdentity,
    model: torch.nn.Module | None,
    rg: RegenerateConfig | None = None,
) -> tuple[list[Conversation], RegenerateStats]:
    """`conversations` answered by the target as `rg` (default extract.regenerate) says, cached by its settings."""
    rg, name = rg or job.extract.regenerate, job.model.name
    if rg.import_from is not None and not Path(rg.import_from).name.startswith(name):
        # Records hold prompts and answers, not who answered: the file name carries the model.
        raise ConfigError(
            f"extract.regenerate.import_from={rg.import_from!r}: its name does not start with the target's "
            f"name {name!r}, so its answers may be another model's; set import_from=null, or rename "
            f"the file to {name}-....jsonl(.gz) if {name} wrote it"
        )
    # Keyed by everything that changes a generated answer; records inside are keyed by conversation id,
    # so a larger dataset reuses what was generated for a smaller one.
    key = _short_hash(
        {
            "target": target.config_hash,
            "tokenizer": target.tokenizer_hash,
            "template": chat_template_hash(template),
            "max_new_tokens": rg.max_new_tokens,
            "temperature": rg.temperature,
            "top_p": rg.top_p,
            "seed": job.seed,
            "batch_size": rg.batch_size,
            "max_length": job.extract.max_length,
            "dtype": target.dtype,
            "device": target.device,
            # The engine's bf16 arithmetic can break a near-tie the other way: its answers are its own.
            **({"decoder": "engine"} if _decoder(model, rg) == "engine" else {}),
        }
    )
    path = job.data_dir / "regenerated" / f"{name}-{key}.jsonl"
    print(f"regenerating assistant turns with {name} -> {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _full_disk_reported(
        path.parent,
        "each regenerated answer is appended there as it finishes",
        "free space, or set paths.data_dir to a folder on a larger disk, then re-run the same command: "
        "it keeps every finished answer",
    ):
        return regenerate_conversations(
            model,
            tokenizer,
            conversations,
            cfg=rg,
            out_path=path,
            max_length=job.extract.max_length,
            chat_template=template,
            template_kwargs=chat_template_variables(job.model, rg) if rg.endpoint else None,
            seed=job.seed,
        )


def _example_prompts(sp: SelfPromptConfig, users: list[str], held_out: set[str]) -> list[str]:
    """The user prompts self-prompting's examples are drawn from: those of extract.self_prompt.example_paths
    (evaluation prompts left out), else the dataset's `users`."""
    if not sp.example_paths:
        return users
    found, _ = load_conversations(list(sp.example_paths), require_assistant=False)
    return [
        t.content
        for c in found
        for t in c.turns
        if t.role == "user" and normalise_prompt(t.content) not in held_out
    ]


def self_prompted(
    job: ExtractionJob,
    conversations: list[Conversation],
    tokenizer: Any,
    template: str,
    target: TargetIdentity,
    model: torch.nn.Module,
) -> SelfPrompted:
    """extract.self_prompt.num_prompts prompts the target wrote (eaglet.data.self_prompt), none of them an
    evaluation prompt or a (near) repeat of each other or of `conversations`' user turns; cached by settings."""
    sp, rg = job.extract.self_prompt, job.extract.regenerate
    if not rg.enabled:
        raise ConfigError(
            f"extract.self_prompt.num_prompts={sp.num_prompts} writes prompts without answers: set "
            "extract.regenerate.enabled=true so the target answers them"
        )
    identity = {
        "target": target.config_hash,
        "tokenizer": target.tokenizer_hash,
        "template": chat_template_hash(template),
        "dtype": target.dtype,
        "device": target.device,
        "seed": job.seed,
        **({"decoder": "engine"} if _decoder(model, rg) == "engine" else {}),
    }
    users = [t.content for c in conversations for t in c.turns if t.role == "user"]
    held_out = eval_set_prompts(job.held_out_sets)
    pool = example_pool(_example_prompts(sp, users, held_out)) if sp.examples else []
    path = job.data_dir / "self_prompted" / f"{job.model.name}-{settings_key(sp, identity, pool)}.jsonl"
    print(f"self-prompting {sp.num_prompts:,} user prompts with {job.model.name} -> {path}")
    existing = {normalise_prompt(text) for text in users}
    with _full_disk_reported(
        path.parent, "prompts are appended there as they are kept", "free space, then re-run the same command"
    ):
        prompts, stats = self_prompt(
            model, tokenizer, sp, template=template, out_path=path, seed=job.seed,
            held_out=held_out, existing=existing, examples_from=pool, engine=str(rg.engine),
            compile=rg.compile, overlap_prefill=rg.overlap_prefill, prefill_graphs=rg.prefill_graphs,
            packed_prefill=rg.packed_prefill,
        )  # fmt: skip
    prompted = SelfPrompted(prompts, path, stats, {**OmegaConf.to_container(sp), **identity})
    prompted.write_report()
    if len(prompts) < sp.num_prompts:
        print(
            f"warning: {len(prompts):,} distinct prompts of the {sp.num_prompts:,} asked for: the target repeats "
            "itself at these settings; raise extract.self_prompt.temperature or add categories"
        )
    return prompted


def followed_up(
    job: ExtractionJob,
    prompted: SelfPrompted,
    answered: list[Conversation],
    tokenizer: Any,
    template: str,
    target: TargetIdentity,
    model: torch.nn.Module,
) -> tuple[list[Conversation], RegenerateStats, dict[str, Any]]:
    """`answered` (same ids and order) with the self-prompted conversations grown by the user turns the target
    wrote after its answers (extract.self_prompt.follow_up_turns, eaglet.data.follow_ups), each answered; the
    regeneration of those turns, and the follow-ups' report (also added to the self-prompting report).

    Follow-ups are kept beside the prompts (`<prompts>.follow-ups.jsonl`), keyed by the history they follow; the
    answers go to the regeneration file of extract.regenerate, where each round goes on from the answers before.
    """
    sp, rg = job.extract.self_prompt, job.extract.regenerate
    path = prompted.path.with_suffix(".follow-ups.jsonl")
    print(f"self-prompting up to {sp.follow_up_turns} follow-up turns with {job.model.name} -> {path}")
    rounds: list[RegenerateStats] = []

    def answer(conversations: list[Conversation]) -> list[Conversation]:
        answers, stats = _regenerate(job, conversations, tokenizer, template, target, model)
        rounds.append(stats)
        return answers

    ids = {c.id for c in prompted.prompts}
    with _full_disk_reported(
        path.parent,
        "follow-ups are appended there as they are written",
        "free space, then re-run the same command",
    ):
        longer, stats = add_follow_ups(
            model, tokenizer, sp, [c for c in answered if c.id in ids], answer=answer, template=template,
            out_path=path, seed=job.seed, max_length=job.extract.max_length,
            held_out=eval_set_prompts(job.held_out_sets), engine=str(rg.engine), compile=rg.compile,
            overlap_prefill=rg.overlap_prefill, prefill_graphs=rg.prefill_graphs, packed_prefill=rg.packed_prefill,
        )  # fmt: skip
    report = follow_up_report(stats)
    prompted.write_report(follow_ups=report)
    by_id = {c.id: c for c in longer}
    regenerated = RegenerateStats()
    for round_stats in rounds:
        regenerated = regenerated.merged(round_stats)
    return [by_id.get(c.id, c) for c in answered], regenerated, report


def sample_copies(conversations: list[Conversation], samples: int) -> list[Conversation]:
    """Copies of each conversation for its sampled answers 1..samples-1, ids `<id>#s<k>` (own sampling streams)."""
    return [replace(c, id=f"{c.id}#s{k}") for k in range(1, samples) for c in conversations]


def _decoder(model: torch.nn.Module | None, rg: RegenerateConfig) -> str | None:
    """The in-process decoder that answers (None when a server does)."""
    if model is None or rg.endpoint is not None:
        return None
    return chosen_engine(model, str(rg.engine))


def _tokenize(
    conversations: list[Conversation],
    tokenizer: Any,
    template: str,
    *,
    max_length: int,
    dataset: DatasetConfig,
    workers: int | None = None,
) -> tuple[list[TokenizedConversation], list[Conversation], int]:
    """Samples with at least one loss-masked token, their conversations, and how many had none."""
    samples, kept, skipped = [], [], 0
    tokenized = tokenize_conversations(
        tokenizer, conversations, max_length=max_length, chat_template=template, workers=workers
    )
    progress = tqdm(tokenized, total=len(conversations), desc="tokenize", unit="conv", leave=False)
    for conv, sample in zip(conversations, progress, strict=True):
        if sample is None or sample.num_masked == 0:  # no assistant turn (e.g. regeneration found no room)
            skipped += 1
            continue
        samples.append(sample)
        kept.append(conv)
    if not samples:
        raise DataError(
            f"no conversation of dataset {dataset.name!r} has an assistant token within "
            f"extract.max_length={max_length}; check the files {list(dataset.paths)}"
        )
    return samples, kept, skipped


def _fingerprint(identity: dict, samples: list[TokenizedConversation]) -> str:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    for s in samples:
        digest.update(s.input_ids.tobytes())
        digest.update(s.loss_mask.tobytes())
    return digest.hexdigest()[:32]


def _short_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _prepare_output(out_dir: Path, fingerprint: str, *, overwrite: bool) -> Manifest | None:
    """The manifest to resume, or None for a fresh start; refuses a folder made from other inputs."""
    if out_dir.is_dir():
        remove_temporaries(out_dir)
    if not out_dir.exists() or not any(out_dir.iterdir()):
        out_dir.mkdir(parents=True, exist_ok=True)
        return None
    manifest_path = out_dir / MANIFEST_FILE
    manifest = read_manifest(out_dir) if manifest_path.exists() else None
    if manifest is not None and manifest.inputs_fingerprint == fingerprint:
        return manifest
    if not overwrite:
        what = "describes different inputs" if manifest else "holds files but no manifest"
        raise ConfigError(
            f"{out_dir} is not empty and {what} (other model, data or settings); pass extract.overwrite=true "
            "to replace it, or choose another folder with extract.output_dir=..."
        )
    shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    return None


# Files take whole blocks, so many small shards take more than their bytes; headers and manifest entries are
# rounded up generously.
_BLOCK = 4096
_HEADER = 1024
_MANIFEST_BASE, _MANIFEST_PER_SHARD = 4096, 512


def _blocks(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _folder_sizes(
    job: ExtractionJob,
    samples: list[TokenizedConversation],
    aux_ids: list[int],
    head: Mapping[str, torch.Tensor] | None,
) -> tuple[dict[str, int], list[int]]:
    """Bytes each part of the complete folder takes on disk, and an upper bound of each shard's file; `head`
    is None when the folder holds it."""
    ext, model, out_dir = job.extract, job.model, job.out_dir
    itemsize = torch.empty((), dtype=STORED_DTYPES[ext.dtype]).element_size()
    per_token = bytes_per_token(len(aux_ids), model.hidden_size, itemsize)
    plan = plan_shards([s.num_tokens for s in samples], ext.shard_tokens)
    shards = [estimated_shard_bytes(sum(samples[i].num_tokens for i in r), len(r), per_token) for r in plan]
    if head is None:
        head_bytes = (out_dir / TARGET_HEAD_FILE).stat().st_size
    else:
        head_bytes = sum(t.numel() * t.element_size() for t in head.values()) + _HEADER
    sizes = {
        "shards": sum(_blocks(size) for size in shards),
        "target head": _blocks(head_bytes),
        "token counts": _blocks(8 * model.vocab_size + _HEADER),
        # Replaced atomically after every shard: the old and the new copy side by side for a moment.
        "manifest": 2 * _blocks(_MANIFEST_BASE + _MANIFEST_PER_SHARD * len(plan)),
    }
    return sizes, shards


def _check_disk(out_dir: Path, sizes: Mapping[str, int], budget: int | None = None) -> int:
    """The bytes still to write (the whole folder less the shards and head already there, at most the `budget`
    of extract.max_disk_gb); refuses to start when the disk has less free."""
    present = sum(
        _blocks(entry.stat().st_size)
        for entry in os.scandir(out_dir)
        if entry.is_file() and (entry.name.startswith("shard-") or entry.name == TARGET_HEAD_FILE)
    )
    whole = sum(sizes.values())
    needed = max(0, (whole if budget is None else min(whole, budget)) - present)
    free = free_bytes(out_dir)
    parts = ", ".join(f"{name} {human_bytes(size)}" for name, size in sizes.items())
    bound = "" if budget is None else f", at most extract.max_disk_gb={budget / 1e9:g} at a time"
    print(
        f"disk: {human_bytes(needed)} still to write ({parts}{bound}); {human_bytes(free)} free at {out_dir}"
    )
    if needed > free:
        raise ConfigError(
            f"not enough disk at {out_dir}: this extraction needs about {human_bytes(needed)} more there "
            f"({parts} in all{bound}), {human_bytes(free)} free; free space, point extract.output_dir at a larger "
            "disk, extract less (dataset.max_records_per_file, extract.max_conversations), or bound the folder "
            "and train beside the extraction (extract.max_disk_gb=..., trainer.features=window)"
        )
    return needed


def _intact(path: Path, info: ShardInfo) -> bool:
    return path.is_file() and path.stat().st_size == info.bytes and sha256_file(path) == info.sha256


@contextmanager
def _full_disk_reported(folder: Path, need: str, what_to_do: str) -> Iterator[None]:
    """A write inside that finds the disk full ends in one DiskFullError naming the file, `folder`'s free
    space, `need` and `what_to_do`."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        path = (error.path if isinstance(error, DiskFullError) else None) or folder
        raise DiskFullError(
            f"no space left on device writing {path}: {human_bytes(free_bytes(folder))} free in {folder}, and "
            f"{need}; {what_to_do}",
            path,
        ) from error
