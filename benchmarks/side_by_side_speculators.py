"""Side by side: eaglet's draft-head training against the `speculators` package's Eagle3 model, same data.

    python benchmarks/side_by_side_speculators.py                      # embedded default, 96 steps
    python benchmarks/side_by_side_speculators.py steps=96 ttt=3 prompts=5 max_new_tokens=64
    python benchmarks/side_by_side_speculators.py experiments=smollm2_gpu epochs=6 ttt=5 evaluate=0 save=DIR
    python benchmarks/side_by_side_speculators.py shards=DIR model=tiny_llama ...   # other keys: Hydra overrides
    python benchmarks/side_by_side_speculators.py experiments=smollm2_scale steps=611 evaluate=0 save=DIR  # online

Both heads start from the same weights at the model config's draft shape (`draft`, `draft.vocab_size`,
d2t/t2d from the shards' token counts, embeddings and lm_head rows from target_head.safetensors; speculators'
copy is filled from ours through the export's name mapping). lm_head is frozen for both, as speculators
defaults (`trainer.lm_head_trainable=false` is forced). They train for the same optimizer steps on the same
packed micro-batches in the same order (our ShardDataModule's train loader; with
`trainer.features=online` the token store's, each micro-batch's features computed once by the frozen target), with the same AdamW settings,
schedule, gradient accumulation and clipping, K and step-loss decay; feature noise is off for both, and no
position is masked for a teacher argmax outside the draft vocab (speculators does not mask).

- eaglet: `DraftHeadModule._run` (our TTT unroll, tiled SDPA attention, soft cross-entropy).
- speculators 0.9.0: `Eagle3DraftModel.forward` with its own loss. Each micro-batch is split back into its
  documents and re-packed by speculators' own `shift_batch` + `CollateFn`, as its trainer would. Its
  attention is `eager` and its loss `eager` on CPU: its flex attention has no CPU backward and its fused
  loss needs Triton. Its loss is KL, ours soft cross-entropy (KL plus the teacher's entropy). It weights a
  prediction by the loss mask of the token it reads, ours by that of the token it predicts: the same tokens,
  one position apart at the edges of each assistant turn.

Training runs on the hardware config's device (a GPU: bf16 autocast for both, speculators' own flex attention;
CPU: fp32, eager attention for speculators), evaluation on `eval.device`. The trained speculators model is converted into an `Eagle3DraftHead` (the inverse name
mapping), checked against its own forward (logits of every TTT step on one micro-batch), and both heads are
evaluated by real speculative decoding against the target (`evaluate_prompts`), beside n-gram lookup, with
K = trainer.ttt_steps, on the default prompt sets (`prompts` per set, prompts seen in training dropped). The table is printed
and appended to experiments/BENCHMARKS.md.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from importlib.metadata import version
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import CollateFn
from torch import Tensor, nn

import eaglet.config
from eaglet.cli import user_errors
from eaglet.config import check_config
from eaglet.config.choices import TrainFeatures
from eaglet.config.schema import DraftConfig
from eaglet.data.templating import resolve_chat_template
from eaglet.errors import ConfigError, DataError
from eaglet.evaluate import Eagle3Proposer, NgramProposer, evaluate_prompts
from eaglet.evaluate.prompts import load_prompt_set, training_prompts
from eaglet.formats.reader import canonical_name
from eaglet.formats.speculators import VOCAB_BUFFERS, speculators_config, speculators_name
from eaglet.formats.writer import export_eagle
from eaglet.model.attention import document_causal_mask
from eaglet.model.draft_head import Eagle3DraftHead
from eaglet.shards import Manifest, build_vocab_mapping, load_token_counts, read_manifest
from eaglet.shards.layout import TARGET_HEAD_FILE, shard_dir
from eaglet.target_model import load_target
from eaglet.train.datamodule import ShardDataModule
from eaglet.train.hardware import plan_trainer
from eaglet.train.module import DraftHeadModule
from eaglet.train.online import TokenDataModule, check_token_store, load_online_target, token_store_dir
from eaglet.train.run import build_module, check_manifest, optimizer_steps, training_seed
from eaglet.train.ttt import BATCH_KEYS

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
OPTS: dict[str, Any] = {"shards": None, "steps": 96, "epochs": 0, "ttt": None, "prompts": 5, "max_new_tokens": 64,
                        "evaluate": 1, "save": None}  # fmt: skip
# `ttt=K` sets K for both heads (and the evaluation's draft length); left out, the composed trainer.ttt_steps.
# `epochs=N` (N > 0) replaces `steps`: the optimizer steps `python train.py trainer.max_epochs=N` takes on these shards.
# `save=DIR` writes both trained heads in the EAGLE format (DIR/eaglet, DIR/speculators); `evaluate=0` skips the
# evaluation (e.g. train on a GPU machine, evaluate elsewhere with evaluate.py eval.baseline_draft=DIR/speculators).
# speculators' teacher: frozen copies of the target's final norm and draft-vocab lm_head rows. They are not
# part of the draft head (speculators does not save them either).
VERIFIER_TENSORS = ("verifier_lm_head.weight", "verifier_norm.weight")
# Max |logit difference| accepted between speculators' forward and the converted head (fp32, two attention
# implementations): a wrong name or a missing tensor moves logits by far more.
CONVERSION_TOLERANCE = 1e-3
# The conversion is checked on the first tokens of a micro-batch: speculators' eager attention on CPU holds a dense
# [heads, T, K*T] score matrix, beyond any machine's memory for a whole 32K-token micro-batch.
CHECK_TOKENS = 2048
ATTENTION_NOTE = (
    "Attention: eaglet trains with its tiled SDPA (`eaglet.model.attention`) on CPU; speculators "
    "{version} trains its `Eagle3DraftModel` with `eager` attention (dense float masks) and the `eager` KL loss on "
    "CPU (its default flex attention has no CPU backward; its fused loss needs Triton). lm_head frozen for both "
    "(speculators' default). Both heads are evaluated through eaglet's drafter; the converted speculators head "
    "matched its own forward to {diff:.1e} max |Δlogit|."
)


def parse_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The script's options (OPTS keys) and the remaining `key=value` arguments as Hydra overrides."""
    opts, overrides = dict(OPTS), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(
                f"argument {arg!r} is not key=value; e.g. steps=96 or a Hydra override model=..."
            )
        if key not in OPTS:
            overrides.append(arg)
        elif key in ("shards", "save"):
            opts[key] = value
        else:
            try:
                opts[key] = int(value)
            except ValueError:
                raise ConfigError(f"{key}={value!r} must be an integer") from None
            least = 0 if key in ("evaluate", "epochs") else 1
            if opts[key] < least:
                raise ConfigError(f"{key}={value} must be >= {least}")
    return opts, overrides


