"""The planner's training, extraction and regeneration predictions against the H200 rows of BENCHMARKS.md.

    python benchmarks/check_planner.py             # print, and append the table to BENCHMARKS.md
    python benchmarks/check_planner.py append=0    # print only

Every measured number is read from the markdown tables of experiments/BENCHMARKS.md (the latest row of each
configuration), never typed in. The calibration constants of conf/plan/default.yaml come from one row
each (named below); this script recomputes them from those rows, to show the file is in step, and predicts
the other rows (held out). Goal: held-out predictions within ±25%.

Training: the eaglet rows of the "Side by side with speculators on one device" tables
(bench_gpu_side_by_side.py, the training code as it is), and the rows of "The head's training step alone"
(bench_train.py, SmolLM2-135M's 576-wide head on one H100). The eager layer's efficiency comes from one
Llama-3.1-8B row, the compiled layer's from another; the small kernels' time per TTT step (per token and per
micro-batch) from the narrow head's two compiled rows; the three are solved together, since each is net of the
others. Every other row is held out. The speculators rows measure another
implementation and are not predicted. The older "Training throughput" rows (bench_train.py) measured the
previous training code (masked attention over the whole packed row, every step at every position, the
teacher over the full vocab), which the planner no longer models: they stay in BENCHMARKS.md as history.

Extraction: the "Extraction throughput" rows with the shards' filesystem and write-rate columns
(bench_extract.py, the pipeline that stores beside the forward). The tmpfs row calibrates the forward
(prefill_efficiency), the host's storing rate (its write rate: host_store_gbs) and the share of storing the
forward waits for (store_exposed_share); the disk row is held out, predicted at its own measured write rate
(which also gives disk_write_gbs, the planner's default disk). The older rows, without those columns, measured
the previous pipeline (shards stored after the forward) and are not predicted.

Regeneration: the compiled greedy row of "Decode step of the generation engine" (bench_decode_step.py) gives
decode_bandwidth_efficiency (the bytes a step reads: the weights and every row's keys and values at its
context); the answers of the latest "The scale recipe's data and training on one H200" (recipes/smollm2_scale.py:
230K self-prompted and shared conversations, 44.6M new tokens) give regeneration_loop_efficiency, what the whole
loop reaches of those steps. The latest "Regeneration and extraction at scale" data stage (smollm2_gpu: 18K
shared conversations, many of several turns) is held out.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch
from bench_decode_step import SMOLLM2 as DECODE_SHAPE
from bench_extract import make_samples
from bench_extract import parse as parse_extract
from bench_gpu_side_by_side import VARIANTS
from bench_gpu_side_by_side import parse as parse_side_by_side
from bench_train import SHAPES
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import eaglet.config
from eaglet.config import check_config
from eaglet.config.schema import (
    EagletConfig,
    HardwareConfig,
    ModelConfig,
    PlanCalibrationConfig,
    PlanConfig,
    TrainerConfig,
)
from eaglet.errors import DataError
from eaglet.plan.benchmarks import BenchTable, number, parse_benchmarks
from eaglet.plan.configs import default_plan, load_draft, load_hardware, load_model
from eaglet.plan.data_size import DataSize, estimate_data_size
from eaglet.plan.extraction import (
    RegenerationEstimate,
    estimate_extraction,
    estimate_regeneration,
    place_target,
)
from eaglet.plan.serving import target_step
from eaglet.plan.target_cost import forward_flops_per_token
from eaglet.plan.training import (
    HeadShape,
    SmallKernelCosts,
    attention_context,
    calibrated_efficiency,
    device_seconds_per_token,
)
from eaglet.target_model import resolve_dtype

BENCH_FILE = Path(__file__).resolve().parents[1] / "experiments" / "BENCHMARKS.md"
SECTION = "NVIDIA H200"  # the rows checked, and the hardware config they ran on
MACHINE = "h200_x1"
SIDE_BY_SIDE = "Side by side with speculators on one device"
TRAINING_COLUMNS = ("shape", "K", "implementation", "lm_head", "tokens/s")
# The rows conf/plan/default.yaml's training efficiencies come from: (shape, K, implementation).
TRAINING_CALIBRATION = {
    ("llama3_1_8b", 3, "eaglet"): "training_efficiency",
    ("llama3_1_8b", 3, "eaglet_compiled"): "training_efficiency_compiled",
}
# The narrow head's step alone (bench_train.py, SmolLM2-135M's shapes, one H100): its two compiled rows give the
# small-kernel costs (training_token_step_us, training_microbatch_step_ms); the eager rows are held out.
HEAD_STEP = "The head's training step alone, eager and compiled, 16K and 32K micro-batches"
# The datasheet a row's machine cell names (one device of it)
HEAD_STEP_HARDWARE = {"H100": "h100_x8", "H200": "h200_x1"}
HEAD_STEP_COLUMNS = ("machine", "compiled", "micro-batch tokens", "tokens/s")
CALIBRATION_ROUNDS = 20  # the efficiencies and the small-kernel costs depend on each other a little
EXTRACTION = "Extraction throughput"
# The columns of the pipeline that stores beside the forward; older rows lack them.
EXTRACTION_COLUMNS = ("shards in", "disk write MB/s (tok/s)", "bare forward tok/s", "extraction tok/s")
DECODE_STEP = "Decode step of the generation engine"
DATA_STAGE = "Regeneration and extraction at scale"
SCALE_STAGE = "The scale recipe's data and training on one H200"
GOAL = 0.25
IN_STEP = 0.01  # a constant of conf/plan/default.yaml may differ this much from what its row implies
_LEAD = re.compile(r"^(?P<date>\d{4}-\d{2}-\d{2}), (?P<machine>.+?)\. ")
_PROMPT = re.compile(r"(?P<low>\d+)-(?P<high>\d+)% prompt")
_STAGE_REGEN = re.compile(r"(?P<turns>[\d,]+) assistant turns, (?P<new>[\d,]+) new tokens")
_STAGE_EXTRACT = re.compile(r"(?P<sequences>[\d,]+) sequences, (?P<tokens>[\d,]+) tokens")
_STAGE_COMPILE = re.compile(r"~?(?P<seconds>[\d.]+) s compiling")
_SCALE_ANSWERS = re.compile(r"(?P<turns>[\d,]+) turns, (?P<new>[\d,]+) new tokens")
_SCALE_COMPILE = re.compile(r"(?P<seconds>[\d.]+) s of it before the first token")
_SCALE_STORE = re.compile(
    r"(?P<sequences>[\d,]+) sequences, (?P<tokens>[\d,]+) tokens, \**(?P<answers>[\d,]+) answer tokens"
)
_SCALE_DATA_COMMAND = re.compile(r"`(?:python )?extract\.py (?P<args>[^`]*)`")
_STAGE_MACHINE = re.compile(r"^\d{4}-\d{2}-\d{2}, (?:one )?(?P<machine>[^,(]+\([^)]*\))")


def calibration_note(name: str, configured: float, implied: float, row: str) -> tuple[str, bool]:
    in_step = abs(configured / implied - 1) <= IN_STEP
    state = "in step" if in_step else f"OUT OF STEP: set {name}: {implied:.3g} in conf/plan/default.yaml"
    return f"{name} {configured:.3g} (the {row} implies {implied:.3g}; {state})", in_step


def latest(tables: list[BenchTable], title: str) -> list[BenchTable]:
    return [t for t in tables if t.section.startswith(SECTION) and t.title == title]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a measured training row ran: the head's shape and settings, and its documents."""

    shape: str
    ttt: int
    trainable: bool
    compile: bool
    draft_vocab: int
    batch_tokens: int
    doc_tokens: int
    prompt_share: float  # mean share of each document before its loss mask

    @property
    def loss_fraction(self) -> float:
        return 1.0 - self.prompt_share


