"""Side by side on one GPU: eaglet's draft-head training step against the speculators package's Eagle3 model.

    python benchmarks/bench_gpu_side_by_side.py                     # H200: Llama-3.1-8B and Kimi-K2.5 shapes, K=3,7
    python benchmarks/bench_gpu_side_by_side.py --shapes kimi_k2_5 --ttt 3 --variants speculators,eaglet_compiled
    python benchmarks/bench_gpu_side_by_side.py --smoke             # tiny shapes on CPU: the script works end to end

In one process, for each shape (bench_train.py SHAPES, draft vocab 32000) and K, the same packed micro-batches
(8192 tokens: four 2048-token documents, the first 30-50% of each a prompt with loss mask 0, random ids,
features and teacher states, copied to the device before each step) go through forward + backward + AdamW step of
- speculators: `Eagle3DraftModel` built from an `Eagle3SpeculatorConfig` at the shape (the config our
  speculators export writes), random weights, its defaults on CUDA (forward under torch.compile, flex
  attention), its eager KL loss (its fused Triton loss failed under torch.compile on torch 2.11), lm_head
  frozen as it defaults;
- eaglet: `DraftHeadModule._run` (block-sparse flex attention, positions without weight skipped, teacher over
  the draft vocab, chunked loss), with the layer eager or compiled (`compile=True`), lm_head frozen or
  trainable, the frozen embedding table in bf16 (`embed_dtype`).
Both keep fp32 master weights under bf16 autocast, AdamW over the trainable parameters, no gradient clipping.
A row gives tokens/s over the timed steps (after warmup steps, which include compilation), the ratio to
speculators, the peak allocated memory over the steps (weights and optimizer state included) and its ratio, and
MFU = model FLOPs per token (bench_train.model_flops_per_token, the same for both) x tokens/s / the measured bf16
matmul rate. A variant that fails prints its error in its row; the run goes on. Rows are appended to
experiments/BENCHMARKS.md.

--check (default on CUDA) first runs eaglet's GPU paths on a small row against the float64 CPU path (loss and
gradients, bf16 tolerances). --data measures the data path at --data-shape: shards written to local disk and
read back through the page cache by the ShardDataModule's train loader alone (bench_loader.py; each
--data-loaders setting: threads=N background threads, workers=N worker processes), then training of the fastest
eaglet variant fed by the loader (each --data-train-loaders setting); both as tokens/s and as a ratio to that
variant's training rate on batches already in memory.
"""

from __future__ import annotations

import argparse
import gc
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import data_module, loader_rate, parse_loader, warm_page_cache, write_feature_shards  # noqa: E402
from bench_train import SHAPES, matmul_rate, model_flops_per_token  # noqa: E402

from eaglet.config.schema import DraftConfig  # noqa: E402
from eaglet.formats.speculators import speculators_config  # noqa: E402
from eaglet.model.draft_head import Eagle3DraftHead  # noqa: E402
from eaglet.train.module import DraftHeadModule  # noqa: E402
from eaglet.train.ttt import ttt_forward  # noqa: E402

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
GIB = 2**30
DATA_HEADER = (
    "| shape | source | loader | tokens/s, epoch 1 | tokens/s, epochs 2+ | epoch 1 vs training rate "
    "| epochs 2+ vs training rate |\n|---|---|---|---|---|---|---|"
)


@dataclass(frozen=True)
class Variant:
    impl: str  # "speculators" | "eaglet"
    compile: bool = False
    trainable: bool = False
    attention: str = "auto"