def compose_config(opts: dict[str, Any], overrides: list[str]) -> DictConfig:
    """The composed config of the entry points, with this comparison's settings applied last (they win)."""
    forced = [
        *([f"trainer.ttt_steps={opts['ttt']}"] if opts["ttt"] is not None else []),
        # epochs: as train.py counts them (a trainer.max_steps override still wins, as there)
        (
            f"trainer.max_epochs={opts['epochs']}"
            if opts["epochs"] > 0
            else f"trainer.max_steps={opts['steps']}"
        ),
        "trainer.lm_head_trainable=false",
        "trainer.mask_outside_draft_vocab=false",  # speculators trains on every loss-masked position
        f"eval.prompts_per_set={opts['prompts']}",
        f"eval.max_new_tokens={opts['max_new_tokens']}",
    ]
    if opts["shards"]:
        forced.append(f"extract.output_dir={Path(opts['shards']).resolve()}")
    try:
        with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
            cfg = hydra.compose("config", overrides=[*overrides, *forced])
    finally:
        GlobalHydra.instance().clear()
    check_config(cfg)
    cfg.eval.num_spec_tokens = (
        cfg.trainer.ttt_steps
    )  # the heads draft as many tokens as they were unrolled for
    return cfg


def build_speculators(
    module: DraftHeadModule, cfg: DictConfig, aux_layer_ids: list[int], device: torch.device
) -> Eagle3DraftModel:
    """speculators' model from the config our speculators export writes, our weights copied in: its own flex
    attention on GPUs, eager attention on CPU (its flex attention has no CPU backward)."""
    head = module.head
    config = speculators_config(
        head,
        draft_config(cfg),
        aux_layer_ids=aux_layer_ids,
        target_architecture="LlamaForCausalLM",
        ttt_steps=cfg.trainer.ttt_steps,
        verifier_name_or_path=None,
        dtype=torch.float32,
    )
    spec_config = Eagle3SpeculatorConfig(**config)
    spec_config.transformer_layer_config._attn_implementation = (
        "simple_flex_attention" if device.type == "cuda" else "eager"
    )
    model = Eagle3DraftModel(spec_config)
    state = {speculators_name(name): t.detach().clone() for name, t in head.state_dict().items()}
    if not model.use_draft_vocab:  # V_d == V: speculators registers no vocab buffers
        for name in VOCAB_BUFFERS:
            state.pop(name)
    state["verifier_lm_head.weight"] = module.target_lm_head[head.draft_target_ids].float()
    state["verifier_norm.weight"] = module.target_norm_weight.float()
    model.load_state_dict(state, strict=True)
    # Its teacher norm takes the draft layer's eps; speculators' own trainer builds it from the target's config.
    model.verifier_norm.variance_epsilon = cfg.model.rms_norm_eps
    return model