@dataclasses.dataclass(frozen=True)
class TrainingRow:
    """One measured row of training throughput, with the run's settings."""

    spec: StepSpec
    what: str  # the row's name in the check's table
    key: tuple  # what the calibration rows are named by
    tokens_per_s: float
    machine: str
    hardware: HardwareConfig


def training_rows(tables: list[BenchTable], h200: HardwareConfig) -> tuple[list[TrainingRow], list[str]]:
    """The latest eaglet row of each (shape, K, implementation) of the side-by-side tables, and what was left
    out (and why)."""
    rows: dict[tuple, tuple[dict[str, str], BenchTable, StepSpec]] = {}
    for table in latest(tables, SIDE_BY_SIDE):
        if not table.has_columns(*TRAINING_COLUMNS):
            continue  # the correctness and data-path tables under the same heading
        opts = parse_side_by_side(table.argv())
        prompt = _PROMPT.search(table.text)
        if prompt is None:
            raise DataError(
                f"{BENCH_FILE}: no 'NN-MM% prompt' in the text above the table of `{table.command}`"
            )
        share = (int(prompt["low"]) + int(prompt["high"])) / 200
        for row in table.rows:
            key = (row["shape"], int(row["K"]), row["implementation"])
            variant = VARIANTS.get(key[2])
            spec = StepSpec(
                row["shape"],
                int(row["K"]),
                bool(variant and variant.trainable),
                bool(variant and variant.compile),
                opts.draft_vocab,
                opts.batch_tokens,
                opts.doc_tokens,
                share,
            )
            rows[key] = (row, table, spec)
    kept, left_out = [], []
    for key, (row, table, spec) in rows.items():
        variant = VARIANTS.get(key[2])
        if variant is None or variant.impl != "eaglet":
            left_out.append(f"{key[2]} {key[0]} K={key[1]} (another implementation)")
        elif variant.attention != "auto":
            left_out.append(f"{key[2]} {key[0]} K={key[1]} (attention={variant.attention}: not calibrated)")
        elif row["tokens/s"].startswith("error"):
            left_out.append(f"{key[2]} {key[0]} K={key[1]} (failed: {row['tokens/s']})")
        else:
            lead = _LEAD.match(table.text)
            what = (
                f"training {key[0]} K={key[1]} {key[2]} (lm_head {row['lm_head']}), "
                f"{spec.batch_tokens:,}-token micro-batches of {spec.doc_tokens:,}-token documents"
            )
            machine = lead["machine"] if lead else "?"
            kept.append(TrainingRow(spec, what, key, number(row["tokens/s"]), machine, h200))
    return kept, left_out


