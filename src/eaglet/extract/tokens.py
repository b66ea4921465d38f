"""Token extraction (extract.features=tokens): the cheap first pass of online training.

The conversations go through exactly what a hidden-state extraction does before its forward (regeneration by
the target, chat template, tokenization, the shard plan, the token counts the draft vocab is chosen from);
then each planned shard's token streams are written, without running the target over them. The token
streams, shard boundaries and token_counts.safetensors are byte-identical to those of a hidden-state
extraction of the same data. Resumable like it: shards are recorded in the manifest one by one, and a rerun
checks each against its sha256 and rewrites the missing or damaged ones.
"""

from __future__ import annotations

import time
from typing import Any

from eaglet.data.templating import TokenizedConversation
from eaglet.extract import core
from eaglet.extract.job import ExtractionJob
from eaglet.extract.plan import plan_shards
from eaglet.shards import Manifest, write_manifest
from eaglet.shards.tokens import TOKEN_BYTES_PER_TOKEN, TOKEN_FEATURES, write_token_shard
from eaglet.target_model import resolve_aux_layer_ids


def run_token_extraction(job: ExtractionJob) -> core.ExtractSummary:
    """Write the job's token store (job.out_dir); returns what was written."""
    aux_ids = resolve_aux_layer_ids(job.model)
    # The target is loaded for what identifies it (online training checks the store against the target it loads)
    # and to regenerate answers in-process; it never runs over the conversations here.
    loaded = core.load_job(job)
    template, identity, samples = loaded.template, loaded.identity, loaded.samples
    settings = {
        **core.shared_settings(job, aux_ids),
        "features": TOKEN_FEATURES,
        "regenerate": core.regenerate_settings(job),
    }
    folder = start_token_folder(
        job, core.inputs_identity(job.model, identity, template, settings), samples.tokenized, aux_ids
    )
    start = time.perf_counter()
    with folder.writing():
        resumed = write_token_shards(samples.tokenized, folder.manifest, job)
        return core.finish(
            job,
            folder.manifest,
            samples.tokenized,
            skipped=samples.skipped,
            seconds=time.perf_counter() - start,
            processed_tokens=sum(s.num_tokens for s in samples.tokenized),
            resumed_shards=resumed,
            regenerated=samples.regenerated,
            follow_ups=samples.follow_ups,
        )


def start_token_folder(
    job: ExtractionJob, identity: dict[str, Any], samples: list[TokenizedConversation], aux_ids: list[int]
) -> core.ShardFolder:
    """The store's manifest for these inputs (resumed), or a new one once the disk is known to hold it all."""
    ext, model, out_dir = job.extract, job.model, job.out_dir
    fingerprint = core._fingerprint(identity, samples)
    manifest = core._prepare_output(out_dir, fingerprint, overwrite=ext.overwrite)
    plan = plan_shards([s.num_tokens for s in samples], ext.shard_tokens)
    # Per shard: 5 bytes a token, 16 a sequence (its offset and sample id), and the header.
    shards = [sum(samples[i].num_tokens * TOKEN_BYTES_PER_TOKEN + 16 for i in r) + core._HEADER for r in plan]
    sizes = {
        "token shards": sum(core._blocks(size) for size in shards),
        "token counts": core._blocks(8 * model.vocab_size + core._HEADER),
        "manifest": 2 * core._blocks(core._MANIFEST_BASE + core._MANIFEST_PER_SHARD * len(plan)),
    }
    folder = core.ShardFolder(out_dir, manifest, core._check_disk(out_dir, sizes))
    if manifest is None:
        folder.manifest = core.new_manifest(job, identity, aux_ids, fingerprint)
        with folder.writing():
            write_manifest(out_dir, folder.manifest)
    return folder


def write_token_shards(samples: list[TokenizedConversation], manifest: Manifest, job: ExtractionJob) -> int:
    """Write every planned token shard the manifest does not record intact, recording each once durable;
    returns how many recorded shards were kept."""
    out_dir = job.out_dir
    plan = plan_shards([s.num_tokens for s in samples], job.extract.shard_tokens)
    todo = core.check_resumable(plan, manifest, out_dir)
    for index in todo:
        members = plan[index]
        info = write_token_shard(
            out_dir,
            index,
            list(members),
            [samples[i].input_ids for i in members],
            [samples[i].loss_mask for i in members],
        )
        if index < len(manifest.shards):
            manifest.shards[index] = info  # a damaged shard, written again in its place
        else:
            manifest.shards.append(info)
        write_manifest(out_dir, manifest)
    return len(plan) - len(todo)
