"""The extraction stage's slice of the config: the target, the dataset, the stage's settings and its folders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.config.choices import ExtractFeatures
from eaglet.config.schema import DatasetConfig, ExtractConfig, ModelConfig
from eaglet.data.conversations import Conversation
from eaglet.data.dataset import load_dataset
from eaglet.shards import shard_dir
from eaglet.shards.tokens import token_dir


@dataclass(frozen=True)
class ExtractionJob:
    model: ModelConfig
    dataset: DatasetConfig
    extract: ExtractConfig
    # Derived data (regenerated answers, shards) goes under data_dir; model weights are cached in cache_dir.
    data_dir: Path
    cache_dir: Path
    # Evaluation set definitions whose prompts stay out of the data (with dataset.holdout_eval_sets on).
    held_out_sets: Mapping[str, Any]
    # The run's seed: sampled regeneration is seeded from it.
    seed: int = 0

    @property
    def out_dir(self) -> Path:
        """The shard folder this extraction writes (the token store with extract.features=tokens)."""
        where = token_dir if self.extract.features == ExtractFeatures.tokens else shard_dir
        return where(self.data_dir, self.model.name, self.dataset.name, self.extract.output_dir)

    def load_conversations(self) -> tuple[list[Conversation], int]:
        """The dataset's conversations and how many had no assistant turn (see load_dataset)."""
        return load_dataset(
            self.dataset,
            # Regeneration writes the answers: prompts alone are enough.
            require_assistant=not self.extract.regenerate.enabled,
            strict=self.extract.strict,
            max_conversations=self.extract.max_conversations,
            held_out_sets=self.held_out_sets,
        )