def head_step_rows(tables: list[BenchTable]) -> list[TrainingRow]:
    """The latest rows of the narrow head's step alone (bench_train.py), keyed (shape, K, compiled, tokens)."""
    found = [t for t in tables if t.title == HEAD_STEP and t.has_columns(*HEAD_STEP_COLUMNS)]
    if not found:
        raise DataError(f"{BENCH_FILE} lacks the table '{HEAD_STEP}' (the small-kernel calibration rows)")
    table = found[-1]
    args = table.args()
    doc = int(args["doc_tokens"])
    rows = []
    for row in table.rows:
        cards = [card for card in HEAD_STEP_HARDWARE if card in row["machine"]]
        if len(cards) != 1:
            raise DataError(
                f"{BENCH_FILE}: '{HEAD_STEP}' row on {row['machine']!r}: name one of {list(HEAD_STEP_HARDWARE)}"
            )
        one_device = dataclasses.replace(load_hardware(HEAD_STEP_HARDWARE[cards[0]]), devices=1)
        compiled = row["compiled"] == "yes"
        tokens = int(number(row["micro-batch tokens"]))
        # bench_train.py's documents: the first int(0.4 × doc_tokens) tokens of each are the prompt
        spec = StepSpec(
            args["shapes"],
            int(args["ttt"]),
            args["lm_head_trainable"] == "1",
            compiled,
            int(args["draft_vocab"]),
            tokens,
            doc,
            int(0.4 * doc) / doc,
        )
        head = "trainable" if spec.trainable else "frozen"
        what = (
            f"training {spec.shape} K={spec.ttt} {'compiled' if compiled else 'eager'} (lm_head {head}), "
            f"{tokens:,}-token micro-batches of {doc:,}-token documents, the head's step alone"
        )
        key = (spec.shape, spec.ttt, "compiled" if compiled else "eager", tokens)
        rows.append(TrainingRow(spec, what, key, number(row["tokens/s"]), row["machine"], one_device))
    return rows


def head_shape(spec: StepSpec) -> HeadShape:
    model, d = load_model(spec.shape), load_draft(spec.shape)
    bench = (
        d.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        d.intermediate_size,
        model.vocab_size,
    )
    if SHAPES[spec.shape] != bench:
        raise DataError(
            f"bench_train.SHAPES[{spec.shape!r}] = {SHAPES[spec.shape]} differs from "
            f"conf/draft/{spec.shape}.yaml and conf/model/{spec.shape}.yaml {bench}"
        )
    trainer = TrainerConfig(ttt_steps=spec.ttt, lm_head_trainable=spec.trainable, compile=spec.compile)
    return HeadShape.of(model, d, trainer, min(spec.draft_vocab, model.vocab_size))


def predicted_seconds(measured: TrainingRow, cal: PlanCalibrationConfig) -> tuple[float, float, float]:
    """(the planner's seconds per token for the row, a micro-batch's fixed time shared out; its FLOPs; the
    seconds of its loss bytes)."""
    spec, shape = measured.spec, head_shape(measured.spec)
    hardware = dataclasses.replace(measured.hardware, tokens_per_device=spec.batch_tokens)
    small = SmallKernelCosts.of(cal)
    doc = spec.doc_tokens  # every document of the benchmarks has this length, one answer span each
    seconds, flops, moved = device_seconds_per_token(
        shape,
        hardware,
        loss_fraction=spec.loss_fraction,
        row_fraction=spec.loss_fraction + (spec.ttt - 1) / doc,
        attention_context=attention_context(hardware, (doc + 1) / 2, cal.training_attention),
        efficiency=calibrated_efficiency(cal, TrainerConfig(compile=spec.compile)),
        bandwidth_efficiency=cal.training_bandwidth_efficiency,
        small_kernels=small,
    )
    memory = moved / (hardware.memory_bandwidth_gbs * 1e9 * cal.training_bandwidth_efficiency)
    return seconds + small.microbatch_seconds(shape, hardware) / spec.batch_tokens, flops, memory


def implied_efficiency(measured: TrainingRow, cal: PlanCalibrationConfig) -> float:
    """The share of datasheet bf16 the row implies, its other terms as cal has them."""
    seconds, flops, _ = predicted_seconds(measured, cal)
    efficiency = calibrated_efficiency(cal, TrainerConfig(compile=measured.spec.compile))
    flop_seconds = flops / (measured.hardware.bf16_tflops * 1e12 * efficiency)
    return flops / (
        measured.hardware.bf16_tflops * 1e12 * (1 / measured.tokens_per_s - seconds + flop_seconds)
    )


