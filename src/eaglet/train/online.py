"""Online training (trainer.features=online): the target's features computed inside each step from token streams.

The frozen target sits beside the head on every device (bf16 on GPUs, as extraction runs it; float32 on CPU),
loaded by the same loader as extraction and captured by the same hooks. Each packed micro-batch goes through it
as it is packed, one row of documents back to back with no padding waste and no mask (varlen flash attention
on CUDA: eaglet.target_model.packed_attention), and its aux and last hidden states, cast to extract.dtype as
the folder's extraction stores them, join the batch that the same TTT and KD code trains on. The target is a plain attribute of
the LightningModule, not a submodule: it is never in a checkpoint, an optimizer or DDP's buckets.

With trainer.online_compile each decoder layer's forward runs through torch.compile: a small target's forward
is mostly element-wise work (norms, RoPE, SiLU, residual adds) between small matmuls, which the compiled graphs
fuse. The capture hooks stay outside the graphs (they wrap the layers' calls, not their forwards).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import get_worker_info

from eaglet.config.schema import EagletConfig, ModelConfig
from eaglet.errors import ConfigError, DataError
from eaglet.fsutil import human_bytes
from eaglet.shards import STORED_DTYPES, Manifest
from eaglet.shards.tokens import TokenReader, token_dir
from eaglet.target_model import (
    LoadedTarget,
    capture_hidden_states,
    head_weights,
    load_target,
    resolve_dtype,
)
from eaglet.target_model.capture import resolve_aux_layer_ids
from eaglet.target_model.footprint import TARGET_MEMORY_SHARE, target_weight_bytes
from eaglet.target_model.packed_attention import packed_forward_kwargs, use_packed_attention, varlen_applies
from eaglet.train.datamodule import PackedShardDataset, ShardDataModule
from eaglet.train.hardware import TrainerPlan
from eaglet.train.packing import collate_tokens

_EXTRACT_TOKENS = (
    "python extract.py extract.features=tokens (with the same model, dataset and extract settings)"
)


def token_store_dir(cfg: EagletConfig) -> Path:
    """The folder online training reads tokens from: the token store, or extract.output_dir when set (a token
    store or a hidden-state shard folder: both hold the token streams)."""
    return token_dir(cfg.paths.data_dir, cfg.model.name, cfg.dataset.name, cfg.extract.output_dir)


class PackedTokenDataset(PackedShardDataset):
    """Map-style dataset whose item for a list of sequence indices is one packed row of token streams
    (`collate_tokens`): the features come later, from the target, inside the training step."""

    def __getitem__(self, indices: Sequence[int]) -> dict[str, Tensor]:
        reader = self._local_reader()
        in_worker = get_worker_info() is not None
        return collate_tokens(
            [reader.sequence(i) for i in indices],
            self.tokens_per_batch,
            pin_memory=self.pin_memory and not in_worker,
            shared=in_worker,
        )


class TokenDataModule(ShardDataModule):
    """ShardDataModule over token streams: the same split, packing, per-rank order and resumable position."""

    def _open_dataset(self) -> PackedShardDataset:
        return PackedTokenDataset(
            TokenReader(self.shard_dir), self.tokens_per_batch, pin_memory=torch.cuda.is_available()
        )


class OnlineTarget:
    """The frozen target and what it computes for a packed micro-batch (`features`)."""

    def __init__(
        self,
        loaded: LoadedTarget,
        aux_layer_ids: Sequence[int],
        head_dim: int,
        feature_dtype: torch.dtype,
        compile: bool = False,
    ):
        use_packed_attention(loaded.model)
        self.loaded = loaded
        self.aux_layer_ids = list(aux_layer_ids)
        self.head_dim = head_dim
        self.feature_dtype = feature_dtype
        self.compiled = False
        if compile:
            self.compile_layers()

    def compile_layers(self) -> None:
        """Run each decoder layer's forward through torch.compile from now on (trainer.online_compile). The
        layers share their code, so they share the compiled graphs: one compilation for every layer and row (the
        document count is a dynamic size from the first row: `packed_forward_kwargs`)."""
        if self.compiled:
            return
        for layer in self.loaded.parts.layers:
            # The instance's forward, not the module: the capture hooks around the call stay eager.
            layer.forward = torch.compile(layer.forward)
        self.compiled = True

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def to(self, device: torch.device) -> OnlineTarget:
        """Move the target to `device` (where the head trains) when it is elsewhere."""
        device = torch.device(device)
        if device != self.loaded.device:
            self.loaded.model.to(device)
            self.loaded.device = device
        return self

    def head_weights(self) -> dict[str, Tensor]:
        """The embedding, final norm and lm_head the head takes from the target (target_head.safetensors')."""
        return head_weights(self.loaded.parts)

    def features(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """`batch` (a `collate_tokens` row, on the target's device) with aux_hidden_states [T, n_aux*H] and
        last_hidden_state [T, H] added, in the stored dtype, as `collate_packed` lays out a shard's."""
        input_ids = batch["input_ids"]
        varlen = varlen_applies(input_ids.device, self.loaded.dtype, self.head_dim)
        boundaries = packed_forward_kwargs(
            batch["cu_seqlens"], input_ids.shape[0], varlen=varlen, compiled=self.compiled
        )
        # The target runs as extraction runs it, in its own dtype: never under the head's autocast.
        with torch.autocast(input_ids.device.type, enabled=False):
            captured = capture_hidden_states(
                self.loaded.model,
                self.loaded.parts,
                input_ids[None],
                None,
                self.aux_layer_ids,
                position_ids=batch["position_ids"][None],
                **boundaries,
            )
        # Copies made outside inference mode: tensors the head's autograd may save for its backward.
        aux = captured.aux_hidden_states[0].flatten(1).to(self.feature_dtype, copy=True)
        last = captured.last_hidden_state[0].to(self.feature_dtype, copy=True)
        return {**batch, "aux_hidden_states": aux, "last_hidden_state": last}


def online_device(plan: TrainerPlan) -> torch.device:
    """The device this process trains on: its local rank's GPU (Lightning's DDP children and SLURM tasks carry
    it in the environment; the launching process is rank 0), else the CPU."""
    if plan.accelerator != "gpu":
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    return torch.device("cuda", int(local_rank))


def check_target_fits(
    model: ModelConfig, device: torch.device, total_memory: int, dtype: torch.dtype
) -> None:
    """Stop before loading when one device cannot hold a replica of the target beside the head."""
    weights = target_weight_bytes(model, torch.empty((), dtype=dtype).element_size())
    if weights <= TARGET_MEMORY_SHARE * total_memory:
        return
    raise ConfigError(_does_not_fit(model, device, weights, total_memory, dtype))


def _does_not_fit(
    model: ModelConfig, device: torch.device, weights: int, total: int, dtype: torch.dtype
) -> str:
    return (
        f"trainer.features=online: the target {model.name} takes about {human_bytes(weights)} in {dtype} and "
        f"{device} has {human_bytes(total)}; online training keeps a whole replica of the target on every device "
        f"beside the head (at most {TARGET_MEMORY_SHARE:.0%} of its memory), and tensor-parallel online training "
        "is not supported. Train from shards instead: python extract.py model=... (extract.backend=vllm spreads "
        "a large target over several GPUs), then python train.py trainer.features=shards"
    )


def check_token_store(model: ModelConfig, manifest: Manifest, directory: Path) -> None:
    """The store's tokens must come from this target's tokenizer and template (dims checked here, before the
    target loads; its hashes in `check_store_target`, after)."""
    t = manifest.target
    checks = [
        ("model.name", model.name, t.get("name")),
        ("model.num_layers", model.num_layers, t.get("num_layers")),
        ("model.hidden_size", model.hidden_size, manifest.hidden_size),
        ("model.vocab_size", model.vocab_size, manifest.vocab_size),
    ]
    for key, want, have in checks:
        if want != have:
            raise DataError(
                f"{directory} holds the tokens of another target: {key}={want} in the config, {have} in its "
                f"manifest; extract tokens for this model ({_EXTRACT_TOKENS}) or point extract.output_dir at "
                "the matching folder"
            )


def check_store_target(loaded: LoadedTarget, manifest: Manifest, directory: Path) -> None:
    """The loaded target must be the one whose tokenizer wrote the store, with the same weights' config."""
    for key, have in (("config_hash", loaded.config_hash), ("tokenizer_hash", loaded.tokenizer_hash)):
        recorded = manifest.target.get(key)
        if recorded != have:
            raise DataError(
                f"{directory} holds the tokens of another target: its manifest records {key} {recorded}, the "
                f"target loaded for online training has {have} (other weights' config or tokenizer); extract "
                f"tokens for this model ({_EXTRACT_TOKENS})"
            )


def load_online_target(
    cfg: EagletConfig, plan: TrainerPlan, manifest: Manifest, directory: Path
) -> OnlineTarget:
    """The frozen target on this process's device, after checking that it fits and that it wrote the store."""
    device = online_device(plan)
    if device.type == "cuda":
        dtype = resolve_dtype(str(cfg.model.dtype), device)
        check_target_fits(cfg.model, device, torch.cuda.get_device_properties(device).total_memory, dtype)
    try:
        loaded = load_target(cfg.model, device=str(device), cache_dir=Path(cfg.paths.cache_dir))
    except torch.cuda.OutOfMemoryError:
        total = torch.cuda.get_device_properties(device).total_memory
        dtype = resolve_dtype(str(cfg.model.dtype), device)
        weights = target_weight_bytes(cfg.model, torch.empty((), dtype=dtype).element_size())
        raise ConfigError(_does_not_fit(cfg.model, device, weights, total, dtype)) from None
    check_store_target(loaded, manifest, directory)
    return OnlineTarget(
        loaded,
        resolve_aux_layer_ids(cfg.model),
        head_dim=cfg.model.head_dim,
        # As the folder's extraction stored (or would have stored) them: extract.dtype when it ran.
        feature_dtype=STORED_DTYPES[manifest.dtype],
        compile=cfg.trainer.online_compile,
    )
