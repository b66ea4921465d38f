"""Online training (trainer.features=online) against training from shards, on the same tokens of a tiny random
Llama target: token stores, the target's features computed in the step, losses, resume and misuse."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config
from safetensors.torch import load_file
from test_train import REPRODUCIBLE_CPU

from eaglet.config import REPO_ROOT
from eaglet.errors import ConfigError, DataError
from eaglet.extract.stage import run_extraction
from eaglet.shards import ShardReader, build_vocab_mapping, load_token_counts, read_manifest
from eaglet.shards.layout import TARGET_HEAD_FILE
from eaglet.shards.tokens import TokenReader
from eaglet.sweeps.trial import check_sweep_settings
from eaglet.train.datamodule import ShardDataModule
from eaglet.train.hardware import plan_trainer
from eaglet.train.module import DraftHeadModule
from eaglet.train.online import TokenDataModule, check_target_fits, load_online_target
from eaglet.train.packing import collate_packed, collate_tokens
from eaglet.train.run import build_module, run_training


def data_overrides(out: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_llama",
        "dataset=oasst_en100",
        "dataset.max_records_per_file=30",
        "extract.regenerate.enabled=false",
        f"extract.output_dir={out}",
        # The online target runs where training does (hardware=cpu here): extract there too, or on a GPU machine
        # the stores would hold a bfloat16 target's features (model.dtype=auto) against a float32 one online.
        "extract.device=cpu",
        "extract.max_length=256",
        "extract.shard_tokens=2048",  # several shards
        "draft.vocab_size=256",
        *extra,
    ]


def train_overrides(out: Path, runs: Path, *extra: str) -> list[str]:
    return [
        *data_overrides(out),
        f"paths.output_dir={runs}",
        "hardware.tokens_per_device=512",
        "trainer.global_batch_tokens=1024",
        "trainer.max_steps=6",
        "trainer.val_every_n_steps=3",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.val_fraction=0.2",
        *extra,
    ]


TOKENS = ["extract.features=tokens", "extract.dtype=float32"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> dict[str, Path]:
    """The same data extracted four ways: hidden states of the float32 target stored in float32 and in bfloat16,
    of a bfloat16 target in bfloat16, and the tokens alone (recording float32 features, as "fp32")."""
    root = tmp_path_factory.mktemp("stores")
    folders = {
        "fp32": (root / "fp32", ["extract.dtype=float32"]),
        "bf16": (root / "bf16", []),
        "bf16_target": (root / "bf16_target", ["model.dtype=bfloat16"]),
        "tokens": (root / "tokens", TOKENS),
    }
    for out, extra in folders.values():
        run_extraction(compose_config(model_cache, *data_overrides(out, *extra)))
    return {name: out for name, (out, _) in folders.items()}


def token_shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(path)
    return {name: tensors[name] for name in ("input_ids", "loss_mask", "seq_offsets", "sample_ids")}


def test_a_token_store_holds_the_tokens_and_counts_of_a_hidden_state_extraction(
    stores: dict[str, Path],
) -> None:
    tokens, hidden = read_manifest(stores["tokens"]), read_manifest(stores["fp32"])
    assert tokens.complete and tokens.settings["features"] == "tokens" and len(tokens.shards) > 1
    assert (stores["tokens"] / "token_counts.safetensors").read_bytes() == (
        stores["fp32"] / "token_counts.safetensors"
    ).read_bytes()
    assert not (stores["tokens"] / TARGET_HEAD_FILE).exists()
    for mine, theirs in zip(tokens.shards, hidden.shards, strict=True):
        assert (mine.file, mine.num_sequences, mine.num_tokens, mine.num_masked, mine.first_sample) == (
            theirs.file, theirs.num_sequences, theirs.num_tokens, theirs.num_masked, theirs.first_sample,
        )  # fmt: skip
        a = token_shard_tensors(stores["tokens"] / mine.file)
        b = token_shard_tensors(stores["fp32"] / theirs.file)
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert tokens.totals["bytes"] < 6 * tokens.totals["tokens"] + 1024 * len(tokens.shards)
    # The token reader reads both kinds of folder alike.
    mine, theirs = TokenReader(stores["tokens"]), TokenReader(stores["fp32"])
    assert np.array_equal(mine.lengths, theirs.lengths) and np.array_equal(mine.sample_ids, theirs.sample_ids)
    shard = ShardReader(stores["fp32"])
    for i in range(len(mine)):
        for name in ("input_ids", "loss_mask"):
            assert torch.equal(mine.sequence(i)[name], shard.sequence(i)[name])


def test_token_extraction_resumes_and_rewrites_a_damaged_shard(
    stores: dict[str, Path], model_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tokens"
    cfg = compose_config(model_cache, *data_overrides(out, *TOKENS))
    run_extraction(cfg)
    before = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert before == {p.name: p.read_bytes() for p in sorted(stores["tokens"].iterdir())}
    (out / "shard-00001.safetensors").write_bytes(b"damaged")
    (out / "shard-00002.safetensors").unlink()
    summary = run_extraction(cfg)
    assert summary.resumed_shards == len(read_manifest(out).shards) - 2  # all but the two written again
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == before


def test_packed_token_rows_match_feature_rows(stores: dict[str, Path]) -> None:
    shard, tokens = ShardReader(stores["fp32"]), TokenReader(stores["tokens"])
    for members, budget in (([0, 1, 2], 1024), ([3], 40), ([4, 5], 512)):
        sizes = [min(int(shard.lengths[i]), budget) for i in members]
        if sum(sizes) > budget:
            continue
        row = collate_packed([shard.sequence(i) for i in members], budget)
        token_row = collate_tokens([tokens.sequence(i) for i in members], budget)
        for name in ("input_ids", "loss_mask", "document_ids", "position_ids", "num_real_tokens"):
            assert torch.equal(row[name], token_row[name]), name
        bounds = np.cumsum([0, *sizes]).tolist()
        assert token_row["cu_seqlens"].tolist() == bounds + ([budget] if bounds[-1] < budget else [])


def paired_batches(cfg, stores: dict[str, Path], shard_folder: str, batches: int):
    """The first train micro-batches of the shard folder and of the token store, with the online target."""
    plan = plan_trainer(cfg.hardware, cfg.trainer)
    common = {"tokens_per_batch": plan.tokens_per_device, "val_fraction": 0.2, "seed": 0, "num_workers": 0}
    offline = ShardDataModule(stores[shard_folder], loader_threads=0, **common)
    online = TokenDataModule(stores["tokens"], loader_threads=0, **common)
    offline.setup()
    online.setup()
    target = load_online_target(cfg, plan, read_manifest(stores[shard_folder]), stores[shard_folder])
    pairs = list(zip(offline.train_dataloader(), online.train_dataloader(), strict=True))[:batches]
    return pairs, target


def head_module(cfg, shards: Path, head_weights: dict[str, torch.Tensor]):
    torch.manual_seed(0)
    module = build_module(
        cfg.draft, cfg.trainer, read_manifest(shards), target_norm_eps=cfg.model.rms_norm_eps, total_steps=10
    )
    d2t, t2d = build_vocab_mapping(load_token_counts(shards), cfg.draft.vocab_size)
    module.init_from_target(head_weights, d2t, t2d)
    return module


@pytest.mark.parametrize(
    ("precision", "shard_folder", "tolerance"),
    [
        # float32 target, float32 features: the same numbers up to float32 rounding (the target's matmuls see
        # a packed row here, right-padded batches there).
        ("float32", "fp32", {"features": 1e-6, "loss": 1e-6}),
        # float32 target, features stored in bfloat16 (the default): online casts them as extraction does.
        ("float32", "bf16", {"features": 1e-2, "loss": 1e-5}),
        # bfloat16 target and features: within bf16 rounding.
        ("bfloat16", "bf16_target", {"features": 2e-2, "loss": 1e-3}),
    ],
)
def test_online_features_and_losses_equal_the_extracted_ones(
    stores: dict[str, Path], model_cache: Path, tmp_path: Path, precision: str, shard_folder: str, tolerance
) -> None:
    cfg = compose_config(
        model_cache, *train_overrides(stores[shard_folder], tmp_path, f"model.dtype={precision}")
    )
    pairs, target = paired_batches(cfg, stores, shard_folder, batches=4)
    assert target.loaded.dtype == getattr(torch, precision) and not target.loaded.model.training
    head = load_file(stores[shard_folder] / TARGET_HEAD_FILE)
    for name, weight in target.head_weights().items():
        assert torch.equal(weight, head[name]), name
    offline_head = head_module(cfg, stores[shard_folder], head)
    online_head = head_module(cfg, stores[shard_folder], target.head_weights())
    online_head.attach_target(target)
    for offline_batch, token_batch in pairs:
        features = target.features(token_batch)
        real = int(token_batch["num_real_tokens"])
        for name in ("aux_hidden_states", "last_hidden_state"):
            assert features[name].dtype == offline_batch[name].dtype
            torch.testing.assert_close(
                features[name][:real].float(),
                offline_batch[name][:real].float(),
                rtol=tolerance["features"],
                atol=tolerance["features"],
                msg=name,
            )
        want = offline_head._run(offline_batch, noise=False)
        got = online_head._run(token_batch, noise=False)  # the attached target computes the features itself
        torch.testing.assert_close(got.step_losses, want.step_losses, rtol=tolerance["loss"], atol=0)
        torch.testing.assert_close(got.loss, want.loss, rtol=tolerance["loss"], atol=0)
        assert torch.equal(got.step_weight_sums, want.step_weight_sums)


def test_compiled_target_layers_give_the_eager_features(
    stores: dict[str, Path], model_cache: Path, tmp_path: Path
) -> None:
    """trainer.online_compile=true: the decoder layers run through torch.compile, compiled once for all layers
    and every row's document count; the features equal the eager target's (float32 on the CPU)."""
    overrides = train_overrides(stores["fp32"], tmp_path, "trainer.features=online")
    eager_cfg = compose_config(model_cache, *overrides)
    compiled_cfg = compose_config(model_cache, *overrides, "trainer.online_compile=true")
    pairs, eager = paired_batches(eager_cfg, stores, "fp32", batches=4)
    _, compiled = paired_batches(compiled_cfg, stores, "fp32", batches=4)
    assert compiled.compiled and not eager.compiled
    rows = [token_batch for _, token_batch in pairs]
    assert len({int(row["cu_seqlens"].numel()) for row in rows}) > 1  # rows with different document counts
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for row in rows:
        want, got = eager.features(row), compiled.features(row)
        for name in ("aux_hidden_states", "last_hidden_state"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
    compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    # Each layer's forward breaks at the per-document attention (CPU): four graphs (before and after it, in the
    # layer and in its attention), shared by all six layers and every row's document count, not compiled again.
    assert 0 < compiled_graphs <= 4, compiled_graphs


def loss_curve(metrics_csv: Path) -> dict[int, float]:
    rows = csv.DictReader(open(metrics_csv))
    return {int(r["step"]): float(r["train/loss_global"]) for r in rows if r.get("train/loss_global")}


@pytest.mark.parametrize(("overlap", "compiled"), [(False, False), (True, False), (False, True)])
def test_online_training_equals_training_from_shards(
    compose, stores: dict[str, Path], tmp_path: Path, monkeypatch, overlap: bool, compiled: bool
) -> None:
    """trainer.online_overlap=true: the loader runs the target (on the GPU, on its copy stream) and the step
    gets the features with the batch; trainer.online_compile=true: the target's layers run compiled. The same
    losses every way."""
    offline = run_training(compose(*train_overrides(stores["fp32"], tmp_path)), tmp_path / "offline")
    arrived_with_features, target_compiled = [], []
    run = DraftHeadModule._run

    def spy(self, batch, *, noise):
        arrived_with_features.append("aux_hidden_states" in batch)
        target_compiled.append(self._online_target.compiled)
        return run(self, batch, noise=noise)

    monkeypatch.setattr(DraftHeadModule, "_run", spy)
    online = run_training(
        compose(
            *train_overrides(stores["tokens"], tmp_path, "trainer.features=online"),
            f"trainer.online_overlap={str(overlap).lower()}",
            f"trainer.online_compile={str(compiled).lower()}",
        ),
        tmp_path / "online",
    )
    assert arrived_with_features and set(arrived_with_features) == {overlap}
    assert set(target_compiled) == {compiled}
    assert (
        online.steps == offline.steps == 6 and online.train_tokens_per_epoch == offline.train_tokens_per_epoch
    )
    curves = {name: loss_curve(tmp_path / name / "metrics.csv") for name in ("offline", "online")}
    assert len(curves["online"]) == 6 and curves["online"].keys() == curves["offline"].keys()
    for step, loss in curves["offline"].items():
        assert curves["online"][step] == pytest.approx(loss, rel=1e-4), step
    assert online.val_loss == pytest.approx(offline.val_loss, rel=1e-4)
    assert online.tau_sim == pytest.approx(offline.tau_sim, abs=1e-6)
    # The frozen target is never in a checkpoint: the same keys as a run from shards, loadable as plain weights.
    ckpt = torch.load(tmp_path / "online" / "checkpoints" / "last.ckpt", weights_only=True)
    reference = torch.load(tmp_path / "offline" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["state_dict"].keys() == reference["state_dict"].keys()
    for name, tensor in reference["state_dict"].items():
        torch.testing.assert_close(ckpt["state_dict"][name], tensor, rtol=1e-3, atol=1e-5, msg=name)
    exported = load_file(tmp_path / "online" / "draft" / "model.safetensors")
    assert exported.keys() == load_file(tmp_path / "offline" / "draft" / "model.safetensors").keys()


def test_online_reads_the_tokens_of_a_hidden_state_folder(
    compose, stores: dict[str, Path], tmp_path: Path
) -> None:
    summary = run_training(
        compose(*train_overrides(stores["fp32"], tmp_path, "trainer.features=online", "trainer.max_steps=2")),
        tmp_path / "run",
    )
    assert summary.steps == 2 and summary.shard_dir == str(stores["fp32"])


@pytest.mark.parametrize(
    ("folder", "extra", "error", "match"),
    [
        # Tokens of another target: its dims differ (checked before the target loads) ...
        ("tokens", ["trainer.features=online", "model.num_layers=5"], DataError, "tokens of another target"),
        # ... or only its weights' config does (checked against the loaded target).
        ("tokens", ["trainer.features=online", "model.intermediate_size=96"], DataError, "config_hash"),
        ("tokens", [], DataError, "token streams only.*trainer.features=online"),
        ("missing", ["trainer.features=online"], DataError, "extract.py"),
    ],
)
def test_misuse_is_refused_before_training(
    compose, stores: dict[str, Path], tmp_path: Path, folder: str, extra, error, match
) -> None:
    where = stores.get(folder, tmp_path / "none")
    with pytest.raises(error, match=match):
        run_training(compose(*train_overrides(where, tmp_path, *extra)), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_sweeps_refuse_online_training(compose) -> None:
    with pytest.raises(ConfigError, match="sweep with trainer.features=shards"):
        check_sweep_settings(compose("trainer.features=online"))


def test_tokens_need_the_transformers_backend(compose, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="extract.features=tokens needs extract.backend=transformers"):
        compose(*data_overrides(tmp_path, "extract.features=tokens", "extract.backend=vllm"))


def test_a_target_too_large_for_one_device_is_refused_with_what_to_do(compose, tmp_path: Path) -> None:
    cfg = compose("model=llama3_1_8b", "model.path=/nowhere")
    device = torch.device("cuda", 0)
    check_target_fits(cfg.model, device, 80 * 2**30, torch.bfloat16)  # 16 GB of weights fit on 80 GB
    with pytest.raises(ConfigError, match="replica of the target on every device.*trainer.features=shards"):
        check_target_fits(cfg.model, device, 24 * 2**30, torch.bfloat16)
    kimi = compose("model=kimi_k2_5", "model.path=/nowhere")
    with pytest.raises(ConfigError, match="tensor-parallel online training is not supported"):
        check_target_fits(kimi.model, device, 141 * 2**30, torch.bfloat16)


def train_cmd(stores: dict[str, Path], out: Path, cache: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO_ROOT / "train.py"),
        *train_overrides(stores["tokens"], out, "trainer.features=online", "trainer.max_steps=10", *extra),
        f"paths.cache_dir={cache}", f"hydra.run.dir={out}/run",
    ]  # fmt: skip


@pytest.mark.e2e
def test_killed_online_training_resumes_mid_epoch_to_the_same_weights(
    stores: dict[str, Path], tmp_path: Path, model_cache: Path
) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **REPRODUCIBLE_CPU}
    whole = tmp_path / "whole"
    subprocess.run(train_cmd(stores, whole, model_cache), check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        train_cmd(stores, killed, model_cache), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    last = killed / "run" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not last.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            "training ended before its first checkpoint"
        )
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = torch.load(last, weights_only=True)
    assert 0 < saved["global_step"] < 10
    assert saved["TokenDataModule"]["batches_done"] > 0, "the kill should land inside an epoch"

    subprocess.run(
        train_cmd(stores, tmp_path / "resumed", model_cache, f"ckpt_path={last}"),
        check=True,
        env=env,
        capture_output=True,
    )
    expected = torch.load(whole / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(last, weights_only=True)
    assert got["global_step"] == expected["global_step"] == 10
    for name, tensor in expected["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.e2e
def test_two_process_online_ddp_equals_one_process_from_shards(
    stores: dict[str, Path], tmp_path: Path, model_cache: Path
) -> None:
    """hardware=cpu hardware.devices=2: each rank runs its own replica of the target on its own micro-batches."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **REPRODUCIBLE_CPU}
    runs = {}
    for name, folder, extra in (
        ("offline", "fp32", ["trainer.features=shards"]),
        ("online_ddp", "tokens", ["trainer.features=online", "hardware.devices=2"]),
    ):
        out = tmp_path / name
        cmd = [
            sys.executable, str(REPO_ROOT / "train.py"),
            *train_overrides(stores[folder], out, "trainer.max_steps=4", *extra),
            f"paths.cache_dir={model_cache}", f"hydra.run.dir={out}/run",
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = out / "run"
    curves = {name: loss_curve(run / "metrics.csv") for name, run in runs.items()}
    assert len(curves["offline"]) == 4 and curves["online_ddp"].keys() == curves["offline"].keys()
    for step, loss in curves["offline"].items():
        assert curves["online_ddp"][step] == pytest.approx(loss, rel=1e-4), step