def implied_small_kernels(pair: list[TrainingRow], cal: PlanCalibrationConfig) -> SmallKernelCosts:
    """The small-kernel costs two rows of one head at two micro-batch sizes imply: the difference of their
    times per token is the micro-batch's fixed time; what is left per token beyond the FLOPs and the loss's
    bytes is the per-token time."""
    small, big = sorted(pair, key=lambda r: r.spec.batch_tokens)
    ttt = small.spec.ttt
    per_token = (big.spec.batch_tokens / big.tokens_per_s - small.spec.batch_tokens / small.tokens_per_s) / (
        big.spec.batch_tokens - small.spec.batch_tokens
    )
    microbatch = small.spec.batch_tokens / small.tokens_per_s - small.spec.batch_tokens * per_token
    modelled = predicted_seconds(
        small, dataclasses.replace(cal, training_token_step_us=0.0, training_microbatch_step_ms=0.0)
    )[0]
    return SmallKernelCosts((per_token - modelled) / ttt * 1e6, microbatch / ttt * 1e3)


def recalibrate(
    cal: PlanCalibrationConfig, calibration_rows: dict[str, TrainingRow], pair: list[TrainingRow]
) -> PlanCalibrationConfig:
    """The training constants as their rows imply them together: each efficiency is net of the small-kernel
    costs, which are net of the FLOPs at the compiled efficiency; a few rounds settle both."""
    for _ in range(CALIBRATION_ROUNDS):
        small = implied_small_kernels(pair, cal)
        cal = dataclasses.replace(
            cal,
            training_token_step_us=small.token_step_us,
            training_microbatch_step_ms=small.microbatch_step_ms,
        )
        cal = dataclasses.replace(
            cal, **{name: implied_efficiency(row, cal) for name, row in calibration_rows.items()}
        )
    return cal


@dataclasses.dataclass(frozen=True)
class ExtractionRow:
    table: BenchTable
    row: dict[str, str]
    filesystem: str

    @property
    def write_gbs(self) -> float:
        """The rate bench_extract measured writing (with fsync) where the shards went: '2,370 (72,316)'."""
        return number(self.row["disk write MB/s (tok/s)"].split("(")[0]) / 1e3

    def setup(self) -> tuple[ModelConfig, DataSize, float]:
        """The model, the measured data's shape (bench_extract's own documents) and the shard bytes per token."""
        opts, _ = parse_extract(self.table.argv())
        model = load_model(self.table.args().get("model", "smollm2_135m"))
        lengths = [s.num_tokens for s in make_samples(model.vocab_size, opts)]
        tokens = sum(lengths)
        if tokens != number(self.row["tokens"]):
            raise DataError(
                f"bench_extract now makes {tokens:,} tokens for `{self.table.command}`; the row measured "
                f"{self.row['tokens']}"
            )
        data = DataSize(
            conversations=len(lengths),
            tokens=tokens,
            loss_fraction=0.5,
            mean_context=sum(n * (n + 1) / 2 for n in lengths) / tokens,
            generated_tokens=0.0,
            prefill_tokens=0.0,
            source=self.table.command,
        )
        return model, data, number(self.row["bytes/token on disk"])


def filesystem_of(table: BenchTable, row: dict[str, str]) -> str:
    """Where a row's shards went: the "shards in" column (its filesystem in parentheses), else (older rows) the
    TMPDIR=/dev/shm prefix of the command."""
    where = row.get("shards in")
    if where is not None:
        return "tmpfs" if where.endswith("(tmpfs)") else "disk"
    return "tmpfs" if table.args().get("TMPDIR") == "/dev/shm" else "disk"


def extraction_rows(tables: list[BenchTable]) -> tuple[dict[str, ExtractionRow], list[str]]:
    """The latest row of the overlapped pipeline on tmpfs and on disk, and the rows left out (and why)."""
    kept: dict[str, ExtractionRow] = {}
    left_out = []
    for table in latest(tables, EXTRACTION):
        for row in table.rows:
            where = filesystem_of(table, row)
            if table.has_columns(*EXTRACTION_COLUMNS):
                kept[where] = ExtractionRow(table, row, where)
            else:
                how = re.split(r"[;:]", table.note)[0]
                left_out.append(f"extraction on {where} of {row['date']}, {how} (the previous pipeline)")
    if set(kept) != {"tmpfs", "disk"}:
        raise DataError(
            f"{BENCH_FILE} lacks an H200 extraction row with the columns {EXTRACTION_COLUMNS} on tmpfs and on disk"
        )
    return kept, left_out


