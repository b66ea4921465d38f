"""Settings checked before any work starts: each wrong value stops at composition or start-up, naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglet.errors import ConfigError

# (override, text the message must hold): one per value check of eaglet.config.checks.
VALUE_CHECKS = [
    ("seed=-1", "seed must be in [0, 4294967295]"),
    ("trainer.lr=0", "trainer.lr must be > 0"),
    ("trainer.weight_decay=-0.1", "trainer.weight_decay must be >= 0"),
    ("trainer.warmup_ratio=1.0", "trainer.warmup_ratio must be in [0, 1)"),
    ("trainer.grad_clip=-1", "trainer.grad_clip must be >= 0"),
    ("trainer.max_epochs=0", "trainer.max_epochs must be >= 1"),
    ("trainer.max_steps=0", "trainer.max_steps must be -1"),
    ("trainer.global_batch_tokens=0", "trainer.global_batch_tokens must be >= 1"),
    ("trainer.val_every_n_steps=0", "trainer.val_every_n_steps must be >= 1"),
    ("trainer.checkpoint_every_n_steps=0", "trainer.checkpoint_every_n_steps must be >= 1"),
    ("trainer.feature_noise_std=-0.1", "trainer.feature_noise_std must be >= 0"),
    ("trainer.val_fraction=-0.1", "trainer.val_fraction must be in [0, 1)"),
    ("trainer.train_fraction=0", "trainer.train_fraction must be in (0, 1]"),
    ("trainer.train_fraction=1.5", "trainer.train_fraction must be in (0, 1]"),
    ("hardware.tokens_per_device=0", "hardware.tokens_per_device must be >= 1"),
    ("hardware.memory_gb_per_device=-1", "hardware.memory_gb_per_device must be >= 0"),
    ("draft.rms_norm_eps=0", "draft.rms_norm_eps must be > 0"),
    ("draft.rope_theta=0", "draft.rope_theta must be > 0"),
    ("draft.max_position_embeddings=0", "draft.max_position_embeddings must be >= 1"),
    ("model.num_layers=0", "model.num_layers must be >= 1"),
    ("model.vocab_size=0", "model.vocab_size must be >= 1"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps must be > 0"),
    ("model.num_experts_per_tok=2", "model.num_experts_per_tok=2 exceeds model.num_experts=0"),
    ("model.weight_bits=0", "model.weight_bits must be >= 1"),
    ("dataset.paths=[]", "dataset.paths is empty"),
    ("dataset.max_records_per_file=0", "dataset.max_records_per_file must be >= 1"),
    ("extract.max_length=0", "extract.max_length must be >= 1"),
    ("extract.batch_tokens=0", "extract.batch_tokens must be >= 1"),
    ("extract.shard_tokens=0", "extract.shard_tokens must be >= 1"),
    ("extract.max_conversations=0", "extract.max_conversations must be >= 1"),
    ("extract.regenerate.max_new_tokens=0", "extract.regenerate.max_new_tokens must be >= 1"),
    ("extract.regenerate.temperature=-0.5", "extract.regenerate.temperature must be >= 0"),
    ("extract.regenerate.top_p=0", "extract.regenerate.top_p must be in (0, 1]"),
    ("extract.regenerate.top_p=1.5", "extract.regenerate.top_p must be in (0, 1]"),
    ("extract.regenerate.batch_size=0", "extract.regenerate.batch_size must be >= 1"),
    ("extract.regenerate.refill_every=0", "extract.regenerate.refill_every must be >= 1"),
    ("extract.regenerate.concurrency=0", "extract.regenerate.concurrency must be >= 1"),
    ("extract.regenerate.max_retries=-1", "extract.regenerate.max_retries must be >= 0"),
    ("extract.regenerate.request_timeout_s=0", "extract.regenerate.request_timeout_s must be > 0"),
    ("extract.vllm.tensor_parallel_size=0", "extract.vllm.tensor_parallel_size must be >= 1"),
    ("extract.vllm.gpu_memory_utilization=0", "extract.vllm.gpu_memory_utilization must be in (0, 1]"),
    ("extract.vllm.max_model_len=0", "extract.vllm.max_model_len must be >= 1"),
    ("extract.vllm.concurrency=0", "extract.vllm.concurrency must be >= 1"),
    ("extract.vllm.request_timeout_s=0", "extract.vllm.request_timeout_s must be > 0"),
    ("extract.vllm.max_retries=-1", "extract.vllm.max_retries must be >= 0"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens must be >= 1"),
    ("eval.ngram_min_n=0", "eval.ngram_min_n must be >= 1"),
    ("eval.ngram_max_n=0", "eval.ngram_max_n=0 must be >= eval.ngram_min_n=1"),
    ("eval.tie_tolerance=-1", "eval.tie_tolerance must be >= 0"),
    ("eval.set_defs.code.skip=-1", "eval.set_defs.code.skip must be >= 0"),
    ("plan.serving.max_draft_length=0", "plan.serving.max_draft_length must be >= 1"),
    ("plan.serving.tensor_parallel_size=0", "plan.serving.tensor_parallel_size must be >= 1"),
    ("plan.template_tokens_per_turn=-1", "plan.template_tokens_per_turn must be >= 0"),
    ("plan.regenerate_batch_size=0", "plan.regenerate_batch_size must be >= 1"),
    ("plan.weight_memory_fraction=0", "plan.weight_memory_fraction must be in (0, 1]"),
    ("plan.dtypes=[]", "plan.dtypes is empty"),
    ("plan.calibration.prefill_efficiency=0", "plan.calibration.prefill_efficiency must lie in (0, 1]"),
    ("plan.calibration.decode_compute_efficiency=2", "plan.calibration.decode_compute_efficiency must lie"),
    ("plan.calibration.host_store_gbs=0", "plan.calibration.host_store_gbs must be > 0"),
    ("plan.calibration.disk_write_gbs=0", "plan.calibration.disk_write_gbs must be > 0"),
    (
        "plan.calibration.pcie_allreduce_batch_size=0",
        "plan.calibration.pcie_allreduce_batch_size must be >= 1",
    ),
    ("plan.calibration.nvlink_allreduce_us=-1", "plan.calibration.nvlink_allreduce_us must be >= 0"),
    ("plan.calibration.store_exposed_share=-0.1", "plan.calibration.store_exposed_share must be >= 0"),
    (
        "plan.calibration.regeneration_loop_efficiency=1.5",
        "plan.calibration.regeneration_loop_efficiency must lie in (0, 1]",
    ),
]


@pytest.mark.parametrize(("override", "message"), VALUE_CHECKS, ids=[o for o, _ in VALUE_CHECKS])
def test_a_value_out_of_range_fails_after_composition_naming_the_key(
    compose, override: str, message: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        compose(override)
    assert message in str(exc.value)


def test_the_shipped_configs_pass_every_value_check(compose) -> None:
    compose()
    compose("extract.backend=vllm", "extract.vllm.max_model_len=4096", "extract.max_length=2048")


def test_a_training_seed_is_refused_to_window_training(compose) -> None:
    with pytest.raises(ConfigError, match=r"trainer.seed=4: window training reads its batches in the order"):
        compose("trainer.features=window", "trainer.seed=4")
    cfg = compose("trainer.features=online", "trainer.seed=4")
    assert cfg.trainer.seed == 4 and cfg.seed == 0
    assert compose().trainer.seed is None


def test_a_share_of_the_training_split_is_refused_to_window_training(compose) -> None:
    with pytest.raises(ConfigError, match=r"trainer.train_fraction=0.5 .*window training never holds"):
        compose("trainer.features=window", "trainer.train_fraction=0.5")
    assert compose("trainer.features=online", "trainer.train_fraction=0.5").trainer.train_fraction == 0.5


def test_vllm_context_must_hold_the_longest_prompt(compose) -> None:
    with pytest.raises(
        ConfigError, match="extract.vllm.max_model_len=1024 must exceed extract.max_length=2048"
    ):
        compose("extract.backend=vllm", "extract.vllm.max_model_len=1024")
    compose("extract.vllm.max_model_len=1024")  # read by the vLLM backend only


# ---- issue 18, item 4: settings that failed late or not at all ------------------------------------------


def test_a_negative_learning_rate_fails_at_composition(compose) -> None:
    """It used to end in AdamW's traceback, after data, model and logger were built."""
    with pytest.raises(ConfigError, match=r"trainer.lr must be > 0, got -0.001"):
        compose("trainer.lr=-1e-3")