def draft_config(cfg: DictConfig) -> DraftConfig:
    return DraftConfig(**OmegaConf.to_container(cfg.draft, resolve=True))


def to_eaglet_head(
    model: Eagle3DraftModel, cfg: DictConfig, manifest: Manifest, aux_layer_ids: list[int]
) -> Eagle3DraftHead:
    """An Eagle3DraftHead holding speculators' weights (`layers.0.` back to `midlayer.`), in eval mode."""
    head = Eagle3DraftHead(
        draft_config(cfg),
        target_hidden_size=manifest.hidden_size,
        vocab_size=manifest.vocab_size,
        draft_vocab_size=cfg.draft.vocab_size,
        num_aux=len(aux_layer_ids),
    )
    state = {
        canonical_name(name): t.detach().clone()
        for name, t in model.state_dict().items()
        if name not in VERIFIER_TENSORS
    }
    unknown = sorted(set(state) - set(head.state_dict()))
    if unknown:
        raise DataError(f"speculators' model holds tensors with no place in the draft head: {unknown}")
    # With V_d == V speculators keeps no d2t/t2d: the head's own identity mapping stays.
    head.load_state_dict({**head.state_dict(), **state}, strict=True)
    return head.eval().requires_grad_(False)


def batch_prefix(batch: dict[str, Tensor], tokens: int) -> dict[str, Tensor]:
    """A packed micro-batch's first `tokens` real tokens, padding dropped: whole documents and perhaps the start
    of one more (left out when that start is a single token, which speculators' shift would leave empty)."""
    real = int(batch["num_real_tokens"])
    docs = batch["document_ids"]
    keep = min(real, tokens)
    cut_inside = keep < real and docs[keep] == docs[keep - 1]
    if cut_inside and keep > 1 and docs[keep - 1] != docs[keep - 2]:
        keep -= 1
    return {**{k: batch[k][:keep] for k in BATCH_KEYS}, "num_real_tokens": torch.tensor(keep)}