def check_extraction(
    tables: list[BenchTable], h200: HardwareConfig, plan: PlanConfig
) -> tuple[list[tuple], list[tuple[str, bool]], list[str]]:
    """Calibrate on the tmpfs row, predict the disk row: (results, calibration notes, rows left out)."""
    cal = plan.calibration
    rows, left_out = extraction_rows(tables)
    tmpfs, disk = rows["tmpfs"], rows["disk"]
    model, data, per_token = tmpfs.setup()
    bare, measured = number(tmpfs.row["bare forward tok/s"]), number(tmpfs.row["extraction tok/s"])
    flops = forward_flops_per_token(model, data.mean_context)
    # On tmpfs the filesystem is memory: its write rate is the host's own storing rate, and what extraction
    # loses against the bare forward is the share of that storing time the forward waited for.
    store = per_token / (tmpfs.write_gbs * 1e9)
    notes = [
        calibration_note(
            "prefill_efficiency",
            cal.prefill_efficiency,
            bare * flops / (h200.bf16_tflops * 1e12),
            "tmpfs row",
        ),
        calibration_note("host_store_gbs", cal.host_store_gbs, tmpfs.write_gbs, "tmpfs row's write rate"),
        calibration_note(
            "store_exposed_share", cal.store_exposed_share, (1 / measured - 1 / bare) / store, "tmpfs row"
        ),
        calibration_note("disk_write_gbs", cal.disk_write_gbs, disk.write_gbs, "disk row's write rate"),
    ]
    results = []
    for measured_row, role in ((tmpfs, "calibration"), (disk, "held out")):
        model, data, _ = measured_row.setup()
        # The row's own filesystem, at the rate measured in the same run; bench_extract writes bf16.
        hardware = dataclasses.replace(h200, disk_write_gbs=measured_row.write_gbs)
        estimate = estimate_extraction(
            model, hardware, place_target(model, hardware, plan), data, plan, "bfloat16"
        )
        machine = measured_row.row["machine"]
        if role == "held out":
            results.append(
                (
                    f"bare forward {model.name}",
                    machine,
                    number(measured_row.row["bare forward tok/s"]),
                    1 / (estimate.forward + estimate.allreduce),
                    "calibration, re-measured",
                )
            )
        where = measured_row.row["shards in"]
        results.append(
            (
                f"extraction {model.name}, shards in {where} written at {measured_row.write_gbs:.3g} GB/s",
                machine,
                number(measured_row.row["extraction tok/s"]),
                estimate.tokens_per_second,
                role,
            )
        )
    return results, notes, left_out


def decode_step_row(tables: list[BenchTable]) -> tuple[BenchTable, dict[str, str], list[str]]:
    """The compiled greedy row of the latest decode-step table, and the rows left out."""
    found = latest(tables, DECODE_STEP)
    if not found:
        raise DataError(f"{BENCH_FILE} lacks an H200 '{DECODE_STEP}' table")
    table = found[-1]
    greedy = [r for r in table.rows if r["sampling"] == "greedy" and r["compiled"] == "True"]
    if not greedy:
        raise DataError(f"{BENCH_FILE}: '{DECODE_STEP}' (`{table.command}`) has no compiled greedy row")
    left_out = [
        f"decode step, sampling {r['sampling']} (the planner's decode step is greedy: no sampling cost)"
        for r in table.rows
        if r is not greedy[-1]
    ]
    return table, greedy[-1], left_out


def ran_bits(text: str) -> int:
    """The weight bits a measured row's target ran in, from its text ('..., bf16, ...')."""
    for word, bits in (("bf16", 16), ("bfloat16", 16), ("fp32", 32), ("float32", 32)):
        if re.search(rf"\b{word}\b", text):
            return bits
    raise DataError(f"{BENCH_FILE}: no dtype (bf16, fp32) in {text!r}")


def decode_model(bits: int) -> ModelConfig:
    """conf/model/smollm2_135m.yaml, the shape both regeneration rows ran, at the bits they ran in."""
    model = load_model("smollm2_135m")
    bench = {"vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
             "intermediate_size": model.intermediate_size, "num_hidden_layers": model.num_layers,
             "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_key_value_heads,
             "head_dim": model.head_dim}  # fmt: skip
    differs = {k: (v, DECODE_SHAPE[k]) for k, v in bench.items() if DECODE_SHAPE[k] != v}
    if differs:
        raise DataError(f"bench_decode_step.SMOLLM2 differs from conf/model/smollm2_135m.yaml: {differs}")
    return dataclasses.replace(model, weight_bits=bits, dense_weight_bits=None)


def check_decode_step(
    tables: list[BenchTable], h200: HardwareConfig, cal: PlanCalibrationConfig
) -> tuple[tuple, tuple[str, bool], list[str]]:
    """decode_bandwidth_efficiency from the engine's compiled greedy step: (result, note, rows left out)."""
    table, row, left_out = decode_step_row(tables)
    model = decode_model(ran_bits(row["shape"]))
    rows = int(row["rows"])
    low, high = (int(n) for n in row["context"].split("-"))
    # bench_decode_step draws each row's context from [low, high) and the step attends to it and its own new key.
    keys = (low + high + 1) / 2
    measured = number(row["ms/step"]) / 1e3
    step = target_step(model, h200, 1, batch=rows, tokens_per_sequence=1, context=keys, calibration=cal)
    if step.compute >= step.memory or step.allreduce:
        raise DataError(f"the decode-step row of `{table.command}` is not a memory-bound one-device step")
    implied = step.memory * cal.decode_bandwidth_efficiency / measured
    note = calibration_note(
        "decode_bandwidth_efficiency", cal.decode_bandwidth_efficiency, implied, "decode-step row"
    )
    what = (
        f"decode step {model.name} (bf16, {rows:,} rows, contexts {row['context']}, greedy, compiled), "
        f"new tokens/s"
    )
    return (
        (what, row["machine"], number(row["new tokens/s"]), rows / step.seconds, "calibration"),
        note,
        left_out,
    )