def test_a_one_token_draft_vocabulary_is_refused(compose) -> None:
    """It used to train 'successfully' to loss 0 and accuracy 1.0: a head that can only propose one token."""
    with pytest.raises(ConfigError, match=r"draft.vocab_size must be >= 2, got 1.*cannot draft"):
        compose("draft.vocab_size=1")
    assert compose("draft.vocab_size=2").draft.vocab_size == 2


def test_missing_gpus_are_reported_before_anything_else(compose, tmp_path: Path, monkeypatch) -> None:
    """On a machine without the GPUs the GPU message comes first: before the global batch, before the shards."""
    from eaglet.train.run import run_training

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cfg = compose(
        "model=tiny_llama",
        "hardware=b200_nvl8",
        "trainer.global_batch_tokens=1000",  # not a multiple of 8 x 16384
        f"extract.output_dir={tmp_path / 'no_shards'}",
        f"paths.output_dir={tmp_path}",
    )
    with pytest.raises(ConfigError, match=r"hardware=b200_nvl8 needs 8 x B200 GPU\(s\).*no CUDA GPU"):
        run_training(cfg, tmp_path / "run")


# ---- issue 18, item 5: evaluation settings ---------------------------------------------------------------


def test_zero_prompts_per_set_names_the_key(compose) -> None:
    """It used to report a false cause: 'no records after the first 7000' in a file of 7,473."""
    with pytest.raises(ConfigError, match=r"eval.prompts_per_set must be >= 1, got 0"):
        compose("eval.prompts_per_set=0")