def speculators_batch(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our packed row split into its documents and re-packed by speculators' own shift_batch + CollateFn.

    Per document speculators drops one token (input x_{t+1} beside features g_t and teacher state y_{t+1});
    padding gets document id -1, as its trainer feeds the model.
    """
    real = int(batch["num_real_tokens"])
    _, lengths = torch.unique_consecutive(batch["document_ids"][:real], return_counts=True)
    samples, begin = [], 0
    for length in lengths.tolist():
        end = begin + length
        samples.append(
            {
                "hidden_states": batch["aux_hidden_states"][begin:end],
                "input_ids": batch["input_ids"][begin:end],
                "verifier_last_hidden_states": batch["last_hidden_state"][begin:end],
                "loss_mask": batch["loss_mask"][begin:end],
                "lengths": torch.tensor([length]),
                "position_ids": torch.arange(length),
            }
        )
        begin = end
    tokens, hidden = batch["input_ids"].numel(), batch["last_hidden_state"].shape[-1]
    num_aux = batch["aux_hidden_states"].shape[-1] // hidden
    collate = CollateFn(tokens, hidden, num_aux, dtype=torch.float32, preprocess=shift_batch)
    keys = (
        "hidden_states",
        "input_ids",
        "document_ids",
        "loss_mask",
        "position_ids",
        "verifier_last_hidden_states",
    )
    return {key: value for key, value in collate(samples).items() if key in keys}


@torch.no_grad()
def speculators_step_logits(model: Eagle3DraftModel, row: dict[str, Tensor], ttt: int) -> list[Tensor]:
    """Logits [S, V_d] of every TTT step of speculators' own forward on one of its rows (lm_head's outputs).

    Run eagerly: speculators compiles its forward whenever CUDA is present, so on a GPU machine this check on
    the CPU would go through inductor's C++ path (which failed there to compile its kernels) for one forward."""
    captured: list[Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    try:
        with torch.compiler.set_stance("force_eager"):
            model(
                hidden_states=row["hidden_states"],
                input_ids=row["input_ids"],
                document_ids=row["document_ids"],
                position_ids=row["position_ids"],
                ttt_steps=ttt,
            )
    finally:
        handle.remove()
    return captured


@torch.no_grad()
def eaglet_step_logits(head: Eagle3DraftHead, row: dict[str, Tensor], ttt: int) -> list[Tensor]:
    """The same unroll with our head's modules: step k reads the input ids shifted by k (0-filled, as
    speculators does), the previous step's hidden, RoPE positions + k, step-0 context keys and the diagonal."""
    ids, positions = row["input_ids"][0], row["position_ids"][0]
    mask = document_causal_mask(row["document_ids"][0])
    hidden = head.fuse(row["hidden_states"][0])
    context_kv, diagonal_kv, logits = None, [], []
    for k in range(ttt):
        shifted = torch.cat([ids[k:], ids.new_zeros(k)])
        hidden, kv = head.decoder_step(
            head.embed_tokens(shifted), hidden, positions + k, mask, context_kv, diagonal_kv
        )
        if context_kv is None:
            context_kv = kv
        else:
            diagonal_kv.append(kv)
        logits.append(head.logits(hidden))
    return logits


def logit_difference(
    model: Eagle3DraftModel, head: Eagle3DraftHead, row: dict[str, Tensor], ttt: int
) -> float:
    """Max |logit difference| between the two, over the real (non-padding) positions of every TTT step."""
    real = row["document_ids"][0] >= 0
    pairs = zip(speculators_step_logits(model, row, ttt), eaglet_step_logits(head, row, ttt), strict=True)
    return max(float((theirs[real] - ours[real]).abs().max()) for theirs, ours in pairs)


@dataclass
class Side:
    """One contender's training loop state: its loss on a micro-batch, optimizer, schedule, clock."""

    name: str
    loss_fn: Callable[[dict[str, Tensor]], Tensor]
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)  # per optimizer step, mean over its micro-batches
    _pending: list[float] = field(default_factory=list)

    def accumulate(self, batch: dict[str, Tensor], accumulate: int) -> None:
        start = time.perf_counter()
        device = self.params[0].device
        # bf16 autocast on GPUs, as Lightning's bf16-mixed precision trains ours.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = self.loss_fn(batch)
        # Lightning's accumulation: each micro-batch's loss scaled by 1/accumulate.
        (loss / accumulate).backward()
        _synchronize(device)
        self.seconds += time.perf_counter() - start
        self._pending.append(float(loss.detach()))

    def step(self, grad_clip: float) -> None:
        start = time.perf_counter()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        _synchronize(self.params[0].device)
        self.seconds += time.perf_counter() - start
        self.losses.append(sum(self._pending) / len(self._pending))
        self._pending.clear()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # wall time of the work itself, not of its launch
        torch.cuda.synchronize(device)


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def make_sides(module: DraftHeadModule, model: Eagle3DraftModel, cfg: DictConfig) -> list[Side]:
    """Our module's optimizer and schedule, and speculators' with the same settings and the same lr function."""
    ours = module.configure_optimizers()
    optimizer, scheduler = ours["optimizer"], ours["lr_scheduler"]["scheduler"]
    params = [p for p in model.parameters() if p.requires_grad]
    settings = {key: optimizer.defaults[key] for key in ("lr", "betas", "eps", "weight_decay")}
    their_optimizer = torch.optim.AdamW(params, **settings)
    their_scheduler = torch.optim.lr_scheduler.LambdaLR(their_optimizer, scheduler.lr_lambdas[0])
    loss_config = resolve_loss_config("kl_div", "eager")
    tr = cfg.trainer

    def their_loss(batch: dict[str, Tensor]) -> Tensor:
        _, loss, _ = model(
            **to_device(speculators_batch(batch), module.device),
            ttt_steps=tr.ttt_steps,
            ttt_step_loss_decay=tr.step_loss_decay,
            loss_config=loss_config,
        )
        return loss

    return [
        Side(
            "eaglet",
            lambda batch: module._run(to_device(batch, module.device), noise=False).loss,
            [p for p in module.head.parameters() if p.requires_grad],
            optimizer,
            scheduler,
        ),
        Side("speculators", their_loss, params, their_optimizer, their_scheduler),
    ]


