"""A dataset's conversations as the stages read them: every file in order, ids unique across files, and
evaluation prompts held out when the dataset asks for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from eaglet.config.schema import DatasetConfig
from eaglet.data.conversations import Conversation, load_conversations
from eaglet.data.holdout import drop_held_out, eval_set_prompts
from eaglet.errors import ConfigError, DataError


def dataset_files(dataset: DatasetConfig) -> list[str]:
    """dataset.paths; none (dataset=jsonl without files) is one message saying what to pass."""
    if (OmegaConf.is_config(dataset) and OmegaConf.is_missing(dataset, "paths")) or not dataset.paths:
        raise ConfigError(
            f"dataset={dataset.name} reads your own JSONL files and none were given: pass them as "
            f"dataset.paths=[/data/a.jsonl,/data/b.jsonl] (conversations in the shared schema)"
        )
    return list(dataset.paths)


def load_dataset(
    dataset: DatasetConfig,
    *,
    require_assistant: bool,
    strict: bool,
    max_conversations: int | None,
    held_out_sets: Mapping[str, Any],
) -> tuple[list[Conversation], int]:
    """The dataset's conversations, capped per file and in total, in file order, and how many had no
    assistant turn to train on (skipped when `require_assistant`; an error when `strict` too).

    `held_out_sets` are evaluation set definitions (eval.set_defs): their prompts are dropped when
    dataset.holdout_eval_sets is on.
    """
    if dataset.max_records_per_file is not None and dataset.max_records_per_file < 1:
        raise ConfigError(
            f"dataset.max_records_per_file={dataset.max_records_per_file}: keep at least 1 record a file, or "
            "set it to null to read every record"
        )
    if max_conversations is not None and max_conversations < 1:
        raise ConfigError(
            f"extract.max_conversations={max_conversations} leaves no conversation: set it to at least 1, or to "
            "null for all"
        )
    conversations: list[Conversation] = []
    seen: dict[str, str] = {}
    no_assistant = 0
    for path in dataset_files(dataset):
        part, stats = load_conversations(
            [path],
            max_records=dataset.max_records_per_file,
            require_assistant=require_assistant,
            strict=strict,
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
    if dataset.holdout_eval_sets:
        conversations, _ = drop_held_out(conversations, eval_set_prompts(held_out_sets))
        if not conversations:
            raise DataError(
                f"every conversation of dataset {dataset.name!r} shares a prompt with an evaluation set, so none "
                "is left to train on; add other data to dataset.paths, or set dataset.holdout_eval_sets=false"
            )
    if max_conversations is not None:
        conversations = conversations[:max_conversations]
    return conversations, no_assistant
