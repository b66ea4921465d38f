"""The extraction stage: conversations in, memory-mapped feature shards + manifest + token counts out.

Crash safety: shards are written atomically and recorded in the manifest one by one; a rerun of the
same command recomputes the same deterministic plan and continues after the last recorded shard.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from eaglet.config.schema import EagletConfig
from eaglet.data.conversations import Conversation, load_conversations
from eaglet.data.holdout import drop_held_out, eval_set_prompts
from eaglet.data.regenerate import RegenerateStats, regenerate_conversations
from eaglet.data.templating import (
    TokenizedConversation,
    chat_template_hash,
    chat_template_variables,
    resolve_chat_template,
    tokenize_conversation,
)
from eaglet.errors import ConfigError, DataError
from eaglet.extract.plan import bytes_per_token, plan_batches, plan_shards
from eaglet.extract.writer import ShardWriterPool
from eaglet.fsutil import atomic_output, human_bytes
from eaglet.shards import (
    MANIFEST_FILE,
    MANIFEST_VERSION,
    STORED_DTYPES,
    TOKEN_COUNTS_FILE,
    Manifest,
    SequenceFeatures,
    count_tokens,
    read_manifest,
    save_token_counts,
    shard_name,
    write_manifest,
)
from eaglet.target_model import (
    LoadedTarget,
    capture_hidden_states,
    head_weights,
    load_target,
    resolve_aux_layer_ids,
)

TARGET_HEAD_FILE = "target_head.safetensors"


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


def shard_dir(cfg: EagletConfig) -> Path:
    """Where the shards of this model x dataset live (extract.output_dir overrides)."""
    if cfg.extract.output_dir:
        return Path(cfg.extract.output_dir)
    return Path(cfg.paths.data_dir) / "shards" / cfg.model.name / cfg.dataset.name


def load_dataset(cfg: EagletConfig) -> tuple[list[Conversation], int]:
    """The dataset's conversations, capped per file and in total, in file order, and how many had no
    assistant turn to train on (skipped; an error with extract.strict=true)."""
    require_assistant = not cfg.extract.regenerate.enabled
    conversations: list[Conversation] = []
    seen: dict[str, str] = {}
    no_assistant = 0
    for path in cfg.dataset.paths:
        part, stats = load_conversations(
            [path],
            max_records=cfg.dataset.max_records_per_file,
            require_assistant=require_assistant,
            strict=cfg.extract.strict,
        )
        for conv in part:
            if conv.id in seen:
                raise DataError(
                    f"{conv.source}:{conv.line}: id {conv.id!r} also appears at {seen[conv.id]}; ids must be "
                    "unique across the dataset's files"
                )
            seen[conv.id] = f"{conv.source}:{conv.line}"
        conversations.extend(part)
        no_assistant += stats.skipped_no_assistant
    if cfg.dataset.holdout_eval_sets:
        conversations, _ = drop_held_out(conversations, eval_set_prompts(cfg.eval.set_defs))
    if cfg.extract.max_conversations is not None:
        conversations = conversations[: cfg.extract.max_conversations]
    return conversations, no_assistant


def start_manifest(
    cfg: EagletConfig, out_dir: Path, identity: dict[str, Any], samples: list, aux_ids: list[int]
) -> Manifest:
    """The folder's manifest for these inputs (resumed), or a new one once the disk is known to hold them.

    Both backends store the last layer's output before the final norm (vLLM's id L is that state too).
    """
    ext = cfg.extract
    fingerprint = _fingerprint(identity, samples)
    manifest = _prepare_output(out_dir, fingerprint, overwrite=ext.overwrite)
    itemsize = torch.empty((), dtype=STORED_DTYPES[ext.dtype]).element_size()
    per_token = bytes_per_token(len(aux_ids), cfg.model.hidden_size, itemsize)
    _check_disk(out_dir, sum(s.num_tokens for s in samples) * per_token)
    if manifest is None:
        manifest = Manifest(
            version=MANIFEST_VERSION,
            status="in_progress",
            target=identity["target"],
            aux_layer_ids=aux_ids,
            last_layer_id=cfg.model.num_layers,
            last_hidden_pre_norm=True,
            hidden_size=cfg.model.hidden_size,
            vocab_size=cfg.model.vocab_size,
            dtype=ext.dtype,
            inputs_fingerprint=fingerprint,
            settings=identity["settings"],
        )
        write_manifest(out_dir, manifest)
    return manifest


def run_extraction(cfg: EagletConfig) -> ExtractSummary:
    """Run the whole stage for a composed config and return what was written."""
    ext = cfg.extract
    if ext.backend == "vllm":
        from eaglet.extract.vllm.run import run_vllm_extraction  # imports this module: resolved at call time

        return run_vllm_extraction(cfg)
    if ext.backend != "transformers":
        raise ConfigError(f"extract.backend={ext.backend!r}: choose transformers or vllm")
    if ext.dtype not in STORED_DTYPES:
        raise ConfigError(f"extract.dtype={ext.dtype!r}: choose one of {sorted(STORED_DTYPES)}")
    aux_ids = resolve_aux_layer_ids(cfg.model)
    out_dir = shard_dir(cfg)
    conversations, no_assistant = load_dataset(cfg)

    target = load_target(cfg.model, device=ext.device, cache_dir=Path(cfg.paths.cache_dir))
    template = resolve_chat_template(
        target.tokenizer, cfg.model.chat_template, chat_template_variables(cfg.model, cfg.extract.regenerate)
    )
    regen_stats = None
    if ext.regenerate.enabled:
        conversations, regen_stats = _regenerate(cfg, target, conversations, template)

    samples, no_masked_token = _tokenize(cfg, target, conversations, template)
    skipped = no_assistant + no_masked_token
    identity = _identity(cfg, target, template, aux_ids)
    manifest = start_manifest(cfg, out_dir, identity, samples, aux_ids)
    lengths = [s.num_tokens for s in samples]
    _write_target_head(out_dir, target)

    start = time.perf_counter()
    written_tokens, resumed = _write_shards(cfg, target, samples, aux_ids, out_dir, manifest)
    seconds = time.perf_counter() - start

    counts = count_tokens(
        np.concatenate([s.input_ids for s in samples]),
        np.concatenate([s.loss_mask for s in samples]),
        cfg.model.vocab_size,
    )
    save_token_counts(out_dir, counts)
    manifest.token_counts_file = TOKEN_COUNTS_FILE
    manifest.totals = {
        "sequences": len(samples),
        "tokens": int(sum(lengths)),
        "masked_tokens": int(sum(s.num_masked for s in samples)),
        "truncated": int(sum(s.truncated for s in samples)),
        "skipped": skipped,
        "bytes": int(sum(info.bytes for info in manifest.shards)),
        "distinct_masked_tokens": int((counts > 0).sum()),
    }
    manifest.status = "complete"
    write_manifest(out_dir, manifest)
    return ExtractSummary(
        output_dir=out_dir,
        sequences=len(samples),
        tokens=manifest.totals["tokens"],
        masked_tokens=manifest.totals["masked_tokens"],
        truncated=manifest.totals["truncated"],
        skipped=skipped,
        bytes_on_disk=manifest.totals["bytes"],
        seconds=seconds,
        tokens_per_second=written_tokens / seconds if seconds > 0 else 0.0,
        shards=len(manifest.shards),
        resumed_shards=resumed,
        regenerate=regen_stats,
    )


def _regenerate(
    cfg: EagletConfig, target: LoadedTarget, conversations: list[Conversation], template: str
) -> tuple[list[Conversation], RegenerateStats]:
    rg = cfg.extract.regenerate
    if rg.import_from is not None and not Path(rg.import_from).name.startswith(cfg.model.name):
        # Records hold prompts and answers, not who answered: the file name carries the model.
        raise ConfigError(
            f"extract.regenerate.import_from={rg.import_from!r}: its name does not start with the target's "
            f"name {cfg.model.name!r}, so its answers may be another model's; set import_from=null, or rename "
            f"the file to {cfg.model.name}-....jsonl(.gz) if {cfg.model.name} wrote it"
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
            "seed": cfg.seed,
            "batch_size": rg.batch_size,
            "max_length": cfg.extract.max_length,
            "dtype": str(target.dtype),
            "device": target.device.type,
        }
    )
    path = Path(cfg.paths.data_dir) / "regenerated" / f"{cfg.model.name}-{key}.jsonl"
    print(f"regenerating assistant turns with {cfg.model.name} -> {path}")
    return regenerate_conversations(
        target.model,
        target.tokenizer,
        conversations,
        cfg=rg,
        out_path=path,
        max_length=cfg.extract.max_length,
        chat_template=template,
        template_kwargs=chat_template_variables(cfg.model, rg) if rg.endpoint else None,
        seed=cfg.seed,
    )


def _tokenize(
    cfg: EagletConfig, target: LoadedTarget, conversations: list[Conversation], template: str
) -> tuple[list[TokenizedConversation], int]:
    """Tokenized samples with at least one loss-masked token, and how many were skipped for having none."""
    samples, skipped = [], 0
    for conv in tqdm(conversations, desc="tokenize", unit="conv", leave=False):
        if not any(turn.role == "assistant" for turn in conv.turns):  # e.g. regeneration found no room
            skipped += 1
            continue
        sample = tokenize_conversation(
            target.tokenizer, conv, max_length=cfg.extract.max_length, chat_template=template
        )
        if sample.num_masked == 0:
            skipped += 1
            continue
        samples.append(sample)
    if not samples:
        raise DataError(
            f"no conversation of dataset {cfg.dataset.name!r} has an assistant token within "
            f"extract.max_length={cfg.extract.max_length}; check the files {list(cfg.dataset.paths)}"
        )
    return samples, skipped


def _identity(cfg: EagletConfig, target: LoadedTarget, template: str, aux_ids: list[int]) -> dict:
    ext = cfg.extract
    return {
        "target": {
            "name": cfg.model.name,
            "architecture": cfg.model.architecture,
            "config_hash": target.config_hash,
            "tokenizer_hash": target.tokenizer_hash,
            "chat_template_hash": chat_template_hash(template),
            "num_layers": cfg.model.num_layers,
            "hidden_size": cfg.model.hidden_size,
            "vocab_size": cfg.model.vocab_size,
        },
        "settings": {
            "dataset": cfg.dataset.name,
            "dataset_paths": list(cfg.dataset.paths),
            "aux_layer_ids": aux_ids,
            "dtype": ext.dtype,
            "max_length": ext.max_length,
            "shard_tokens": ext.shard_tokens,
            # Batch composition changes float rounding in the forward: part of the identity.
            "batch_tokens": ext.batch_tokens,
            "target_dtype": str(target.dtype),
            "device": target.device.type,
            # Where imported answers came from is not part of it: the samples' tokens are hashed below. The
            # run's seed sits where regeneration's own seed was, so earlier fingerprints still match.
            "regenerate": (
                {k: v for k, v in dict(ext.regenerate).items() if k != "import_from"} | {"seed": cfg.seed}
                if ext.regenerate.enabled
                else None
            ),
        },
    }


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


def _check_disk(out_dir: Path, estimate: int) -> None:
    free = shutil.disk_usage(out_dir).free
    print(f"estimated shard size: {human_bytes(estimate)} ({human_bytes(free)} free at {out_dir})")
    if estimate > free:
        raise ConfigError(
            f"not enough disk for the shards: need about {human_bytes(estimate)} at {out_dir}, {human_bytes(free)} free; "
            "free space, point extract.output_dir at a larger disk, or lower dataset.max_records_per_file"
        )


def _write_target_head(out_dir: Path, target: LoadedTarget) -> None:
    """The target's embedding, final norm and lm_head: training needs them, not the whole target."""
    path = out_dir / TARGET_HEAD_FILE
    if path.exists():
        return
    tensors = {name: t.contiguous() for name, t in head_weights(target.parts).items()}
    with atomic_output(path) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})


