"""benchmarks/side_by_side_speculators.py on shards written by the real extraction (tiny random Llama target)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file
from test_train import data_overrides, shards  # noqa: F401  (module fixture: shards by the real extraction)

from eaglet.config import REPO_ROOT
from eaglet.errors import ConfigError, DataError
from eaglet.shards import build_vocab_mapping, load_token_counts, read_manifest
from eaglet.shards.layout import TARGET_HEAD_FILE
from eaglet.train.datamodule import ShardDataModule
from eaglet.train.hardware import plan_trainer
from eaglet.train.run import build_module, optimizer_steps
from eaglet.train.ttt import BATCH_KEYS

SCRIPT = REPO_ROOT / "benchmarks" / "side_by_side_speculators.py"
TTT = 3


@pytest.fixture(scope="module")
def sbs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("side_by_side_speculators", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def script_args(shards: Path, model_cache: Path) -> list[str]:  # noqa: F811
    return [
        f"shards={shards}",
        f"paths.cache_dir={model_cache}",
        *data_overrides(shards),
        "hardware.tokens_per_device=512",
        "trainer.global_batch_tokens=1024",
    ]


def random_row(hidden: int, vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A speculators-format row: two documents (positions from 1, as after its shift) and padding (-1)."""
    lengths, padding = (20, 17), 7
    docs = [torch.full((n,), d) for d, n in enumerate(lengths)] + [torch.full((padding,), -1)]
    positions = [torch.arange(1, n + 1) for n in lengths] + [torch.zeros(padding, dtype=torch.long)]
    size = sum(lengths) + padding
    return {
        "hidden_states": torch.randn(1, size, 3 * hidden, generator=generator),
        "input_ids": torch.randint(0, vocab, (1, size), generator=generator),
        "document_ids": torch.cat(docs)[None],
        "position_ids": torch.cat(positions)[None],
    }


def head_pair(sbs, shards: Path, model_cache: Path):  # noqa: F811
    """(config, manifest, our head, speculators' model holding its weights), both initialised from the target."""
    opts, overrides = sbs.parse_args(script_args(shards, model_cache))
    cfg = sbs.compose_config(opts, overrides)
    manifest = read_manifest(shards)
    d2t, t2d = build_vocab_mapping(load_token_counts(shards), cfg.draft.vocab_size)
    torch.manual_seed(0)
    module = build_module(
        cfg.draft, cfg.trainer, manifest, target_norm_eps=cfg.model.rms_norm_eps, total_steps=2
    )
    module.init_from_target(load_file(shards / TARGET_HEAD_FILE), d2t, t2d)
    theirs = sbs.build_speculators(module, cfg, manifest.aux_layer_ids, torch.device("cpu")).eval()
    return cfg, manifest, module.head.eval(), theirs


def test_weights_convert_both_ways_with_equal_logits(sbs, shards: Path, model_cache: Path) -> None:  # noqa: F811
    cfg, manifest, ours, theirs = head_pair(sbs, shards, model_cache)
    assert theirs.layers[0].self_attn.config._attn_implementation == "eager"
    assert not theirs.lm_head.weight.requires_grad and not ours.lm_head.weight.requires_grad
    row = random_row(manifest.hidden_size, manifest.vocab_size, torch.Generator().manual_seed(1))

    # Ours copied into theirs: the same logits at every TTT step.
    assert sbs.logit_difference(theirs, ours, row, TTT) < 1e-4
    # Their weights moved away from ours, then converted back into a head: again the same logits.
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert sbs.logit_difference(theirs, ours, row, TTT) > 1e-2
    converted = sbs.to_eaglet_head(theirs, cfg, manifest, manifest.aux_layer_ids)
    assert sbs.logit_difference(theirs, converted, row, TTT) < 1e-4
    assert torch.equal(converted.d2t, ours.d2t) and torch.equal(converted.t2d, ours.t2d)