@dataclasses.dataclass(frozen=True)
class DataStage:
    """The regeneration and extraction rows of one data stage at scale."""

    table: BenchTable
    turns: int
    new_tokens: int
    seconds: float
    compile_seconds: float  # the one-off compile of the decode step inside `seconds`
    sequences: int
    tokens: int

    @classmethod
    def of(cls, table: BenchTable) -> DataStage:
        stages = {row["stage"]: row for row in table.rows}
        regen = _STAGE_REGEN.search(stages["regeneration"]["work"])
        extract = _STAGE_EXTRACT.search(stages["extraction"]["work"])
        if regen is None or extract is None:
            raise DataError(f"{BENCH_FILE}: cannot read the work cells of '{DATA_STAGE}' (`{table.command}`)")
        seconds = stages["regeneration"]["seconds"]
        compile_ = _STAGE_COMPILE.search(seconds)
        return cls(
            table=table,
            turns=int(number(regen["turns"])),
            new_tokens=int(number(regen["new"])),
            seconds=number(seconds.split()[0]),
            compile_seconds=float(compile_["seconds"]) if compile_ else 0.0,
            sequences=int(number(extract["sequences"])),
            tokens=int(number(extract["tokens"])),
        )

    def size(self, cfg: EagletConfig) -> DataSize:
        """The stage's data as plan.py sizes a dataset, scaled to the row's counts.

        Its shape (causal context per token, prompt tokens per answer) comes from the conversations the stage
        writes: the experiment's extract.regenerate.import_from, the answers of an earlier greedy run of the same
        stage, read as a dataset whose answers the target regenerates at their own lengths."""
        if not cfg.extract.regenerate.import_from:
            raise DataError(
                f"`{self.table.command}`: its experiment imports no regenerated conversations "
                "(extract.regenerate.import_from), the shape the stage's data is sized from"
            )
        source = Path(cfg.extract.regenerate.import_from)
        with tempfile.TemporaryDirectory() as tmp:
            plain = Path(tmp) / source.name.removesuffix(".gz")  # the dataset reader takes plain JSONL
            plain.write_bytes(
                gzip.decompress(source.read_bytes()) if source.suffix == ".gz" else source.read_bytes()
            )
            dataset = dataclasses.replace(cfg.dataset, name=plain.stem, paths=[str(plain)])
            shape = estimate_data_size(cfg.plan, dataset, cfg.extract, Path(tmp) / "no-shards")
        factor = self.tokens / shape.tokens
        return dataclasses.replace(
            shape,
            conversations=self.sequences,
            tokens=self.tokens,
            mean_context=shape.mean_context * factor,
            generated_tokens=self.new_tokens,
            prefill_tokens=shape.prefill_tokens * factor,
            source=f"{self.table.command}; shape from {source.name}",
        )


def compose_stage(table: BenchTable) -> EagletConfig:
    """The stage's config as its command composed it, less any extract.regenerate.import_from override (the
    sizing reads the experiment's own import file)."""
    return compose_checked([a for a in table.argv() if not a.startswith("extract.regenerate.import_from=")])


def compose_checked(overrides: list[str]) -> EagletConfig:
    """The config `overrides` compose, checked as the entry points check it."""
    with initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    check_config(cfg)
    return OmegaConf.to_object(cfg)


def estimate_stage(
    model: ModelConfig, h200: HardwareConfig, cfg: EagletConfig, data: DataSize, cal: PlanCalibrationConfig
) -> RegenerationEstimate:
    """plan.py's regeneration estimate for a measured stage, at its own rows and the calibration checked."""
    plan = dataclasses.replace(
        cfg.plan, calibration=cal, regenerate_batch_size=cfg.extract.regenerate.batch_size
    )
    return estimate_regeneration(model, h200, place_target(model, h200, plan), data, plan)


def regeneration_result(
    what: str,
    table: BenchTable,
    new_tokens: int,
    measured_s: float,
    estimate: RegenerationEstimate,
    role: str,
) -> tuple:
    """A regeneration row of the check: (what, machine, measured and predicted new tokens/s, role)."""
    machine = _STAGE_MACHINE.match(table.text)
    return (
        what,
        machine["machine"] if machine else "?",
        new_tokens / measured_s,
        new_tokens / estimate.seconds,
        role,
    )


def check_data_stage(
    tables: list[BenchTable], h200: HardwareConfig, cal: PlanCalibrationConfig
) -> tuple[tuple, str, list[str]]:
    """The latest smollm2_gpu data stage, held out: (result, the steps' share in words, left out)."""
    found = latest(tables, DATA_STAGE)
    if not found:
        raise DataError(f"{BENCH_FILE} lacks an H200 '{DATA_STAGE}' table")
    stage = DataStage.of(found[-1])
    left_out = [f"'{DATA_STAGE}' `{t.command}` (an earlier run of the stage)" for t in found[:-1]]
    cfg = compose_stage(stage.table)
    data = stage.size(cfg)
    model = decode_model(ran_bits(stage.table.text))
    estimate = estimate_stage(model, h200, cfg, data, cal)
    measured = stage.seconds - stage.compile_seconds
    what = (
        f"regeneration {model.name} (bf16), the data stage: {stage.turns:,} turns, {stage.new_tokens:,} new tokens, "
        f"{estimate.batch:,} rows, mean context {data.mean_context:,.0f}; new tokens/s without the "
        f"{stage.compile_seconds:g} s compile"
    )
    result = regeneration_result(what, stage.table, stage.new_tokens, measured, estimate, "held out")
    steps_alone = estimate.prefill_seconds + estimate.decode_seconds
    words = (
        f"the smollm2_gpu data stage (held out; its shape from the answers it imports) reached "
        f"{steps_alone / measured:.3f} of its steps' rate"
    )
    return result, words, left_out


