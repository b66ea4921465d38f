"""Extraction with the target loaded in this process by transformers (extract.backend=transformers): every
planned shard's sequences go through the target in length-bucketed batches, their hidden states captured."""

from __future__ import annotations

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from eaglet.data.templating import TokenizedConversation
from eaglet.extract import core
from eaglet.extract.job import ExtractionJob
from eaglet.extract.plan import plan_batches, plan_shards
from eaglet.extract.writer import ShardWriterPool
from eaglet.shards import STORED_DTYPES, Manifest, SequenceFeatures
from eaglet.target_model import (
    LoadedTarget,
    capture_hidden_states,
    head_weights,
    load_target,
    resolve_aux_layer_ids,
)


def run_transformers_extraction(job: ExtractionJob) -> core.ExtractSummary:
    """Extract the job's dataset with the target loaded here; returns what was written."""
    ext = job.extract
    aux_ids = resolve_aux_layer_ids(job.model)
    conversations, no_assistant = job.load_conversations()

    target = load_target(job.model, device=ext.device, cache_dir=job.cache_dir)
    template = core.chat_template(job, target.tokenizer)
    identity = core.TargetIdentity(
        config_hash=target.config_hash,
        tokenizer_hash=target.tokenizer_hash,
        dtype=str(target.dtype),
        device=target.device.type,
    )
    samples = core.prepare_samples(
        job, conversations, no_assistant, target.tokenizer, template, identity, model=target.model
    )
    settings = {
        **core.shared_settings(job, aux_ids),
        # Batch composition changes float rounding in the forward: part of the identity.
        "batch_tokens": ext.batch_tokens,
        "target_dtype": identity.dtype,
        "device": identity.device,
        # Where imported answers came from is not part of it: the samples' tokens are hashed. The run's seed
        # sits where regeneration's own seed was, so earlier fingerprints still match.
        "regenerate": (
            {k: v for k, v in dict(ext.regenerate).items() if k != "import_from"} | {"seed": job.seed}
            if ext.regenerate.enabled
            else None
        ),
    }
    folder = core.start_folder(
        job,
        core.inputs_identity(job.model, identity, template, settings),
        samples.tokenized,
        aux_ids,
        read_head=lambda: head_weights(target.parts),
    )

    start = time.perf_counter()
    with folder.writing():
        processed, resumed = _write_shards(job, target, samples.tokenized, aux_ids, folder.manifest)
        return core.finish(
            job,
            folder.manifest,
            samples.tokenized,
            skipped=samples.skipped,
            seconds=time.perf_counter() - start,
            processed_tokens=processed,
            resumed_shards=resumed,
            regenerated=samples.regenerated,
        )


def _write_shards(
    job: ExtractionJob,
    target: LoadedTarget,
    samples: list[TokenizedConversation],
    aux_ids: list[int],
    manifest: Manifest,
) -> tuple[int, int]:
    """Write every planned shard the manifest does not record intact; returns (tokens processed, shards kept)."""
    ext, out_dir = job.extract, job.out_dir
    lengths = [s.num_tokens for s in samples]
    plan = plan_shards(lengths, ext.shard_tokens)
    todo = core.check_resumable(plan, manifest, out_dir)
    kept = len(plan) - len(todo)
    dtype = STORED_DTYPES[ext.dtype]
    total = sum(lengths[i] for index in todo for i in plan[index])
    processed = 0
    start = time.perf_counter()
    with (
        tqdm(total=total, desc="extract", unit="tok", unit_scale=True) as bar,
        ShardWriterPool(out_dir, manifest, dtype) as writer,
    ):
        for index in todo:
            features: dict[int, SequenceFeatures] = {}
            for batch in plan_batches(lengths, plan[index], ext.batch_tokens):
                features.update(forward_batch(target, samples, batch, aux_ids, dtype))
                n = sum(lengths[i] for i in batch)
                processed += n
                bar.update(n)
                bar.set_postfix(tok_s=f"{processed / (time.perf_counter() - start):.0f}")
            writer.submit(index, [features[i] for i in plan[index]])
    return processed, kept


def forward_batch(
    target: LoadedTarget,
    samples: list[TokenizedConversation],
    batch: list[int],
    aux_ids: list[int],
    dtype: torch.dtype,
) -> dict[int, SequenceFeatures]:
    """The features of the `batch` samples from one padded forward through the target."""
    width = max(samples[i].num_tokens for i in batch)
    pad_id = target.tokenizer.pad_token_id or 0
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, i in enumerate(batch):
        n = samples[i].num_tokens
        input_ids[row, :n] = torch.from_numpy(samples[i].input_ids.astype(np.int64))
        attention_mask[row, :n] = 1
    captured = capture_hidden_states(
        target.model,
        target.parts,
        input_ids.to(target.device),
        attention_mask.to(target.device),
        aux_ids,
    )
    # Cast on the device: less to copy to the host.
    aux = captured.aux_hidden_states.to(dtype).cpu()
    last = captured.last_hidden_state.to(dtype).cpu()
    out = {}
    for row, i in enumerate(batch):
        n = samples[i].num_tokens
        out[i] = SequenceFeatures(
            sample_id=i,
            input_ids=torch.from_numpy(samples[i].input_ids),
            loss_mask=torch.from_numpy(samples[i].loss_mask),
            aux_hidden_states=aux[row, :n],
            last_hidden_state=last[row, :n],
        )
    return out
