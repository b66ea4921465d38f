"""The checks of bounded-disk runs (extract.max_disk_gb, trainer.features=window), after composition.

The shard count a budget must hold is counted here from the config alone, at extract.shard_tokens tokens a
shard; the stages check it again against the folder's real plan (its shard sizes, the target head).
"""

from __future__ import annotations

from eaglet.config.bounds import at_least, positive
from eaglet.config.choices import ExtractFeatures, TrainFeatures
from eaglet.config.schema import EagletConfig
from eaglet.errors import ConfigError

# Bytes of one element of each stored dtype (eaglet.shards.format.STORED_DTYPES).
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
_DEFAULT_NUM_AUX = 3  # aux_layer_ids null = (2, L//2, L-3)


def shard_gb(cfg: EagletConfig) -> float:
    """GB of one full shard: extract.shard_tokens tokens at (n_aux + 1) x H x itemsize + 5 bytes a token, the
    formula of eaglet.shards.layout.bytes_per_token (config is the ground layer: it cannot import shards)."""
    model = cfg.model
    num_aux = len(model.aux_layer_ids) if model.aux_layer_ids is not None else _DEFAULT_NUM_AUX
    per_token = (num_aux + 1) * model.hidden_size * _ITEMSIZE[str(cfg.extract.dtype)] + 5
    return cfg.extract.shard_tokens * per_token / 1e9


def window_size(cfg: EagletConfig) -> int:
    """The shards trainer.features=window keeps in its rolling window (trainer.window_shards, null = max_epochs)."""
    tr = cfg.trainer
    return tr.max_epochs if tr.window_shards is None else tr.window_shards


def window_shards_needed(cfg: EagletConfig) -> int:
    """The shards a budget must hold for window training: its window, the validation shard (kept to the end)
    and the one extraction writes meanwhile."""
    return window_size(cfg) + (1 if cfg.trainer.val_fraction > 0 else 0) + 1


def check_window(cfg: EagletConfig) -> None:
    ext, tr = cfg.extract, cfg.trainer
    window = tr.features == TrainFeatures.window
    positive("extract", {"max_disk_gb": ext.max_disk_gb, "window_timeout_s": ext.window_timeout_s})
    positive("trainer", {"window_timeout_s": tr.window_timeout_s})
    at_least("trainer", {"window_shards": tr.window_shards}, 1, hint=" (null = trainer.max_epochs)")
    if window and ext.max_disk_gb is None:
        raise ConfigError(
            "trainer.features=window trains while extraction writes shards under a disk bound: set "
            "extract.max_disk_gb=<GB> (as given to python extract.py), or train on a whole extraction with "
            "trainer.features=shards"
        )
    if ext.max_disk_gb is None:
        return
    if ext.features == ExtractFeatures.tokens:
        raise ConfigError(
            f"extract.max_disk_gb={ext.max_disk_gb} bounds hidden-state shards, and extract.features=tokens writes "
            "5 bytes a token: leave extract.max_disk_gb=null for token stores (trainer.features=online), or "
            "extract hidden states (extract.features=hidden_states) for trainer.features=window"
        )
    one = shard_gb(cfg)
    if ext.max_disk_gb < 2 * one:
        raise ConfigError(
            f"extract.max_disk_gb={ext.max_disk_gb} holds fewer than two shards of extract.shard_tokens="
            f"{ext.shard_tokens} tokens ({one:.3g} GB each for model={cfg.model.name} in {ext.dtype}): raise it "
            "or lower extract.shard_tokens"
        )
    if not window:
        return
    if tr.window_shards is not None and tr.window_shards < tr.max_epochs:
        raise ConfigError(
            f"trainer.window_shards={tr.window_shards} is less than trainer.max_epochs={tr.max_epochs}: a shard is "
            "read at most once a round, in the rounds it spends in the window; raise trainer.window_shards or "
            "leave it null (= max_epochs)"
        )
    if tr.max_steps != -1:
        raise ConfigError(
            f"trainer.max_steps={tr.max_steps} with trainer.features=window: the run ends when every shard has been "
            "read trainer.max_epochs times (extraction waits for training to finish with each shard); set "
            "trainer.max_steps=-1"
        )
    if tr.num_workers:
        raise ConfigError(
            f"trainer.num_workers={tr.num_workers} with trainer.features=window: window training builds "
            "micro-batches on threads of the training process (trainer.loader_threads); set trainer.num_workers=0"
        )
    needed = window_shards_needed(cfg)
    if ext.max_disk_gb < needed * one:
        val = " + the validation shard" if tr.val_fraction > 0 else ""
        raise ConfigError(
            f"extract.max_disk_gb={ext.max_disk_gb} holds fewer than the {needed} shards window training needs "
            f"(a window of {window_size(cfg)}{val} + the one being extracted, {one:.3g} GB each): raise "
            f"extract.max_disk_gb to at least {needed * one:.3g} (plus the target head), or lower "
            "trainer.window_shards / trainer.max_epochs or extract.shard_tokens"
        )
