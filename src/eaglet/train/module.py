"""The LightningModule that trains an Eagle3DraftHead with KD + training-time test.

Hyperparameters are primitives only (plain dicts and numbers), so checkpoints load with
`weights_only=True`. The target's final norm and lm_head are non-persistent buffers: they come from the
shard folder's target_head.safetensors (or the target itself, online), not from checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor

from eaglet.config.schema import DraftConfig
from eaglet.errors import ConfigError
from eaglet.model.draft_head import Eagle3DraftHead
from eaglet.train.ttt import TTTOutput, tau_sim, ttt_forward

SCHEDULE_STEPS = "eaglet_schedule_steps"  # the checkpoint's key for DraftHeadModule.schedule_steps


class DraftHeadModule(L.LightningModule):
    # Read by Lightning's ThroughputMonitor (conf/callbacks): no FLOP count here, so no MFU (the planner,
    # eaglet.plan.training, estimates the step's FLOPs).
    flops_per_batch: int | None = None

    def __init__(
        self,
        *,
        draft: dict[str, Any],
        target_hidden_size: int,
        vocab_size: int,
        draft_vocab_size: int,
        num_aux: int,
        target_norm_eps: float,
        ttt_steps: int,
        step_loss_decay: float,
        lr: float,
        weight_decay: float,
        warmup_ratio: float,
        total_steps: int,
        lm_head_trainable: bool,
        mask_outside_draft_vocab: bool,
        feature_noise_std: float,
        loss_chunk_tokens: int,
        attention: str = "auto",
        compile: bool = False,
        full_vocab_train_accuracy: bool = False,
        embed_dtype: str | None = None,
    ) -> None:
        """attention, compile: see `ttt_forward`. full_vocab_train_accuracy: train/acc_k against the teacher's
        full-vocab argmax (costs the [T, V] teacher matmul; validation always uses it), else against its best
        draft-vocab token. embed_dtype: store the frozen embedding table in this dtype ("bfloat16" halves it;
        the target's embeddings come in bf16 anyway); None keeps the parameters' dtype (FSDP needs one dtype).
        """
        super().__init__()
        self.save_hyperparameters()
        self.validated_at_step: int | None = None
        # The LR schedule's length: total_steps unless eaglet.train.time_fit shortens it mid-run (kept in checkpoints).
        self.schedule_steps = total_steps
        self.head = Eagle3DraftHead(
            DraftConfig(**draft),
            target_hidden_size=target_hidden_size,
            vocab_size=vocab_size,
            draft_vocab_size=draft_vocab_size,
            num_aux=num_aux,
        )
        self.register_buffer("target_norm_weight", torch.ones(target_hidden_size), persistent=False)
        self.register_buffer("target_lm_head", torch.zeros(vocab_size, target_hidden_size), persistent=False)
        self._val_sums: dict[str, Tensor] = {}
        self._window_losses: list[Tensor] = []
        self._online_target: Any = None  # see attach_target

    def attach_target(self, target: Any) -> None:
        """Compute each batch's target features with `target` (eaglet.train.online.OnlineTarget) inside the step.

        A plain attribute, not a submodule: the frozen target is never in the state dict, the optimizer or DDP,
        and follows the head to its device on the first step.
        """
        self._online_target = target

    def init_from_target(
        self, head_weights: dict[str, Tensor], d2t: Tensor, t2d: Tensor, *, load_head: bool = True
    ) -> None:
        """Frozen target tensors; with `load_head`, also the head's embedding and lm_head rows."""
        # Kept in the dtype they were stored in (bf16 from GPU extraction): the teacher runs like the target.
        self.target_norm_weight = head_weights["norm.weight"].to(self.target_norm_weight.device)
        self.target_lm_head = head_weights["lm_head.weight"].to(self.target_lm_head.device)
        if load_head:
            self.head.init_from_target(
                head_weights["embed_tokens.weight"],
                head_weights["lm_head.weight"],
                d2t,
                t2d,
                lm_head_trainable=self.hparams.lm_head_trainable,
            )
            if self.hparams.embed_dtype is not None:
                dtype = getattr(torch, self.hparams.embed_dtype, None)
                if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                    raise ConfigError(
                        f"embed_dtype={self.hparams.embed_dtype!r} is not a torch float dtype name"
                    )
                self.head.embed_tokens.weight.data = self.head.embed_tokens.weight.data.to(dtype)

    def _run(self, batch: dict[str, Tensor], *, noise: bool) -> TTTOutput:
        hp = self.hparams
        if self._online_target is not None and "aux_hidden_states" not in batch:  # else the loader ran it
            batch = self._online_target.to(self.device).features(batch)
        if noise and hp.feature_noise_std > 0:
            aux = batch["aux_hidden_states"]
            batch = {**batch, "aux_hidden_states": aux + torch.randn_like(aux) * hp.feature_noise_std}
        return ttt_forward(
            self.head,
            batch,
            target_norm_weight=self.target_norm_weight,
            target_norm_eps=hp.target_norm_eps,
            target_lm_head=self.target_lm_head,
            ttt_steps=hp.ttt_steps,
            step_loss_decay=hp.step_loss_decay,
            mask_outside_draft_vocab=hp.mask_outside_draft_vocab,
            chunk_tokens=hp.loss_chunk_tokens,
            full_vocab_argmax=hp.full_vocab_train_accuracy or not self.training,
            attention=hp.attention,
            compile=hp.compile,
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self._run(batch, noise=True)
        metrics = {"train/loss": out.loss.detach()}
        for k in range(self.hparams.ttt_steps):
            metrics[f"train/loss_{k}"] = out.step_losses[k]
            if out.step_counts[k] > 0:
                metrics[f"train/acc_{k}"] = out.step_correct[k].float() / out.step_counts[k]
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False)
        self.log("train/real_tokens", float(batch["num_real_tokens"]), on_step=True, reduce_fx="sum")
        self._log_global_batch_loss(out.loss.detach(), batch_idx)
        return out.loss

    def _log_global_batch_loss(self, loss: Tensor, batch_idx: int) -> None:
        """train/loss_global: the mean loss over every micro-batch of one optimizer step, on all ranks.

        train/loss is one micro-batch on one rank; this one is the same number whatever the device count and
        accumulation, so loss curves of different hardware configs compare directly.
        """
        self._window_losses.append(loss)
        accumulate = self.trainer.accumulate_grad_batches
        if (batch_idx + 1) % accumulate and batch_idx + 1 != self.trainer.num_training_batches:
            return
        mean = torch.stack(self._window_losses).mean()
        self._window_losses = []
        self.log("train/loss_global", mean, on_step=True, sync_dist=True)

    def on_validation_epoch_start(self) -> None:
        k = self.hparams.ttt_steps
        self._val_sums = {
            name: torch.zeros(k, dtype=torch.float64, device=self.device)
            for name in ("loss", "weight", "correct", "count")
        }

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self._run(batch, noise=False)
        sums = self._val_sums
        sums["loss"] += out.step_losses.double() * out.step_weight_sums.double()
        sums["weight"] += out.step_weight_sums.double()
        sums["correct"] += out.step_correct.double()
        sums["count"] += out.step_counts.double()

    def on_validation_epoch_end(self) -> None:
        if self.trainer.state.fn == "fit":  # the steps whose state the best-checkpoint callback has weighed
            self.validated_at_step = self.global_step
        sums = {
            name: self.all_gather(value).reshape(-1, value.numel()).sum(0)
            for name, value in self._val_sums.items()
        }
        if sums["count"][0] == 0:
            return
        step_loss = sums["loss"] / sums["weight"].clamp(min=1)
        decay = self.hparams.step_loss_decay ** torch.arange(len(step_loss), device=step_loss.device)
        metrics = {"val/loss": (decay * step_loss).sum()}
        for k in range(len(step_loss)):
            metrics[f"val/loss_{k}"] = step_loss[k]
            metrics[f"val/acc_{k}"] = sums["correct"][k] / sums["count"][k] if sums["count"][k] else 0.0
        # Already summed over ranks above: every rank logs the same numbers (sync_dist only silences
        # Lightning's warning; the mean of equal values changes nothing).
        self.log_dict({k: float(v) for k, v in metrics.items()}, prog_bar=False, sync_dist=True)
        self.log("val/tau_sim", tau_sim(sums["correct"], sums["count"]), prog_bar=True, sync_dist=True)

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        if not gradient_clip_val or gradient_clip_algorithm not in (None, "norm"):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        # FSDP holds shards: only the wrapped model can compute the global norm (Lightning's default refuses).
        wrapped = self.trainer.strategy.model
        if hasattr(wrapped, "clip_grad_norm_"):
            wrapped.clip_grad_norm_(gradient_clip_val)
        elif getattr(self.trainer.precision_plugin, "scaler", None) is None:
            # No loss scaling (fp32, bf16): the gradients are true gradients. Lightning refuses to clip for any
            # fused optimizer under mixed precision, as if a scaler were in play.
            torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]],
                                           gradient_clip_val)  # fmt: skip
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[SCHEDULE_STEPS] = self.schedule_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.schedule_steps = checkpoint.get(SCHEDULE_STEPS, self.hparams.total_steps)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.head.parameters() if p.requires_grad]
        # One fused kernel for the whole update (the default launches several per step per tensor group).
        optimizer = torch.optim.AdamW(
            params, lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95), fused=True
        )

        def schedule(step: int) -> float:
            # Linear warmup, then cosine decay to 10% of the peak, both spanning the schedule's current length.
            warmup = max(1, int(hp.warmup_ratio * self.schedule_steps))
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, self.schedule_steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