VARIANTS = {
    "speculators": Variant("speculators"),
    "eaglet": Variant("eaglet"),
    "eaglet_compiled": Variant("eaglet", compile=True),
    "eaglet_compiled_trainable": Variant("eaglet", compile=True, trainable=True),
    "eaglet_trainable": Variant("eaglet", trainable=True),
    "eaglet_sdpa": Variant("eaglet", attention="sdpa"),  # the previous path: masked SDPA over the whole row
}
DEFAULT_VARIANTS = "speculators,eaglet,eaglet_compiled,eaglet_compiled_trainable,eaglet_sdpa"
SMOKE = {
    "shapes": "tiny", "ttt": "2", "variants": "speculators,eaglet,eaglet_trainable", "draft_vocab": 256,
    "batch_tokens": 512, "doc_tokens": 128, "batches": 2, "warmup": 1, "steps": 2, "loss_chunk_tokens": 256,
    "data_shape": "tiny", "data_docs": 8, "data_loaders": "threads=0,threads=2,workers=2",
    "data_train_loaders": "threads=2",
}  # fmt: skip


@dataclass
class Row:
    shape: str
    ttt: int
    variant: str
    tps: float = float("nan")
    peak_gib: float = float("nan")
    warmup_s: float = float("nan")
    error: str = ""


# ------------------------------------------------------------------ data


