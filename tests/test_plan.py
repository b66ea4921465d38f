"""The planner: each cost formula against hand-computed values on small inputs, the CLI end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from eaglet.config.schema import DraftConfig, HardwareConfig, ModelConfig, PlanConfig, TrainerConfig
from eaglet.errors import ConfigError, DataError
from eaglet.plan.acceptance import AcceptanceCurve, acceptance_curve, conditional_from_rates
from eaglet.plan.benchmarks import number, parse_benchmarks
from eaglet.plan.configs import default_plan, load_draft, load_hardware, load_model
from eaglet.plan.data_size import DataSize, estimate_data_size
from eaglet.plan.disk import ITEMSIZE, estimate_disk, shard_bytes_per_token
from eaglet.plan.extraction import (
    estimate_extraction,
    estimate_regeneration,
    place_target,
    prefill_seconds_per_token,
)
from eaglet.plan.serving import predicted_speedup, serving_point
from eaglet.plan.target_cost import expected_distinct_experts, forward_weight_bytes, ring_allreduce_seconds
from eaglet.plan.training import (
    LOSS_BYTES_PER_LOGIT,
    LOSS_BYTES_PER_LOGIT_COMPILED,
    TEACHER_BYTES_PER_LOGIT,
    HeadShape,
    SmallKernelCosts,
    attention_context,
    calibrated_efficiency,
    estimate_training,
    loss_bytes_per_token,
    training_flops_per_token,
)
from eaglet.shards.layout import shard_dir

ROOT = Path(__file__).resolve().parents[1]
TINY_DRAFT = DraftConfig(
    hidden_size=4, num_attention_heads=1, num_key_value_heads=1, head_dim=4, intermediate_size=8
)


def tiny_model(**overrides) -> ModelConfig:
    fields = dict(
        name="tiny", architecture="llama", num_layers=2, hidden_size=4, num_attention_heads=1,
        num_key_value_heads=1, head_dim=4, intermediate_size=8, vocab_size=10, total_params_b=1e-7,
        active_params_b=1e-7, weight_bits=16,
    )  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def one_device(**overrides) -> HardwareConfig:
    fields = dict(name="box", accelerator="gpu", devices=1, memory_gb_per_device=80.0, bf16_tflops=1e6,
                  memory_bandwidth_gbs=1000.0, interconnect="nvlink", interconnect_bandwidth_gbs=100.0)  # fmt: skip
    return HardwareConfig(**{**fields, **overrides})


# ---- formulas ----------------------------------------------------------------------------------------


def test_distinct_experts_hand_value_and_limits():
    assert expected_distinct_experts(4, 2, 2) == pytest.approx(3.0)  # 4 · (1 − (1/2)²)
    for experts, k in [(384, 8), (256, 8), (8, 2)]:
        assert expected_distinct_experts(experts, k, 1) == pytest.approx(k)  # one token: its k experts
        assert expected_distinct_experts(experts, k, 10**6) == pytest.approx(experts)  # many tokens: all
    assert expected_distinct_experts(0, 0, 5) == 0.0  # dense


def test_moe_forward_reads_the_distinct_experts():
    # 2 layers, the first dense: one MoE layer of 4 experts of 3·4·2 = 24 parameters, top-1.
    # Active 100 parameters = 76 always read + 1 routed expert; bf16.
    model = tiny_model(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=2, first_k_dense_replace=1)
    assert forward_weight_bytes(model, 1) == pytest.approx((76 + 24) * 2)
    assert forward_weight_bytes(model, 2) == pytest.approx((76 + 1.75 * 24) * 2)  # 4 · (1 − 0.75²) experts
    int4_experts = dataclasses.replace(model, weight_bits=4, dense_weight_bits=16)
    assert forward_weight_bytes(int4_experts, 1) == pytest.approx(76 * 2 + 24 * 0.5)


def test_ring_allreduce_bandwidth_term():
    assert ring_allreduce_seconds(1000, 4, 1.0) == pytest.approx(2 * 3 / 4 * 1000 / 1e9)
    assert ring_allreduce_seconds(1000, 1, 1.0) == 0.0


def test_shard_bytes_per_token_and_disk():
    model = tiny_model(hidden_size=8)
    assert shard_bytes_per_token(model, "bfloat16") == 4 * 8 * 2 + 5  # 3 aux + last, bf16, id + mask
    assert shard_bytes_per_token(model, "float32") == 4 * 8 * 4 + 5
    assert (
        shard_bytes_per_token(dataclasses.replace(model, aux_layer_ids=[0, 1]), "bfloat16") == 3 * 8 * 2 + 5
    )
    disk = estimate_disk(model, one_device(disk_tb=1e-9), "bfloat16", tokens=10, conversations=2)
    assert disk.shard_bytes == 69 * 10 + 16 * 2  # + an int64 offset and sample id per sequence
    assert disk.target_head_bytes == 2 * (2 * 10 + 1) * 8  # embedding + lm_head + norm, bf16
    assert disk.fits is False  # 1 kB disk
    assert estimate_disk(model, one_device(), "bfloat16", 10, 2).fits is None  # disk size unknown
    with pytest.raises(ConfigError, match="unknown shard dtype"):
        shard_bytes_per_token(model, "int8")


def test_disk_dtypes_are_the_stored_ones():
    from eaglet.shards.format import STORED_DTYPES

    assert set(ITEMSIZE) == set(STORED_DTYPES)
    assert all(ITEMSIZE[name] == dtype.itemsize for name, dtype in STORED_DTYPES.items())


def test_training_flops_per_token_hand_value():
    shape = HeadShape(target_hidden=4, target_vocab=10, num_aux=3, draft=TINY_DRAFT, draft_vocab_size=5,
                      ttt_steps=2, lm_head_trainable=False)  # fmt: skip
    # Every position: fc 3·4·4 = 48 params, 4 · 48 = 192; k, v from 2·4 = 8 inputs to 2 · 4 (64), 6 · 64 = 384.
    # Layer: q 32, k v 64, o 16, MLP 3·4·8 = 96: 208. A row: 6 · (2 · 208 − 64) = 2112, plus attention over
    # 6 keys at both steps, 2 · 14 · 1 head · 4 dims · 6 = 672: 2784, at half the positions: 1392.
    # Frozen lm_head 4·5 = 20 params, 2 steps at half the positions: 4 · 20 · 2 · 0.5 = 80.
    # Teacher over the draft vocab: 2 · 4 · 5 · 0.5 = 20. Total 192 + 384 + 1392 + 80 + 20.
    assert training_flops_per_token(shape, loss_fraction=0.5, attention_context=6) == pytest.approx(2068)
    trainable = dataclasses.replace(shape, lm_head_trainable=True)
    assert training_flops_per_token(trainable, loss_fraction=0.5, attention_context=6) == pytest.approx(
        2068 + 2 * 20 * 2 * 0.5
    )
    every_row = training_flops_per_token(shape, loss_fraction=0.5, attention_context=6, row_fraction=1.0)
    assert every_row == pytest.approx(2068 + 1392)


@pytest.mark.parametrize(
    ("ttt_steps", "trainable", "fused"), [(1, False, True), (3, False, False), (3, True, True)]
)
def test_training_flops_match_what_the_trainer_multiplies(ttt_steps: int, trainable: bool, fused: bool):
    """The matmul FLOPs of one TTT forward + backward (torch's FLOP counter) equal the planner's formula."""
    from torch.utils.flop_counter import FlopCounterMode

    from eaglet.model.draft_head import Eagle3DraftHead
    from eaglet.train.ttt import ttt_forward

    torch.manual_seed(0)
    draft = DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48)  # fmt: skip
    target_hidden, vocab, draft_vocab, doc, prompt, docs = 24, 64, 40, 32, 10, 3
    head = Eagle3DraftHead(
        draft, target_hidden_size=target_hidden, vocab_size=vocab, draft_vocab_size=draft_vocab
    )
    used = torch.randperm(vocab)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(torch.randn(vocab, 32), torch.randn(vocab, 32), used - torch.arange(draft_vocab), t2d,
                          lm_head_trainable=trainable)  # fmt: skip
    t = doc * docs
    batch = {
        "input_ids": torch.randint(0, vocab, (t,)),
        "loss_mask": (torch.arange(doc) >= prompt).repeat(docs),
        "document_ids": torch.arange(docs).repeat_interleave(doc),
        "position_ids": torch.arange(doc).repeat(docs),
        "aux_hidden_states": torch.randn(t, 3 * target_hidden),
        "last_hidden_state": torch.randn(t, target_hidden),
    }
    with FlopCounterMode(display=False) as counter:
        out = ttt_forward(
            head, batch, target_norm_weight=torch.ones(target_hidden), target_norm_eps=1e-5,
            target_lm_head=torch.randn(vocab, target_hidden), ttt_steps=ttt_steps, step_loss_decay=1.0,
            full_vocab_argmax=False, attention="sdpa", fused_loss=fused,
        )  # fmt: skip
        out.loss.backward()
    # Linear layers, lm_head and teacher run as aten.mm; attention (SDPA, the diagonal's bmm) is left out.
    counted = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    shape = HeadShape(target_hidden=target_hidden, target_vocab=vocab, num_aux=3, draft=draft,
                      draft_vocab_size=draft_vocab, ttt_steps=ttt_steps, lm_head_trainable=trainable)  # fmt: skip
    # Each document: doc − prompt loss tokens; its rows reach K − 1 further back (see eaglet.train.ttt).
    loss, rows = docs * (doc - prompt) / t, docs * (doc - prompt + ttt_steps - 1) / t
    assert counted == pytest.approx(
        t * training_flops_per_token(shape, loss_fraction=loss, attention_context=0, row_fraction=rows)
    )


def test_loss_bytes_per_token():
    shape = HeadShape(target_hidden=4, target_vocab=10, num_aux=3, draft=TINY_DRAFT, draft_vocab_size=5,
                      ttt_steps=2, lm_head_trainable=False)  # fmt: skip
    expected = 5 * 0.5 * (2 * LOSS_BYTES_PER_LOGIT + TEACHER_BYTES_PER_LOGIT)
    assert loss_bytes_per_token(shape, loss_fraction=0.5) == pytest.approx(expected)
    trainable = dataclasses.replace(shape, lm_head_trainable=True)
    assert loss_bytes_per_token(trainable, loss_fraction=0.5) > expected  # it keeps the logit gradients
    compiled = dataclasses.replace(shape, compiled_loss=True)  # one fused graph per chunk: fewer passes
    assert loss_bytes_per_token(compiled, loss_fraction=0.5) == pytest.approx(
        5 * 0.5 * (2 * LOSS_BYTES_PER_LOGIT_COMPILED + TEACHER_BYTES_PER_LOGIT)
    )


def test_attention_context():
    gpu, cpu = one_device(tokens_per_device=8192), one_device(accelerator="cpu", tokens_per_device=8192)
    assert attention_context(gpu, 300.0, "row") == 8192  # a dense masked kernel scores the whole packed row
    assert attention_context(gpu, 300.0, "document") == 300.0
    assert attention_context(cpu, 300.0, "row") == 300.0  # the CPU path tiles by document
    with pytest.raises(ConfigError, match="training_attention"):
        attention_context(gpu, 300.0, "dense")


def test_compiled_layer_has_its_own_efficiency():
    cal = default_plan().calibration
    assert calibrated_efficiency(cal, TrainerConfig(compile=False)) == cal.training_efficiency
    assert calibrated_efficiency(cal, TrainerConfig(compile=True)) == cal.training_efficiency_compiled


def test_training_time_per_epoch():
    model, draft = tiny_model(), dataclasses.replace(TINY_DRAFT, vocab_size=5)
    trainer = TrainerConfig(ttt_steps=2, lm_head_trainable=False, global_batch_tokens=8192, val_fraction=0.0)
    shape = HeadShape.of(model, draft, trainer)
    # 1 MFLOP/s at half efficiency; 6-token rows = the attention context; bandwidth plenty.
    hardware = one_device(bf16_tflops=1e-6, tokens_per_device=6, memory_bandwidth_gbs=1e9)
    common = dict(tokens=1000, loss_fraction=0.5, mean_document_context=0.0, attention_keys="row")
    estimate = estimate_training(shape, hardware, trainer, efficiency=0.5, bandwidth_efficiency=1.0, **common)
    assert estimate.tokens_per_second == pytest.approx(0.5e6 / 2068, rel=1e-6)
    assert estimate.seconds_per_epoch == pytest.approx(1000 / (0.5e6 / 2068), rel=1e-6)
    # An epoch of a quarter of the sequences (trainer.train_fraction) takes a quarter of the time.
    quarter = dataclasses.replace(trainer, train_fraction=0.25)
    assert estimate_training(
        shape, hardware, quarter, efficiency=0.5, bandwidth_efficiency=1.0, **common
    ).seconds_per_epoch == pytest.approx(estimate.seconds_per_epoch / 4)
    # Starved of bandwidth (1 B/s at half), a token takes its loss bytes' time on top.
    starved = dataclasses.replace(hardware, memory_bandwidth_gbs=1e-9)
    slow_memory = estimate_training(
        shape, starved, trainer, efficiency=0.5, bandwidth_efficiency=0.5, **common
    )
    assert 1 / slow_memory.tokens_per_second == pytest.approx(
        2068 / 0.5e6 + slow_memory.loss_bytes_per_token / 0.5
    )
    # Eight devices on a slow link: each step waits for the fp32 gradients (2·7/8 · 4 bytes · params).
    eight = dataclasses.replace(hardware, devices=8, bf16_tflops=1.0, interconnect_bandwidth_gbs=1e-6)
    slow = estimate_training(shape, eight, trainer, efficiency=0.5, bandwidth_efficiency=1.0, **common)
    assert slow.allreduce_seconds_per_step == pytest.approx(2 * 7 / 8 * 4 * shape.trainable_params / 1e3)
    assert slow.tokens_per_second == pytest.approx(
        slow.optimizer_step_tokens / slow.allreduce_seconds_per_step
    )
    with pytest.raises(ConfigError, match="training_bandwidth_efficiency"):
        estimate_training(shape, hardware, trainer, efficiency=0.5, bandwidth_efficiency=0.0, **common)


def test_small_kernels_add_per_token_and_per_micro_batch_on_gpus_only():
    model, draft = tiny_model(), dataclasses.replace(TINY_DRAFT, vocab_size=5)
    # Two micro-batches of 6 tokens a step, three TTT steps
    trainer = TrainerConfig(ttt_steps=3, lm_head_trainable=False, global_batch_tokens=12, val_fraction=0.0)
    shape = HeadShape.of(model, draft, trainer)
    common = dict(
        tokens=1200, loss_fraction=0.5, mean_document_context=3.0, efficiency=0.5, bandwidth_efficiency=1.0
    )
    small = SmallKernelCosts(token_step_us=2.0, microbatch_step_ms=5.0)
    for accelerator, expected_extra in (("gpu", 12 * 3 * 2e-6 + 2 * 3 * 5e-3), ("cpu", 0.0)):
        hardware = one_device(accelerator=accelerator, bf16_tflops=1e-3, tokens_per_device=6)
        plain = estimate_training(shape, hardware, trainer, **common)
        costed = estimate_training(shape, hardware, trainer, small_kernels=small, **common)
        assert costed.compute_seconds_per_step - plain.compute_seconds_per_step == pytest.approx(
            expected_extra
        )
        assert costed.seconds_per_epoch == pytest.approx(100 * costed.compute_seconds_per_step)
    assert SmallKernelCosts.of(default_plan().calibration).token_step_us > 0


def test_speedup_of_a_memory_bound_dense_target():
    # One device, no all-reduce, no KV cache, compute negligible: speedup = τ · W / (K · D + W), W and D the
    # bytes of the target's and the draft's weights.
    model = tiny_model(active_params_b=1.0, total_params_b=1.0, hidden_size=8)
    draft = DraftConfig(
        hidden_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=8, intermediate_size=16
    )
    plan = dataclasses.replace(
        default_plan(), serving=dataclasses.replace(default_plan().serving, context_tokens=0)
    )
    target_bytes = 2e9
    draft_bytes = 2 * (3 * 8 * 8 + 16 * 3 * 8 + 8 * 8 + 3 * 8 * 16 + 8 * 32)  # fc, qkv, o, MLP, lm_head
    speedup = predicted_speedup(model, one_device(), draft, 32, 2.5, 2, plan)
    assert speedup == pytest.approx(2.5 * target_bytes / (2 * draft_bytes + target_bytes))


def test_moe_verification_costs_more_than_dense():
    plan = default_plan()
    kimi, llama = load_model("kimi_k2_5"), load_model("llama3_1_8b")
    hw = load_hardware("b200_nvl8")
    moe = serving_point(kimi, hw, load_draft("kimi_k2_5"), 32000, 2.5, 3, plan)
    dense = serving_point(llama, hw, load_draft("llama3_1_8b"), 32000, 2.5, 3, plan)
    # Kimi-K2.5: 60 MoE layers of 384 experts (3·7168·2048 parameters, INT4), the other active ones bf16;
    # 4 tokens read 384·(1 − (1 − 8/384)⁴) ≈ 31 experts per layer instead of 8 (the KV cache adds ~1%).
    expert = 3 * 7168 * 2048
    dense_bytes = (32e9 - 60 * 8 * expert) * 2
    distinct = 384 * (1 - (1 - 8 / 384) ** 4)
    expected = (dense_bytes + 60 * distinct * expert / 2) / (dense_bytes + 60 * 8 * expert / 2)
    assert moe.verify.memory / moe.plain.memory == pytest.approx(expected, rel=0.02)
    assert dense.verify.memory / dense.plain.memory < 1.01  # the same weights, a little more KV


def test_pcie_allreduce_reproduces_the_measured_share():
    plan = default_plan()
    plan = dataclasses.replace(
        plan, serving=dataclasses.replace(plan.serving, context_tokens=0, batch_size=1)
    )
    kimi, pcie = load_model("kimi_k2_5"), load_hardware("rtx_pro6000_x8")
    plain = serving_point(kimi, pcie, load_draft("kimi_k2_5"), 32000, 1.0, 1, plan).plain
    assert plain.allreduce / plain.seconds == pytest.approx(plan.calibration.pcie_allreduce_share)


def test_extraction_allreduce_scales_with_the_link():
    plan, kimi = default_plan(), load_model("kimi_k2_5")
    _, pcie = prefill_seconds_per_token(kimi, load_hardware("rtx_pro6000_x8"), 8, 0.0, plan)
    _, nvlink = prefill_seconds_per_token(kimi, load_hardware("b200_nvl8"), 8, 0.0, plan)
    assert pcie / nvlink == pytest.approx(900 / 50)
    # 2 per layer of H bf16 activations, ring over 8 devices at 50 GB/s.
    assert pcie == pytest.approx(2 * 61 * 2 * 7 / 8 * 7168 * 2 / 50e9)


def calibrated(**overrides) -> PlanConfig:
    plan = default_plan()
    return dataclasses.replace(plan, calibration=dataclasses.replace(plan.calibration, **overrides))


def sized(
    tokens: float = 100.0, generated: float = 0.0, prefill: float = 0.0, context: float = 0.0
) -> DataSize:
    return DataSize(conversations=1, tokens=tokens, loss_fraction=1.0, mean_context=context,
                    generated_tokens=generated, prefill_tokens=prefill, source="test")  # fmt: skip


def test_extraction_stores_beside_the_forward():
    # 200 FLOPs a token at 1 kFLOP/s × 0.5: a 0.4 s forward. 69 shard bytes a token (3 aux + last, H 8, bf16,
    # + 5): 0.25 s at the host's 276 B/s; the forward waits for 40% of it.
    model = tiny_model(hidden_size=8)
    plan = calibrated(prefill_efficiency=0.5, host_store_gbs=276e-9, store_exposed_share=0.4)
    fast_disk = one_device(bf16_tflops=1e-9, disk_write_gbs=1e3)
    estimate = estimate_extraction(
        model, fast_disk, place_target(model, fast_disk, plan), sized(), plan, "bfloat16"
    )
    assert (estimate.forward, estimate.host_store) == pytest.approx((0.4, 0.25))
    assert estimate.store == estimate.host_store  # a disk faster than the host stores no faster than the host
    assert estimate.seconds_per_token == pytest.approx(0.4 + 0.4 * 0.25)  # not 0.4 + 0.25: they overlap
    assert estimate.tokens_per_second == pytest.approx(2.0) and estimate.bottleneck == "forward"
    # Two replicas on one 69 B/s disk: each writes at half of it, 2 s a token, longer than its forward side
    # (0.4 + 0.4 · 2): the machine stores at the disk's rate, one token a second.
    two = one_device(devices=2, bf16_tflops=1e-9, disk_write_gbs=69e-9)
    slow = estimate_extraction(model, two, place_target(model, two, plan), sized(), plan, "bfloat16")
    assert (slow.replicas, slow.disk, slow.seconds_per_token) == (2, pytest.approx(2.0), pytest.approx(2.0))
    assert slow.tokens_per_second == pytest.approx(1.0) and slow.bottleneck == "disk"
    # No disk rate in the hardware config: the calibrated default.
    unknown = one_device(bf16_tflops=1e-9)
    assumed = estimate_extraction(
        model, unknown, place_target(model, unknown, plan), sized(), plan, "bfloat16"
    )
    assert assumed.disk_assumed and assumed.disk_write_gbs == plan.calibration.disk_write_gbs


def test_regeneration_runs_at_the_loop_share_of_its_steps():
    # One device of 1 kB/s at full bandwidth, compute plenty: a step over 2 sequences reads the 200 weight bytes
    # and 2 × 10 tokens of KV cache (2 · 2 · 4 bf16 values · 2 layers = 32 B each): 0.84 s for 2 new tokens.
    model = tiny_model()
    hardware = one_device(memory_bandwidth_gbs=1e-6, bf16_tflops=1e6)

    def plan_at(loop: float) -> PlanConfig:
        shares = calibrated(decode_bandwidth_efficiency=1.0, regeneration_loop_efficiency=loop)
        return dataclasses.replace(shares, regenerate_batch_size=2)

    plan = plan_at(1.0)
    data = sized(generated=100.0, context=10.0)
    steps = estimate_regeneration(model, hardware, place_target(model, hardware, plan), data, plan)
    assert steps.batch == 2 and steps.step_tokens_per_second == pytest.approx(2 / 0.84)
    assert steps.seconds == pytest.approx(steps.prefill_seconds + 100 * 0.84 / 2)
    quarter = plan_at(0.25)
    loop = estimate_regeneration(model, hardware, place_target(model, hardware, quarter), data, quarter)
    assert loop.seconds == pytest.approx(4 * steps.seconds)


def test_acceptance_curve(tmp_path: Path):
    assert AcceptanceCurve((0.5,), "").tau(2) == pytest.approx(1 + 0.5 + 0.25)
    assert conditional_from_rates([0.8, 0.4, 0.2]) == pytest.approx((0.8, 0.5, 0.5))
    results = {"sets": {
        "a": {"results": {"eaglet": {"steps": 30, "acceptance_rates": [0.6, 0.3]}}},
        "b": {"results": {"eaglet": {"steps": 10, "acceptance_rates": [1.0, 0.7]}}},
    }}  # fmt: skip
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(results))
    serving = dataclasses.replace(default_plan().serving, acceptance_from=str(path))
    curve = acceptance_curve(serving)
    assert curve.tau(2) == pytest.approx(1 + 0.7 + 0.4)  # step-weighted rates (0.7, 0.4)
    assert curve.tau(3) == pytest.approx(1 + 0.7 + 0.4 + 0.4 * 0.4 / 0.7)  # the last conditional repeats
    with pytest.raises(DataError, match="no proposer 'other'"):
        acceptance_curve(dataclasses.replace(serving, proposer="other"))
    with pytest.raises(ConfigError, match="values in"):
        acceptance_curve(dataclasses.replace(default_plan().serving, acceptance=[1.5]))


def test_benchmark_tables_are_parsed(tmp_path: Path):
    md = tmp_path / "B.md"
    md.write_text(
        "## GPU\n\n### Training throughput — `python x.py shapes=a ttt=3` (a note)\n\n"
        "| date | K | tokens/s | MFU |\n|---|---|---|---|\n| d | 3 | 37,559 | 34% |\n"
    )
    (table,) = parse_benchmarks(md)
    assert (table.section, table.title, table.note) == ("GPU", "Training throughput", "a note")
    assert table.args() == {"shapes": "a", "ttt": "3"}
    assert number(table.rows[0]["tokens/s"]) == 37559 and number(table.rows[0]["MFU"]) == pytest.approx(0.34)
    md.write_text(md.read_text() + "| d | 3 | 1 |\n")
    with pytest.raises(DataError, match="3 cells under a header of 4"):
        parse_benchmarks(md)


def test_several_tables_under_one_heading(tmp_path: Path):
    """The side-by-side layout: a date line, then tables separated by blank lines, a column name twice."""
    md = tmp_path / "B.md"
    md.write_text(
        "## GPU\n\n### Side by side — `A=1 python x.py --shapes s --no-data`\n\n"
        "2026-11-29, GPU X, torch 2. Same batches (30-50% prompt).\n\n"
        "| path | verdict |\n|---|---|\n| flex | ok |\n\n"
        "| shape | tokens/s | ratio | peak | ratio |\n|---|---|---|---|---|\n| s | 10 | 1.0x | 2 | 0.5x |\n"
        "| s | 20 | 2.0x | 3 | 0.7x |\n\nA closing remark.\n"
    )
    checks, speed = parse_benchmarks(md)
    assert checks.columns == ["path", "verdict"] and len(checks.rows) == 1
    assert speed.columns == ["shape", "tokens/s", "ratio", "peak", "ratio (2)"]
    assert [row["ratio (2)"] for row in speed.rows] == ["0.5x", "0.7x"]
    assert speed.text.startswith("2026-11-29, GPU X") and speed.text == checks.text
    assert speed.argv() == ["--shapes", "s", "--no-data"]
    assert speed.has_columns("shape", "tokens/s") and not checks.has_columns("tokens/s")


# ---- data size -----------------------------------------------------------------------------------------


def data_size(cfg) -> DataSize:
    """estimate_data_size on the slices plan.py passes it."""
    cfg = OmegaConf.to_object(cfg)
    return estimate_data_size(
        cfg.plan,
        cfg.dataset,
        cfg.extract,
        shard_dir(cfg.paths.data_dir, cfg.model.name, cfg.dataset.name, cfg.extract.output_dir),
    )


def _write_jsonl(path: Path) -> None:
    records = [{"id": str(i), "conversations": [{"role": "user", "content": "u" * 40},
                                                {"role": "assistant", "content": "a" * 80}]} for i in range(2)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_data_size_from_files(compose, tmp_path: Path):
    data = tmp_path / "d.jsonl"
    _write_jsonl(data)
    base = [
        "dataset=jsonl",
        f"dataset.paths=[{data}]",
        f"paths.data_dir={tmp_path}",
        "plan.chars_per_token=4",
    ]
    # user 40/4 + 6 = 16 tokens, assistant 80/4 + 6 = 26: 42 per conversation, 26 trained.
    size = data_size(compose(*base, "extract.regenerate.enabled=false"))
    assert (size.conversations, size.tokens, size.generated_tokens) == (2, 84, 0)
    assert size.loss_fraction == pytest.approx(26 / 42)
    assert size.mean_context == pytest.approx(42 * 43 / 2 / 42)
    # Regenerated: the answer is as long as the original (20), capped at 8 new tokens, after a 16-token prompt.
    regen = data_size(
        compose(*base, "extract.regenerate.enabled=true", "extract.regenerate.max_new_tokens=8")
    )
    assert (regen.tokens, regen.generated_tokens, regen.prefill_tokens) == (2 * 30, 2 * 8, 2 * 16)
    more = data_size(compose(*base, "extract.regenerate.enabled=false", "plan.conversations=1000"))
    assert (more.conversations, more.tokens) == (1000, 1000 * 42)


def test_data_size_needs_files_or_overrides(compose, tmp_path: Path):
    missing = ["dataset=jsonl", f"dataset.paths=[{tmp_path / 'none.jsonl'}]"]
    with pytest.raises(ConfigError, match="cannot size the data"):
        data_size(compose(*missing))
    size = data_size(compose(*missing, "plan.tokens=1000000"))
    assert size.tokens == 1_000_000 and size.loss_fraction == 1.0
    with pytest.raises(ConfigError, match="plan.tokens must be > 0"):
        data_size(compose(*missing, "plan.tokens=0"))


def test_plan_config_defaults_compose(compose):
    cfg = OmegaConf.to_object(compose())
    assert isinstance(cfg.plan, PlanConfig)
    assert cfg.plan.calibration.training_efficiency == default_plan().calibration.training_efficiency


# ---- CLI -----------------------------------------------------------------------------------------------


def run_plan(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "COLUMNS": "200"}
    command = [sys.executable, str(ROOT / "plan.py"), *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_cli_motivating_scenario(tmp_path: Path):
    hardware = ["rtx_pro6000_x8", "b200_nvl8", "b300_nvl8"]
    proc = run_plan(
        tmp_path,
        "model=kimi_k2_5",
        "dataset=sharegpt",
        "plan.conversations=600000",
        f"plan.compare=[{','.join(hardware)}]",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for text in ["time and disk", "predicted serving speedup", "assumptions", "57,349 B/token", *hardware]:
        assert text in out
    verdict = out.strip().splitlines()[-1]
    assert "GPU-hours" in out and ("Under 24 h" in out or "None finishes" in out), verdict


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["plan.compare=[rtx_pro6000_x8,no_such_box]"], "unknown hardware 'no_such_box'"),
        (["hardware=b200_nvl8", "plan.tokens=0"], "plan.tokens must be > 0"),
        (["hardware=cpu"], "hardware 'cpu' has no bf16_tflops"),
        (["hardware=h200_x1", "dataset=jsonl"], "pass them as dataset.paths=[/data/a.jsonl"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path: Path, overrides: list[str], message: str):
    proc = run_plan(tmp_path, "model=kimi_k2_5", *overrides)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr


def test_cli_sizes_a_jsonl_dataset_without_files_from_plan_tokens(tmp_path: Path):
    proc = run_plan(tmp_path, "hardware=h200_x1", "dataset=jsonl", "plan.tokens=1000000")
    assert proc.returncode == 0, proc.stderr
    assert "plan overrides only" in proc.stdout and "dataset.paths=" in proc.stdout


@pytest.mark.e2e
def test_check_planner_meets_its_goal():
    """The calibration constants match their benchmark rows, and the held-out rows are predicted within ±25%."""
    command = [sys.executable, str(ROOT / "benchmarks" / "check_planner.py"), "append=0"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "within ±25%: yes" in proc.stdout and "OUT OF STEP" not in proc.stdout