def test_the_check_runs_speculators_forward_eagerly_where_it_is_compiled(
    sbs,
    shards: Path,  # noqa: F811
    model_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """speculators compiles its forward where CUDA is present; the CPU check must not go through the compiler
    (inductor's C++ path failed to build there). A backend that refuses to compile stands in for it."""
    _, manifest, ours, theirs = head_pair(sbs, shards, model_cache)

    def refusing_backend(graph, example_inputs):
        raise RuntimeError("compiled on the CPU check")

    torch._dynamo.reset()
    compiled = torch.compile(sbs.Eagle3DraftModel.forward, backend=refusing_backend)
    monkeypatch.setattr(sbs.Eagle3DraftModel, "forward", compiled)
    row = random_row(manifest.hidden_size, manifest.vocab_size, torch.Generator().manual_seed(1))
    with pytest.raises(Exception, match="compiled on the CPU check"):  # the stand-in does compile
        theirs(
            **{k: row[k] for k in ("hidden_states", "input_ids", "document_ids", "position_ids")},
            ttt_steps=TTT,
        )
    assert sbs.logit_difference(theirs, ours, row, TTT) < 1e-4
    torch._dynamo.reset()


def test_micro_batch_is_repacked_with_speculators_shift(sbs, shards: Path) -> None:  # noqa: F811
    datamodule = ShardDataModule(shards, 512, val_fraction=0.0, seed=0, num_workers=0)
    datamodule.setup()
    batch = next(iter(datamodule.train_dataloader()))
    row = sbs.speculators_batch(batch)
    first = int((batch["document_ids"] == 0).sum())
    docs = int(batch["document_ids"][int(batch["num_real_tokens"]) - 1]) + 1
    # Each document loses its first token; features stay at t, the token and the teacher state move to t+1.
    assert int((row["document_ids"] >= 0).sum()) == int(batch["num_real_tokens"]) - docs
    assert torch.equal(row["input_ids"][0, : first - 1], batch["input_ids"][1:first])
    assert torch.equal(row["loss_mask"][0, : first - 1], batch["loss_mask"][1:first])
    assert torch.equal(row["hidden_states"][0, : first - 1], batch["aux_hidden_states"][: first - 1].float())
    assert torch.equal(row["verifier_last_hidden_states"][0, 0], batch["last_hidden_state"][1].float())
    assert torch.equal(row["position_ids"][0, : first - 1], torch.arange(1, first))


def packed(document_lengths: list[int], padding: int) -> dict[str, torch.Tensor]:
    """A packed micro-batch's fields: documents 0, 1, ... of the given lengths, then padding (one more document)."""
    real = sum(document_lengths)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate([*document_lengths, padding])])
    size = real + padding
    return {
        "input_ids": torch.arange(size),
        "loss_mask": torch.ones(size, dtype=torch.bool),
        "document_ids": docs,
        "position_ids": torch.cat([torch.arange(n) for n in [*document_lengths, padding]]),
        "aux_hidden_states": torch.randn(size, 6),
        "last_hidden_state": torch.randn(size, 2),
        "num_real_tokens": torch.tensor(real),
        "cu_seqlens": torch.tensor([0, 5, 8, 12, size], dtype=torch.int32),
    }


@pytest.mark.parametrize(
    ("tokens", "kept"),
    [
        (5, 5),  # the first document whole
        (7, 7),  # and the start of the second
        (6, 5),  # the second's start would be one token: left out
        (3, 3),  # the first document's start
        (100, 12),  # every real token, no padding
    ],
)
def test_conversion_is_checked_on_a_prefix_of_the_micro_batch(sbs, tokens: int, kept: int) -> None:
    batch = packed([5, 3, 4], padding=4)
    prefix = sbs.batch_prefix(batch, tokens)
    assert int(prefix["num_real_tokens"]) == kept and "cu_seqlens" not in prefix
    for key in BATCH_KEYS:
        assert torch.equal(prefix[key], batch[key][:kept])
    # Each document loses a token to speculators' shift; none is left empty.
    row = sbs.speculators_batch(prefix)
    documents = len(torch.unique(prefix["document_ids"]))
    assert int((row["document_ids"] >= 0).sum()) == kept - documents