def _write_shards(
    cfg: EagletConfig,
    target: LoadedTarget,
    samples: list[TokenizedConversation],
    aux_ids: list[int],
    out_dir: Path,
    manifest: Manifest,
) -> tuple[int, int]:
    """Write every planned shard the manifest does not record yet; returns (tokens processed, shards kept)."""
    ext = cfg.extract
    lengths = [s.num_tokens for s in samples]
    plan = plan_shards(lengths, ext.shard_tokens)
    _check_resumable(plan, manifest, out_dir)
    kept = len(manifest.shards)
    dtype = STORED_DTYPES[ext.dtype]
    todo = plan[len(manifest.shards) :]
    total = sum(lengths[i] for r in todo for i in r)
    processed = 0
    start = time.perf_counter()
    with (
        tqdm(total=total, desc="extract", unit="tok", unit_scale=True) as bar,
        ShardWriterPool(out_dir, manifest, dtype) as writer,
    ):
        for index in range(len(manifest.shards), len(plan)):
            features: dict[int, SequenceFeatures] = {}
            for batch in plan_batches(lengths, plan[index], ext.batch_tokens):
                features.update(forward_batch(target, samples, batch, aux_ids, dtype))
                n = sum(lengths[i] for i in batch)
                processed += n
                bar.update(n)
                bar.set_postfix(tok_s=f"{processed / (time.perf_counter() - start):.0f}")
            writer.submit(index, [features[i] for i in plan[index]])
    return processed, kept


def _check_resumable(plan: list[range], manifest: Manifest, out_dir: Path) -> None:
    """Recorded shards must sit where the plan puts them; a missing or truncated one is written again."""
    for index, info in enumerate(manifest.shards):
        if index >= len(plan) or info.file != shard_name(index) or info.first_sample != plan[index].start:
            raise DataError(
                f"{out_dir / MANIFEST_FILE} records shard {info.file} that does not match this run's plan; "
                "re-run with extract.overwrite=true"
            )
        path = out_dir / info.file
        if not path.exists() or path.stat().st_size != info.bytes:
            print(f"{path} is missing or damaged: extracting again from shard {index}")
            del manifest.shards[index:]
            return


def forward_batch(
    target: LoadedTarget,
    samples: list[TokenizedConversation],
    batch: list[int],
    aux_ids: list[int],
    dtype: torch.dtype,
) -> dict[int, SequenceFeatures]:
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