def test_a_set_of_zero_prompts_names_the_config_key(compose) -> None:
    """It used to name an internal argument (max_records)."""
    with pytest.raises(ConfigError, match=r"eval.set_defs.math.count must be >= 1, got 0"):
        compose("eval.set_defs.math.count=0")


def test_a_prompt_set_is_added_from_the_command_line(compose) -> None:
    from eaglet.config.eval_sets import eval_set_defs
    from eaglet.config.schema import EvalSetConfig

    cfg = compose("+eval.set_defs.z.path=/x.jsonl", "eval.sets=[z]")
    assert eval_set_defs(cfg.eval)["z"] == EvalSetConfig(path="/x.jsonl")  # skip, count: the defaults
    cfg = compose("+eval.set_defs.z.path=/x.jsonl", "+eval.set_defs.z.skip=5", "+eval.set_defs.z.count=3")
    assert eval_set_defs(cfg.eval)["z"] == EvalSetConfig(path="/x.jsonl", skip=5, count=3)
    assert eval_set_defs(cfg.eval)["math"].path.endswith("/gsm8k_train.jsonl")  # shipped sets resolve


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+eval.set_defs.z.count=3"], "eval.set_defs.z.path is not set"),
        (
            ["+eval.set_defs.z.path=/x.jsonl", "+eval.set_defs.z.count=0"],
            "eval.set_defs.z.count must be >= 1",
        ),
        (["+eval.set_defs.z.path=/x.jsonl", "+eval.set_defs.z.skip=-2"], "eval.set_defs.z.skip must be >= 0"),
        (
            ["+eval.set_defs.z.path=/x.jsonl", "+eval.set_defs.z.cont=3"],
            "eval.set_defs.z.cont is not a setting",
        ),
        (["+eval.set_defs.z.path=/x.jsonl", "+eval.set_defs.z.count=many"], "eval.set_defs.z.count"),
        (["+eval.set_defs.z=/x.jsonl"], "eval.set_defs.z must be a prompt set"),
        (["eval.sets=[code,zz]"], "eval.sets names 'zz', which is not one of"),
    ],
)
def test_an_added_prompt_set_is_validated(compose, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        compose(*overrides)
    assert message in str(exc.value)