def test_script_trains_both_converts_and_reports(
    sbs,
    shards: Path,  # noqa: F811
    model_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = tmp_path / "BENCHMARKS.md"
    monkeypatch.setattr(sbs, "BENCH_FILE", bench)
    # The conversion is checked on a micro-batch's first CHECK_TOKENS tokens only.
    checked_tokens, logit_difference = [], sbs.logit_difference

    def recording_difference(model, head, row, ttt):
        checked_tokens.append(row["input_ids"].shape[1])
        return logit_difference(model, head, row, ttt)

    monkeypatch.setattr(sbs, "CHECK_TOKENS", 64)
    monkeypatch.setattr(sbs, "logit_difference", recording_difference)
    args = [*script_args(shards, model_cache), "steps=2", "prompts=1", "max_new_tokens=8", "eval.sets=[code]"]
    results = sbs.main(args)
    assert len(checked_tokens) == 1 and 0 < checked_tokens[0] <= 64

    for side in ("eaglet", "speculators"):
        trained = results["training"][side]
        assert trained["steps"] == 2 and trained["seconds"] > 0
        assert len(trained["losses"]) == 2 and all(math.isfinite(x) and x > 0 for x in trained["losses"])
    assert results["conversion_diff"] < 1e-3
    code = results["sets"]["code"]
    assert code["prompts"] == 1 and set(code["results"]) == {"eaglet", "speculators", "ngram"}
    rows = [line for line in sbs.format_table(results).splitlines() if "| code |" in line]
    assert [row.split(" | ")[4] for row in rows] == ["eaglet", "speculators", "ngram"]
    assert all(len(row.split(" | ")) == 7 + TTT + 2 for row in rows)
    text = bench.read_text()
    assert "### Side by side with speculators" in text and "steps=2" in text
    assert "| code | 1 | speculators |" in text and "`eager` attention" in text


def test_online_trains_on_the_features_the_shards_hold(sbs, shards: Path, model_cache: Path) -> None:  # noqa: F811
    """trainer.features=online on the same folder's token streams: the target's features computed in the loop
    equal the stored ones (float32 on CPU), so both sides train to the same losses as from the shards."""
    args = [*script_args(shards, model_cache), "steps=2", "evaluate=0"]
    stored = sbs.main(args)["training"]
    online = sbs.main([*args, "trainer.features=online"])["training"]
    for side in ("eaglet", "speculators"):
        assert online[side]["steps"] == 2
        assert online[side]["losses"] == pytest.approx(stored[side]["losses"], rel=1e-3)


def test_our_head_is_kept_when_the_conversion_check_fails(
    sbs,
    shards: Path,  # noqa: F811
    model_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check speaks for the speculators side only: a failed one leaves our trained head saved, and no
    converted speculators head."""
    monkeypatch.setattr(sbs, "CONVERSION_TOLERANCE", -1.0)
    args = [*script_args(shards, model_cache), "steps=2", "evaluate=0", f"save={tmp_path}"]
    with pytest.raises(DataError, match="differs from speculators' own forward"):
        sbs.main(args)
    assert (tmp_path / "eaglet" / "model.safetensors").is_file()
    assert (tmp_path / "eaglet" / "config.json").is_file()
    assert not (tmp_path / "speculators").exists()


@pytest.mark.parametrize(
    ("arg", "match"),
    [("steps=x", "integer"), ("ttt=0", ">= 1"), ("epochs=-1", ">= 0"), ("bogus", "key=value")],
)
def test_bad_options_are_refused(sbs, arg: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        sbs.parse_args([arg])


def test_other_arguments_become_hydra_overrides(sbs) -> None:
    opts, overrides = sbs.parse_args(["steps=7", "model=tiny_llama", "shards=/x"])
    assert opts["steps"] == 7 and opts["shards"] == "/x" and overrides == ["model=tiny_llama"]


def test_epochs_take_as_many_optimizer_steps_as_train_py(sbs, shards: Path, model_cache: Path) -> None:  # noqa: F811
    opts, overrides = sbs.parse_args([*script_args(shards, model_cache), "epochs=2"])
    cfg = sbs.compose_config(opts, overrides)
    assert cfg.trainer.max_epochs == 2 and cfg.trainer.max_steps <= 0
    plan = plan_trainer(cfg.hardware, cfg.trainer)
    datamodule = ShardDataModule(
        shards, plan.tokens_per_device, cfg.trainer.val_fraction, seed=0, num_workers=0
    )
    datamodule.setup()
    per_epoch = -(-datamodule.train_batches_per_rank(1) // plan.accumulate_grad_batches)
    assert per_epoch > 0 and optimizer_steps(cfg.trainer, datamodule, plan) == 2 * per_epoch
    # A trainer.max_steps override still wins, as in train.py.
    opts, overrides = sbs.parse_args([*script_args(shards, model_cache), "epochs=2", "trainer.max_steps=3"])
    assert optimizer_steps(sbs.compose_config(opts, overrides).trainer, datamodule, plan) == 3