@dataclasses.dataclass(frozen=True)
class ScaleAnswers:
    """The answers of the scale recipe's data stage (self-prompted conversations, greedy and sampled): the
    row regeneration_loop_efficiency is calibrated on. Its conversations stayed on the machine that wrote them, so
    the stage is sized from the token store's counts: each regenerated turn read the store's mean prompt (its
    tokens outside the answers, per sequence) before its answer, and the causal context is that of sequences of
    the store's mean length, (n + 1) / 2 (equal lengths: the least the spread of lengths can give)."""

    table: BenchTable
    turns: int
    new_tokens: int
    seconds: float
    compile_seconds: float  # before the first token: the step's compile and graph capture
    sequences: int
    tokens: int
    answer_tokens: int
    data_args: list[str]  # the data stage's extract.py overrides

    @classmethod
    def of(cls, table: BenchTable) -> ScaleAnswers:
        rows = {row["stage"]: row for row in table.rows}
        try:
            both, greedy, store, stage = (
                rows[k] for k in ("answers, both", "answers, greedy", "token store", "data stage")
            )
        except KeyError as missing:
            raise DataError(
                f"{BENCH_FILE}: '{SCALE_STAGE}' (`{table.command}`) lacks the row {missing}"
            ) from None
        answers = _SCALE_ANSWERS.search(both["what"])
        compile_ = _SCALE_COMPILE.search(greedy["rate"])
        counts = _SCALE_STORE.search(store["what"])
        command = _SCALE_DATA_COMMAND.search(stage["what"])
        if answers is None or compile_ is None or counts is None or command is None:
            raise DataError(f"{BENCH_FILE}: cannot read the cells of '{SCALE_STAGE}' (`{table.command}`)")
        return cls(
            table=table,
            turns=int(number(answers["turns"])),
            new_tokens=int(number(answers["new"])),
            seconds=number(both["seconds"].split()[0]),
            compile_seconds=float(compile_["seconds"]),
            sequences=int(number(counts["sequences"])),
            tokens=int(number(counts["tokens"])),
            answer_tokens=int(number(counts["answers"])),
            data_args=command["args"].split(),
        )

    def size(self) -> DataSize:
        prompt = (self.tokens - self.answer_tokens) / self.sequences
        return DataSize(
            conversations=self.turns,
            tokens=self.tokens,
            loss_fraction=self.answer_tokens / self.tokens,
            mean_context=(self.tokens / self.sequences + 1) / 2,
            generated_tokens=self.new_tokens,
            prefill_tokens=self.turns * prompt,
            source=f"{self.table.command}: the token store's counts",
        )


def check_scale_answers(
    tables: list[BenchTable], h200: HardwareConfig, cal: PlanCalibrationConfig
) -> tuple[tuple, tuple[str, bool], str, list[str]]:
    """regeneration_loop_efficiency from the latest scale recipe's answers: (result, note, the gap in words, left
    out)."""
    found = latest(tables, SCALE_STAGE)
    if not found:
        raise DataError(f"{BENCH_FILE} lacks an H200 '{SCALE_STAGE}' table")
    stage = ScaleAnswers.of(found[-1])
    left_out = [f"'{SCALE_STAGE}' `{t.command}` (an earlier run)" for t in found[:-1]]
    cfg = compose_checked(stage.data_args)
    # The engine runs the target in model.dtype as resolved on the GPU (auto: bf16).
    dtype = resolve_dtype(cfg.model.dtype, torch.device("cuda"))
    model = decode_model(dtype.itemsize * 8)
    data = stage.size()
    estimate = estimate_stage(model, h200, cfg, data, cal)
    measured = stage.seconds - stage.compile_seconds
    steps_alone = estimate.prefill_seconds + estimate.decode_seconds
    note = calibration_note("regeneration_loop_efficiency", cal.regeneration_loop_efficiency,
                            steps_alone / measured, "scale recipe's answers")  # fmt: skip
    what = (
        f"regeneration {model.name} ({str(dtype).removeprefix('torch.')}), the scale recipe's answers: {stage.turns:,} turns of "
        f"self-prompted and shared conversations, {stage.new_tokens:,} new tokens, {estimate.batch:,} rows, mean "
        f"context {data.mean_context:,.0f}; new tokens/s without the {stage.compile_seconds:g} s before the first "
        "token"
    )
    result = regeneration_result(what, stage.table, stage.new_tokens, measured, estimate, "calibration")
    gap = (
        f"Regeneration: the scale recipe's answers, sized from its token store's counts ({data.prefill_tokens / stage.turns:,.0f} "
        f"prompt tokens read per answer, sequences of {stage.tokens / stage.sequences:,.0f} tokens), at "
        f"decode_bandwidth_efficiency from the decode-step row ({estimate.step_tokens_per_second:,.0f} new tokens/s "
        f"at {estimate.batch:,} rows) with their prefills, predict {steps_alone:,.1f} s; they took {measured:,.1f} s "
        f"besides the {stage.compile_seconds:g} s before the first token, {measured / steps_alone:.1f}× longer: the "
        "loop around the steps (per-window prefills and host work, sampled answers) is what "
        "regeneration_loop_efficiency carries"
    )
    return result, note, gap, left_out