def make_batches(
    shape: tuple, opts: argparse.Namespace, device: torch.device, seed: int
) -> list[dict[str, Tensor]]:
    """Packed micro-batches on the host (pinned on CUDA): documents of doc_tokens, a 30-50% prompt each."""
    hidden, *_, vocab = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    t, n = opts.batch_tokens, opts.doc_tokens
    batches = []
    for _ in range(opts.batches):
        prompts = torch.randint(int(0.3 * n), int(0.5 * n) + 1, (t // n,), generator=gen, device=device)
        ramp = torch.arange(n, device=device)
        batch = {
            "input_ids": torch.randint(0, vocab, (t,), generator=gen, device=device),
            "loss_mask": (ramp[None, :] >= prompts[:, None]).reshape(-1),
            "document_ids": torch.arange(t // n, device=device).repeat_interleave(n),
            "position_ids": ramp.repeat(t // n),
            "aux_hidden_states": torch.randn(
                t, 3 * hidden, generator=gen, device=device, dtype=torch.bfloat16
            ),
            "last_hidden_state": torch.randn(t, hidden, generator=gen, device=device, dtype=torch.bfloat16),
        }
        batches.append({k: v.cpu().pin_memory() if device.type == "cuda" else v for k, v in batch.items()})
    return batches


def make_target(shape: tuple, draft_vocab: int, device: torch.device) -> dict[str, Tensor]:
    """A random target head (bf16, on the host) and a draft vocab: sorted random target ids."""
    hidden, *_, vocab = shape
    gen = torch.Generator(device=device).manual_seed(1)
    used = torch.randperm(vocab, generator=gen, device=device)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool, device=device)
    t2d[used] = True

    def weight(scale: float) -> Tensor:
        return (torch.randn(vocab, hidden, generator=gen, device=device, dtype=torch.bfloat16) * scale).cpu()

    return {
        "embed_tokens.weight": weight(1.0),
        "lm_head.weight": weight(hidden**-0.5),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "d2t": (used - torch.arange(draft_vocab, device=device)).cpu(),
        "t2d": t2d.cpu(),
    }


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ------------------------------------------------------------------ the two implementations


def draft_config(shape: tuple) -> dict[str, Any]:
    hidden, heads, kv, head_dim, inter, _ = shape
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "rms_norm_eps": 1e-5,
    }


def build_eaglet(
    shape: tuple, ttt: int, variant: Variant, target: dict, opts, device
) -> tuple[Callable, Any]:
    hidden, *_, vocab = shape
    with torch.device(device):
        module = DraftHeadModule(
            draft=draft_config(shape), target_hidden_size=hidden, vocab_size=vocab,
            draft_vocab_size=opts.draft_vocab, num_aux=3, target_norm_eps=1e-5, ttt_steps=ttt, step_loss_decay=1.0,
            lr=1e-4, weight_decay=0.0, warmup_ratio=0.0, total_steps=100, lm_head_trainable=variant.trainable,
            mask_outside_draft_vocab=False, feature_noise_std=0.0, loss_chunk_tokens=opts.loss_chunk_tokens,
            attention=variant.attention, compile=variant.compile, embed_dtype=opts.embed_dtype,
        )  # fmt: skip
    module.init_from_target(target, target["d2t"], target["t2d"])
    module.train()
    optimizer = module.configure_optimizers()["optimizer"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(batch: dict[str, Tensor]) -> Tensor:
        with autocast:
            loss = module._run(batch, noise=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, (module, optimizer)


def build_speculators(shape: tuple, ttt: int, target: dict, opts, device) -> tuple[Callable, Any]:
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    hidden, *_, vocab = shape
    cfg = DraftConfig(**draft_config(shape))
    with torch.device("meta"):  # only its shapes are read
        head = Eagle3DraftHead(
            cfg, target_hidden_size=hidden, vocab_size=vocab, draft_vocab_size=opts.draft_vocab
        )
    config = Eagle3SpeculatorConfig(
        **speculators_config(
            head, cfg, aux_layer_ids=[2, 3, 4], target_architecture="LlamaForCausalLM", ttt_steps=ttt,
            verifier_name_or_path=None, dtype=torch.float32,
        )
    )  # fmt: skip
    if device.type != "cuda":  # its flex attention has no CPU backward
        config.transformer_layer_config._attn_implementation = "eager"
    with torch.device(device):
        model = Eagle3DraftModel(config)
    model.load_vocab_mappings(target["t2d"].to(device), target["d2t"].to(device))
    draft_rows = torch.arange(opts.draft_vocab) + target["d2t"]
    with torch.no_grad():  # it initialises these to NaN until verifier weights are loaded
        model.embed_tokens.weight.copy_(target["embed_tokens.weight"])
        model.lm_head.weight.copy_(target["lm_head.weight"][draft_rows])
        model.verifier_lm_head.weight.copy_(target["lm_head.weight"][draft_rows])
    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95)
    )
    loss_config = resolve_loss_config("kl_div", "eager")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    features = torch.bfloat16 if device.type == "cuda" else torch.float32  # no autocast on CPU: its dtype

    def step(batch: dict[str, Tensor]) -> Tensor:
        with autocast:
            _, loss, _ = model(
                hidden_states=batch["aux_hidden_states"][None].to(features),
                input_ids=batch["input_ids"][None],
                document_ids=batch["document_ids"][None],
                loss_mask=batch["loss_mask"][None],
                position_ids=batch["position_ids"][None],
                verifier_last_hidden_states=batch["last_hidden_state"][None].to(features),
                ttt_steps=ttt,
                ttt_step_loss_decay=1.0,
                loss_config=loss_config,
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, (model, optimizer)


# ------------------------------------------------------------------ timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return (text[0] if text else type(error).__name__)[:160].replace("|", "/")


def time_steps(
    step: Callable, batches: list, opts, device: torch.device, baseline: int
) -> tuple[float, float, float]:
    """(tokens/s over the timed steps, peak GiB over all steps above `baseline` bytes, seconds of the warmup steps)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(opts.warmup + opts.steps):
        batch = to_device(batches[i % len(batches)], device)
        sync(device)
        start = time.perf_counter()
        loss = step(batch)
        sync(device)
        times.append(time.perf_counter() - start)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss {float(loss)} at step {i}")
        del batch, loss
    timed = times[opts.warmup :]
    peak = (torch.cuda.max_memory_allocated() - baseline) / GIB if device.type == "cuda" else float("nan")
    return opts.steps * opts.batch_tokens / sum(timed), peak, sum(times[: opts.warmup])


def print_profile(title: str, step: Callable, batches: list, opts, device: torch.device) -> None:
    """`opts.profile` more steps under torch.profiler: the kernels that took the most device time, per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(opts.profile):
            step(to_device(batches[i % len(batches)], device))
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))
    total = sum(getattr(e, key) for e in events) or 1.0
    print(
        f"\nprofile {title}: {total / 1e3 / opts.profile:.1f} ms of kernels per step; top {opts.profile_rows}"
    )
    for e in events[: opts.profile_rows]:
        t = getattr(e, key)
        print(
            f"  {t / 1e3 / opts.profile:8.2f} ms {100 * t / total:5.1f}% x{e.count // opts.profile:<4} {e.key[:110]}"
        )


def run_row(name: str, shape_name: str, ttt: int, batches, target, opts, device) -> Row:
    """Build, warm up and time one variant; its memory is released before returning, whatever happened."""
    row = Row(shape_name, ttt, name)
    variant = VARIANTS[name]
    step = state = None
    # Whatever earlier rows left allocated (compiled-code caches, say) is not this row's: peaks are above it.
    baseline = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    try:
        if variant.impl == "speculators":
            step, state = build_speculators(SHAPES[shape_name], ttt, target, opts, device)
        else:
            step, state = build_eaglet(SHAPES[shape_name], ttt, variant, target, opts, device)
        row.tps, row.peak_gib, row.warmup_s = time_steps(step, batches, opts, device, baseline)
        if opts.profile:
            print_profile(f"{shape_name} K={ttt} {name}", step, batches, opts, device)
    except Exception as error:  # one failing variant must not stop the others
        row.error = first_line(error)
        if opts.verbose:
            traceback.print_exc()
        if device.type == "cuda":
            torch._dynamo.reset()  # a failed compilation may leave state behind
    finally:
        del step, state
        free(device)
    if baseline > GIB:
        print(f"note: {baseline / GIB:.1f} GiB were still allocated before {name} (not counted in its peak)")
    return row


# ------------------------------------------------------------------ correctness on the device


def check_paths(device: torch.device, opts) -> list[str]:
    """eaglet's device paths on a small row against the float64 CPU path (itself tested against a naive reference)."""
    h, v, vd, t = 64, 512, 128, 1024
    cfg = DraftConfig(
        hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96
    )
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ref = Eagle3DraftHead(cfg, target_hidden_size=h, vocab_size=v, draft_vocab_size=vd).double()
    used = torch.randperm(v, generator=gen)[:vd].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[used] = True
    lm_head = torch.randn(v, h, generator=gen, dtype=torch.float64) * h**-0.5
    ref.init_from_target(torch.randn(v, h, generator=gen, dtype=torch.float64), lm_head, used - torch.arange(vd),
                         t2d, lm_head_trainable=True)  # fmt: skip
    lengths = [300, 200, 524]
    batch = {
        "input_ids": torch.randint(0, v, (t,), generator=gen),
        "loss_mask": torch.cat([torch.arange(n) >= int(0.4 * n) for n in lengths]),
        "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
        "position_ids": torch.cat([torch.arange(n) for n in lengths]),
        "aux_hidden_states": torch.randn(t, 3 * h, generator=gen, dtype=torch.float64),
        "last_hidden_state": torch.randn(t, h, generator=gen, dtype=torch.float64),
    }
    common = dict(target_norm_eps=1e-5, ttt_steps=3, step_loss_decay=0.8, full_vocab_argmax=False)

    def run(head, batch, norm, lm, **kw) -> tuple[Tensor, dict[str, Tensor]]:
        head.zero_grad(set_to_none=True)
        out = ttt_forward(head, batch, target_norm_weight=norm, target_lm_head=lm, **common, **kw)
        out.loss.backward()
        return out.loss.detach().double().cpu(), {n: p.grad.double().cpu() for n, p in head.named_parameters()
                                                  if p.grad is not None}  # fmt: skip

    want_loss, want_grads = run(ref, batch, torch.ones(h, dtype=torch.float64), lm_head, attention="sdpa")
    head = Eagle3DraftHead(cfg, target_hidden_size=h, vocab_size=v, draft_vocab_size=vd)
    head.load_state_dict({k: x.float() if x.is_floating_point() else x for k, x in ref.state_dict().items()})
    head.to(device)
    dev_batch = {k: (x.float() if x.is_floating_point() else x).to(device) for k, x in batch.items()}
    norm, lm = torch.ones(h, device=device), lm_head.float().to(device)
    lines = []
    flex = ["flex"] if device.type == "cuda" else []
    for attention in [*flex, "sdpa"]:
        for compile_ in (False, True) if attention == "flex" else (False,):
            for autocast, tol in ((False, 1e-4), (True, 5e-2)):
                name = (
                    f"{attention}{' compiled' if compile_ else ''}{' bf16 autocast' if autocast else ' fp32'}"
                )
                try:
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                        loss, grads = run(head, dev_batch, norm, lm, attention=attention, compile=compile_)
                    loss_err = float((loss - want_loss).abs() / want_loss.abs())
                    grad_err = max(float((grads[n] - g).norm() / g.norm()) for n, g in want_grads.items())
                    verdict = "ok" if loss_err <= tol and grad_err <= tol else f"FAIL (tolerance {tol})"
                    lines.append(f"| {name} | {loss_err:.1e} | {grad_err:.1e} | {verdict} |")
                except Exception as error:
                    lines.append(f"| {name} | — | — | error: {first_line(error)} |")
                print(lines[-1], flush=True)
    return lines


# ------------------------------------------------------------------ the data path


def fed_rate(
    step: Callable, directory: Path, setting: str, opts, device: torch.device
) -> tuple[float, float]:
    """Tokens/s of training fed by the train loader of `setting`, in the first epoch (after the warmup steps)
    and in the later ones, with no sync between steps (as under Lightning). The threads' loader hands batches
    out on the GPU, copied on a side stream while the step before ran; other loaders' pinned batches are copied
    here, on the training stream."""
    dm = data_module(directory, setting, opts.batch_tokens)
    dm.batch_device = device
    loader = dm.train_dataloader()
    spans = []  # (tokens, seconds) per epoch
    for epoch in range(opts.data_epochs):
        loader.sampler.set_epoch(epoch)
        steps, start = 0, time.perf_counter()
        for i, batch in enumerate(loader):
            step({k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "num_real_tokens"})
            steps += 1
            if epoch == 0 and i + 1 == opts.warmup:  # compilation, pinned blocks, worker start-up: not timed
                sync(device)
                steps, start = 0, time.perf_counter()
        sync(device)
        spans.append((steps * opts.batch_tokens, time.perf_counter() - start))
    later = spans[1:]
    later_tps = sum(t for t, _ in later) / sum(s for _, s in later) if later else float("nan")
    return spans[0][0] / spans[0][1], later_tps


def data_path(
    shape_name: str, ttt: int, variant: str, opts, device: torch.device, train_tps: float
) -> list[str]:
    """Loader alone (each --data-loaders setting) and training fed by it (each --data-train-loaders); rows."""
    shape = SHAPES[shape_name]
    directory = Path(tempfile.mkdtemp(prefix="bench-data-", dir=opts.data_dir))
    lines = []

    def line(source: str, setting: str, tps: tuple[float, float]) -> None:
        rates = " | ".join(f"{x:,.0f}" if x == x else "n/a" for x in tps)
        ratios = " | ".join(ratio(x, train_tps) for x in tps)
        lines.append(f"| {shape_name} | {source} | {setting} | {rates} | {ratios} |")
        print(lines[-1], flush=True)

    try:
        start = time.perf_counter()
        tokens = write_feature_shards(directory, shape, opts.data_docs, opts.doc_tokens, device)
        size = warm_page_cache(directory)
        print(f"wrote and read {tokens:,} tokens ({size:.1f} GiB) in {time.perf_counter() - start:.0f} s")
        for setting in opts.data_loaders:
            tps = loader_rate(directory, setting, opts.batch_tokens, opts.data_epochs)
            line("loader alone", setting, tps)
        target = make_target(shape, opts.draft_vocab, device)
        step, state = build_eaglet(shape, ttt, VARIANTS[variant], target, opts, device)
        for setting in opts.data_train_loaders:
            tps = fed_rate(step, directory, setting, opts, device)
            line(f"training fed by the loader ({variant}, K={ttt})", setting, tps)
        del state, step
    except Exception as error:
        lines.append(f"| {shape_name} | error | — | {first_line(error)} | — | — | — |")
        print(lines[-1], flush=True)
        if opts.verbose:
            traceback.print_exc()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        free(device)
    return lines


# ------------------------------------------------------------------ driver


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default="llama3_1_8b,kimi_k2_5")
    p.add_argument("--ttt", default="3,7")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated from {', '.join(VARIANTS)}")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--batches", type=int, default=4, help="distinct micro-batches, cycled")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps (compilation, recompilation for new shapes)"
    )
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--loss-chunk-tokens", type=int, default=2048)
    p.add_argument(
        "--embed-dtype", default="bfloat16", help="eaglet's frozen embedding table; 'none' = float32"
    )
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    p.add_argument("--data", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--data-shape", default="kimi_k2_5")
    p.add_argument("--data-docs", type=int, default=48)
    p.add_argument("--data-epochs", type=int, default=3)
    p.add_argument("--data-loaders", default="threads=0,threads=1,threads=2,threads=4,workers=4,workers=8")
    p.add_argument("--data-train-loaders", default="threads=2,workers=8")
    p.add_argument("--data-dir", default=None, help="where shards are written (local disk); default: TMPDIR")
    p.add_argument("--bench-file", default=str(BENCH_FILE), help="markdown file the tables are appended to")
    p.add_argument("--no-append", action="store_true")
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes, few steps: runs on CPU in about a minute"
    )
    p.add_argument("--profile", type=int, default=0, help="profile this many steps per row after timing")
    p.add_argument("--profile-rows", type=int, default=30, help="kernels listed per profile")
    p.add_argument("--verbose", action="store_true", help="full tracebacks of failing variants")
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.shapes, opts.ttt, opts.draft_vocab, opts.batch_tokens, opts.doc_tokens = (
            "tiny",
            "2",
            256,
            512,
            128,
        )
        opts.batches, opts.warmup, opts.steps, opts.data_shape, opts.data_docs = 2, 1, 2, "tiny", 8
        opts.data_loaders, opts.data_train_loaders = SMOKE["data_loaders"], SMOKE["data_train_loaders"]
        opts.loss_chunk_tokens = 256
        if opts.variants == DEFAULT_VARIANTS:
            opts.variants = "speculators,eaglet,eaglet_trainable"
    opts.embed_dtype = None if opts.embed_dtype == "none" else opts.embed_dtype
    opts.data_loaders = opts.data_loaders.split(",")
    opts.data_train_loaders = opts.data_train_loaders.split(",")
    for setting in [*opts.data_loaders, *opts.data_train_loaders]:
        try:
            parse_loader(setting)
        except ValueError as error:
            p.error(str(error))
    unknown = [v for v in opts.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    unknown = [s for s in [*opts.shapes.split(","), opts.data_shape] if s not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    return opts


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if value == value and reference == reference and reference > 0 else "—"


def main(argv: list[str]) -> None:
    opts = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Our pieces and speculators' forward recompile per shape and K; the default limit would fall back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    started = time.perf_counter()
    ceiling = matmul_rate(device)
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 matmul {ceiling / 1e12:.0f} TFLOP/s"
    else:
        machine = f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"
    command = "python benchmarks/bench_gpu_side_by_side.py " + " ".join(argv)
    print(f"{machine}\n{command.strip()}\n", flush=True)

    check_lines = []
    if opts.check if opts.check is not None else device.type == "cuda":
        print(
            "| eaglet path | loss rel. error | worst grad rel. error | verdict |\n|---|---|---|---|",
            flush=True,
        )
        check_lines = check_paths(device, opts)
        torch._dynamo.reset()
        free(device)

    header = (
        "| shape | K | implementation | lm_head | tokens/s | vs speculators | peak GiB | vs speculators | MFU "
        "| warmup s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    print(header, flush=True)
    rows, lines = [], []
    names = opts.variants.split(",")
    shape_names = opts.shapes.split(",")
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        batches = make_batches(shape, opts, device, seed=0)
        target = make_target(shape, opts.draft_vocab, device)
        for ttt in (int(k) for k in opts.ttt.split(",")):
            reference = None
            for name in names:
                row = run_row(name, shape_name, ttt, batches, target, opts, device)
                rows.append(row)
                if name == "speculators":
                    reference = row
                ref_tps = reference.tps if reference else float("nan")
                ref_peak = reference.peak_gib if reference else float("nan")
                flops = model_flops_per_token(shape, opts.draft_vocab, ttt, opts.doc_tokens)
                mfu = (
                    f"{row.tps * flops / ceiling:.0%}" if ceiling == ceiling and row.tps == row.tps else "n/a"
                )
                head = "trainable" if VARIANTS[name].trainable else "frozen"
                if row.error:
                    line = f"| {shape_name} | {ttt} | {name} | {head} | error: {row.error} | | | | | |"
                else:
                    peak = f"{row.peak_gib:.1f}" if row.peak_gib == row.peak_gib else "n/a"
                    line = (
                        f"| {shape_name} | {ttt} | {name} | {head} | {row.tps:,.0f} | {ratio(row.tps, ref_tps)} "
                        f"| {peak} | {ratio(row.peak_gib, ref_peak)} | {mfu} | {row.warmup_s:.0f} |"
                    )
                lines.append(line)
                print(line, flush=True)
        del batches, target
        free(device)
        if shape_name != shape_names[-1]:  # compiled code of one shape is no use to the next
            torch._dynamo.reset()

    data_lines = []
    if opts.data:
        data_ttt = int(opts.ttt.split(",")[0])
        candidates = [r for r in rows if r.shape == opts.data_shape and r.ttt == data_ttt and not r.error
                      and VARIANTS[r.variant].impl == "eaglet" and not VARIANTS[r.variant].trainable]  # fmt: skip
        best = max(candidates, key=lambda r: r.tps) if candidates else None
        variant, train_tps = (best.variant, best.tps) if best else ("eaglet", float("nan"))
        print("\n" + DATA_HEADER, flush=True)
        data_lines = data_path(opts.data_shape, data_ttt, variant, opts, device, train_tps)

    total = time.perf_counter() - started
    print(f"\ntotal {total:.0f} s", flush=True)
    if opts.no_append:
        return
    notes = (
        f"Same packed micro-batches for both ({opts.batch_tokens:,} tokens, {opts.doc_tokens:,}-token documents, "
        f"30-50% prompt with loss mask 0), draft vocab {opts.draft_vocab:,}, {opts.warmup} warmup + {opts.steps} "
        f"timed steps, forward + backward + AdamW, {'bf16 autocast, ' if device.type == 'cuda' else ''}fp32 master "
        f"weights; eaglet's frozen embedding "
        f"table in {opts.embed_dtype or 'float32'}. Whole run {total:.0f} s."
    )
    with open(opts.bench_file, "a") as fh:
        fh.write(f"\n### Side by side with speculators on one device — `{command.strip()}`\n\n")
        fh.write(f"{date.today()}, {machine}. {notes}\n\n")
        if check_lines:
            fh.write(
                "| eaglet path | loss rel. error | worst grad rel. error | verdict |\n|---|---|---|---|\n"
            )
            fh.write("\n".join(check_lines) + "\n\n")
        fh.write(header + "\n" + "\n".join(lines) + "\n")
        if data_lines:
            fh.write("\n" + DATA_HEADER + "\n")
            fh.write("\n".join(data_lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