def micro_batches(datamodule: ShardDataModule) -> Iterator[dict[str, Tensor]]:
    """The train loader's micro-batches, epoch after epoch, as Lightning's fit loop draws them."""
    loader = datamodule.train_dataloader()
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train_both(
    sides: list[Side],
    datamodule: ShardDataModule,
    steps: int,
    accumulate: int,
    grad_clip: float,
    features: Callable[[dict[str, Tensor]], dict[str, Tensor]] = lambda batch: batch,
) -> None:
    """`steps` optimizer steps per side, each over the same `accumulate` micro-batches, interleaved batch by batch
    (a load change on the machine hits both alike). `features` adds the target's features to a micro-batch of
    token streams (online), once for both sides."""
    batches = map(features, micro_batches(datamodule))
    report_every = max(1, steps // 12)
    for step in range(steps):
        for _ in range(accumulate):
            batch = next(batches)
            for side in sides:
                side.accumulate(batch, accumulate)
        for side in sides:
            side.step(grad_clip)
        if (step + 1) % report_every == 0 or step + 1 == steps:
            status = ", ".join(f"{s.name} loss {s.losses[-1]:.3f} ({s.seconds:.0f} s)" for s in sides)
            print(f"step {step + 1}/{steps}: {status}", flush=True)


def evaluate_heads(
    cfg: DictConfig, heads: dict[str, Eagle3DraftHead], aux_layer_ids: list[int]
) -> dict[str, dict[str, Any]]:
    """Per eval set: its prompt count, overlap dropped, and evaluate_prompts' results for each head and n-gram."""
    ev = cfg.eval
    target = load_target(cfg.model, device=ev.device, cache_dir=Path(cfg.paths.cache_dir))
    template = resolve_chat_template(target.tokenizer, cfg.model.chat_template)
    proposers = {name: Eagle3Proposer(head.to(target.device), aux_layer_ids) for name, head in heads.items()}
    proposers["ngram"] = NgramProposer(min_n=ev.ngram_min_n, max_n=ev.ngram_max_n)
    seen = training_prompts(cfg)
    sets = {}
    for name in ev.sets:
        prompts, overlap = load_prompt_set(cfg, name, target.tokenizer, template, seen)
        results = evaluate_prompts(
            target,
            proposers,
            prompts,
            num_spec_tokens=ev.num_spec_tokens,
            max_new_tokens=ev.max_new_tokens,
            stop_ids={target.tokenizer.eos_token_id},
            tie_tolerance=ev.tie_tolerance,
        )
        sets[name] = {"prompts": len(prompts), "overlap_dropped": overlap, "results": results}
    return sets


def run(opts: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Build, train, convert, check and evaluate; returns {"sets", "training", "conversion_diff", ...}."""
    cfg = compose_config(opts, overrides)
    tr = cfg.trainer
    online = tr.features == TrainFeatures.online
    if online:
        shards = token_store_dir(cfg)
    else:
        shards = shard_dir(cfg.paths.data_dir, cfg.model.name, cfg.dataset.name, cfg.extract.output_dir)
    manifest = read_manifest(shards)
    if not manifest.complete:
        raise DataError(f"{shards}: extraction is not complete; re-run `python extract.py` (it resumes)")
    (check_token_store if online else check_manifest)(cfg.model, manifest, shards)
    plan = plan_trainer(cfg.hardware, tr)
    if plan.world_size != 1:
        raise ConfigError(
            f"this comparison runs in one process; hardware={cfg.hardware.name} plans {plan.world_size} devices; run it on one (hardware=cpu hardware.devices=1)"
        )
    d2t, t2d = build_vocab_mapping(load_token_counts(shards), cfg.draft.vocab_size)
    # Online (trainer.features=online): the frozen target computes each micro-batch's features, once for both.
    target = load_online_target(cfg, plan, manifest, shards) if online else None
    aux_layer_ids = target.aux_layer_ids if target is not None else manifest.aux_layer_ids
    datamodule = (TokenDataModule if online else ShardDataModule)(
        shards,
        plan.tokens_per_device,
        tr.val_fraction,
        cfg.seed,
        num_workers=0,
        check_finite=True,
        train_fraction=tr.train_fraction,
        order_seed=training_seed(cfg),
    )
    datamodule.setup()
    steps = optimizer_steps(tr, datamodule, plan)

    torch.manual_seed(training_seed(cfg))  # as train.py seeds the head
    module = build_module(
        cfg.draft,
        tr,
        manifest,
        target_norm_eps=cfg.model.rms_norm_eps,
        total_steps=steps,
        num_aux=len(aux_layer_ids),
    )
    head_weights = target.head_weights() if target is not None else load_file(shards / TARGET_HEAD_FILE)
    module.init_from_target(head_weights, d2t, t2d)
    device = torch.device(
        "cuda" if cfg.hardware.accelerator == "gpu" and torch.cuda.is_available() else "cpu"
    )

    def features(batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return batch if target is None else target.to(device).features(to_device(batch, device))

    model = build_speculators(module, cfg, aux_layer_ids, device).to(device)
    module.to(device)
    module.train()
    model.train()
    sides = make_sides(module, model, cfg)
    train_both(sides, datamodule, steps, plan.accumulate_grad_batches, tr.grad_clip, features)
    check_batch = batch_prefix(
        to_device(features(next(micro_batches(datamodule))), torch.device("cpu")), CHECK_TOKENS
    )

    module.float().cpu()
    if (
        device.type == "cuda"
    ):  # the conversion is checked in fp32 on CPU, with eager attention, as on the CPU path
        trained = {k: v.float().cpu() for k, v in model.state_dict().items()}
        model = build_speculators(module, cfg, aux_layer_ids, torch.device("cpu"))
        model.load_state_dict(trained)
    model.eval()

    def save(name: str, head: Eagle3DraftHead) -> None:
        if opts["save"]:
            folder = Path(opts["save"]) / name
            export_eagle(head, draft_config(cfg), folder, aux_layer_ids=aux_layer_ids, overwrite=True)

    # Our head is kept before the conversion check, which only speaks for the speculators side.
    heads = {"eaglet": module.head.eval().requires_grad_(False)}
    save("eaglet", heads["eaglet"])
    converted = to_eaglet_head(model, cfg, manifest, aux_layer_ids)
    check_row = speculators_batch(check_batch)
    diff = logit_difference(model, converted, check_row, tr.ttt_steps)
    if not diff <= CONVERSION_TOLERANCE:
        raise DataError(
            f"the converted speculators head differs from speculators' own forward by {diff:.3g} max |logit| "
            f"(> {CONVERSION_TOLERANCE}); the name mapping or the layer semantics diverged"
        )
    heads["speculators"] = converted
    save("speculators", converted)
    return {
        "sets": evaluate_heads(cfg, heads, aux_layer_ids) if opts["evaluate"] else {},
        "training": {
            s.name: {"steps": len(s.losses), "seconds": s.seconds, "losses": s.losses} for s in sides
        },
        "micro_batches": steps * plan.accumulate_grad_batches,
        "tokens_per_batch": plan.tokens_per_device,
        "conversion_diff": diff,
        "ttt": tr.ttt_steps,
    }


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def format_table(results: dict[str, Any]) -> str:
    """One markdown table: a row per eval set and proposer, training steps and wall time on the heads' rows."""
    k = results["ttt"]
    header = ["date", "machine", "set", "prompts", "proposer", "τ", "τ 95% CI over prompts"]
    header += [f"acc@{i + 1}" for i in range(k)]
    header += ["train steps", "train s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for set_name, entry in results["sets"].items():
        for proposer, r in entry["results"].items():
            trained = results["training"].get(proposer)
            steps, seconds = (str(trained["steps"]), f"{trained['seconds']:.1f}") if trained else ("—", "—")
            row = [str(date.today()), machine(), set_name, str(entry["prompts"]), proposer, f"{r['tau']:.2f}"]
            row.append("{:.2f}-{:.2f}".format(*r["tau_ci95"]) if "tau_ci95" in r else "—")
            row += [f"{rate:.2f}" for rate in r["acceptance_rates"]] + [steps, seconds]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def attention_note(results: dict[str, Any]) -> str:
    return ATTENTION_NOTE.format(version=version("speculators"), diff=results["conversion_diff"])


def append_benchmark(results: dict[str, Any], command: str, table: str) -> None:
    training = ", ".join(
        f"{name} {t['seconds']:.0f} s (loss {t['losses'][0]:.3f} → {t['losses'][-1]:.3f})"
        for name, t in results["training"].items()
    )
    with open(BENCH_FILE, "a") as fh:
        fh.write(
            f"\n### Side by side with speculators — `{command}`\n\n{table}\n\n"
            f"Training: {results['micro_batches']} micro-batches of {results['tokens_per_batch']:,} tokens, same "
            f"order, {training}; eaglet's loss is soft cross-entropy, speculators' KL (they differ by the "
            f"teacher's entropy).\n{attention_note(results)}\n"
        )


def main(argv: list[str]) -> dict[str, Any]:
    opts, overrides = parse_args(argv)
    results = run(opts, overrides)
    if not opts["evaluate"]:  # trained (and saved) only: nothing to tabulate
        for name, t in results["training"].items():
            print(
                f"{name}: {t['steps']} steps in {t['seconds']:.0f} s, loss {t['losses'][0]:.3f} → {t['losses'][-1]:.3f}"
            )
        return results
    table = format_table(results)
    print(f"\n{table}\n\n{attention_note(results)}")
    append_benchmark(results, " ".join(["python benchmarks/side_by_side_speculators.py", *argv]), table)
    return results


if __name__ == "__main__":
    user_errors(main)(sys.argv[1:])