def main(argv: list[str]) -> int:
    opts = {"append": 1, **{k: int(v) for k, v in (a.split("=", 1) for a in argv)}}
    tables = parse_benchmarks(BENCH_FILE)
    plan = default_plan()
    cal = plan.calibration
    h200 = load_hardware(MACHINE)
    results = []  # (what, machine, measured, predicted, role)
    notes = []  # (text, in step)

    measured_rows, left_out = training_rows(tables, h200)
    head_rows = head_step_rows(tables)
    by_key = {row.key: row for row in measured_rows}
    missing = [key for key in TRAINING_CALIBRATION if key not in by_key]
    if missing:
        raise DataError(f"{BENCH_FILE} lacks the training calibration rows {missing} under '{SIDE_BY_SIDE}'")
    pair = [row for row in head_rows if row.spec.compile]
    if len({row.spec.batch_tokens for row in pair}) != 2:
        raise DataError(
            f"{BENCH_FILE}: '{HEAD_STEP}' needs two compiled rows at two micro-batch sizes, got {len(pair)}"
        )
    implied = recalibrate(cal, {name: by_key[key] for key, name in TRAINING_CALIBRATION.items()}, pair)
    for key, name in TRAINING_CALIBRATION.items():
        notes.append(calibration_note(name, getattr(cal, name), getattr(implied, name), f"{key[2]} row"))
    for name in ("training_token_step_us", "training_microbatch_step_ms"):
        notes.append(
            calibration_note(
                name, getattr(cal, name), getattr(implied, name), "pair of compiled head-step rows"
            )
        )
    for measured in measured_rows + head_rows:
        predicted = 1 / predicted_seconds(measured, cal)[0]
        calibrates = measured.key in TRAINING_CALIBRATION or measured in pair
        role = "calibration" if calibrates else "held out"
        results.append((measured.what, measured.machine, measured.tokens_per_s, predicted, role))

    extraction, extraction_notes, extraction_left_out = check_extraction(tables, h200, plan)
    results += extraction
    notes += extraction_notes
    decode, decode_note, decode_left_out = check_decode_step(tables, h200, cal)
    scale, scale_note, gap, scale_left_out = check_scale_answers(tables, h200, cal)
    stage, stage_words, stage_left_out = check_data_stage(tables, h200, cal)
    results += [decode, scale, stage]
    notes += [decode_note, scale_note]
    left_out += extraction_left_out + decode_left_out + stage_left_out + scale_left_out

    header = (
        "| date | measured on | configuration | measured tok/s | predicted tok/s | error | role |\n"
        "|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {date.today()} | {machine} | {what} | {measured:,.0f} | {predicted:,.0f} | {predicted / measured - 1:+.1%} | {role} |"
        for what, machine, measured, predicted, role in results
    ]
    held = [abs(p / m - 1) for _, _, m, p, role in results if role == "held out"]
    verdict = (
        f"Held-out rows within ±{GOAL:.0%}: {'yes' if max(held) <= GOAL else 'no'} (largest {max(held):.1%})."
    )
    footer = [
        verdict,
        "Calibration (recomputed from its rows): " + "; ".join(text for text, _ in notes) + ".",
        f"Training rows: eaglet.plan.training's FLOPs at the calibrated share of datasheet bf16 (eager or compiled "
        f"layer), plus the loss's element-wise bytes at {cal.training_bandwidth_efficiency:.0%} of datasheet "
        f"bandwidth (assumed), plus the small kernels' time per TTT step ({cal.training_token_step_us:g} µs a "
        f"token, {cal.training_microbatch_step_ms:g} ms a micro-batch); {h200.name}'s datasheet: "
        f"{h200.bf16_tflops:g} TFLOP/s, {h200.memory_bandwidth_gbs:g} GB/s; the head-step rows on one device of the "
        f"config their machine names ({', '.join(f'{k}: {v}' for k, v in HEAD_STEP_HARDWARE.items())}).",
        "Extraction rows: per token, max(forward + store_exposed_share × storing, storing), storing at the slower "
        "of host_store_gbs and the row's own measured write rate (eaglet.plan.extraction). The bare forward is the "
        "one the tmpfs row calibrates, measured again in the held-out row's run.",
        f"{gap}; {stage_words}.",
        "Not predicted: " + ("; ".join(left_out) if left_out else "none") + ".",
    ]
    print(header + "\n" + "\n".join(lines) + "\n\n" + "\n".join(footer))
    if opts["append"]:
        command = "python benchmarks/check_planner.py " + " ".join(argv)
        with open(BENCH_FILE, "a") as fh:
            fh.write(
                f"\n### Planner check — `{command.strip()}` (predictions from conf/plan/default.yaml)\n\n"
                f"{header}\n" + "\n".join(lines) + "\n\n" + "\n".join(footer) + "\n"
            )
    return 0 if max(held) <= GOAL and all(ok for _, ok in notes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
