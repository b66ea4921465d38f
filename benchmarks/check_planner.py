"""The planner's training and extraction predictions against the H200 rows of BENCHMARKS.md.

    python benchmarks/check_planner.py             # print, and append the table to BENCHMARKS.md
    python benchmarks/check_planner.py append=0    # print only

Every measured number is read from the markdown tables of experiments/BENCHMARKS.md (the latest row of each
configuration), never typed in. The calibration constants of conf/plan/default.yaml come from one row
each (named below); this script recomputes them from those rows, to show the file is in step, and predicts
the other rows (held out). Goal: held-out predictions within ±25%.

Training: the eaglet rows of the "Side by side with speculators on one device" tables
(bench_gpu_side_by_side.py, the training code as it is). The eager layer's efficiency comes from one row, the
compiled layer's from another; every other eaglet row is held out. The speculators rows measure another
implementation and are not predicted. The older "Training throughput" rows (bench_train.py) measured the
previous training code (masked attention over the whole packed row, every step at every position, the
teacher over the full vocab), which the planner no longer models: they stay in BENCHMARKS.md as history.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from datetime import date
from pathlib import Path

from bench_extract import DEFAULTS as EXTRACT_DEFAULTS
from bench_extract import make_samples
from bench_gpu_side_by_side import VARIANTS
from bench_gpu_side_by_side import parse as parse_side_by_side
from bench_train import SHAPES

from eaglet.config.schema import HardwareConfig, PlanCalibrationConfig, TrainerConfig
from eaglet.errors import DataError
from eaglet.plan.benchmarks import BenchTable, number, parse_benchmarks
from eaglet.plan.configs import default_plan, load_draft, load_hardware, load_model
from eaglet.plan.data_size import DataSize
from eaglet.plan.extraction import estimate_extraction, place_target, prefill_seconds_per_token
from eaglet.plan.target_cost import forward_flops_per_token
from eaglet.plan.training import HeadShape, attention_context, calibrated_efficiency, device_seconds_per_token

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
GOAL = 0.25
IN_STEP = 0.01  # a constant of conf/plan/default.yaml may differ this much from what its row implies
_LEAD = re.compile(r"^(?P<date>\d{4}-\d{2}-\d{2}), (?P<machine>.+?)\. ")
_PROMPT = re.compile(r"(?P<low>\d+)-(?P<high>\d+)% prompt")


def calibration_note(name: str, configured: float, implied: float, row: str) -> tuple[str, bool]:
    in_step = abs(configured / implied - 1) <= IN_STEP
    state = "in step" if in_step else f"OUT OF STEP: set {name}: {implied:.3g} in conf/plan/default.yaml"
    return f"{name} {configured:.3g} (the {row} implies {implied:.3g}; {state})", in_step


def latest(tables: list[BenchTable], title: str) -> list[BenchTable]:
    return [t for t in tables if t.section.startswith(SECTION) and t.title == title]


@dataclasses.dataclass(frozen=True)
class TrainingRow:
    """One measured eaglet row of a side-by-side table, with the run's settings."""

    shape: str
    ttt: int
    implementation: str
    row: dict[str, str]
    table: BenchTable
    batch_tokens: int
    doc_tokens: int
    draft_vocab: int
    prompt_share: float  # mean share of each document before its loss mask

    @property
    def machine(self) -> str:
        match = _LEAD.match(self.table.text)
        return match["machine"] if match else "?"


def training_rows(tables: list[BenchTable]) -> tuple[list[TrainingRow], list[str]]:
    """The latest row of each (shape, K, implementation), and what was left out (and why)."""
    rows: dict[tuple, TrainingRow] = {}
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
            rows[key] = TrainingRow(
                *key, row, table, opts.batch_tokens, opts.doc_tokens, opts.draft_vocab, share
            )
    kept, left_out = [], []
    for key, measured in rows.items():
        variant = VARIANTS.get(key[2])
        if variant is None or variant.impl != "eaglet":
            left_out.append(f"{key[2]} {key[0]} K={key[1]} (another implementation)")
        elif variant.attention != "auto":
            left_out.append(f"{key[2]} {key[0]} K={key[1]} (attention={variant.attention}: not calibrated)")
        elif measured.row["tokens/s"].startswith("error"):
            left_out.append(f"{key[2]} {key[0]} K={key[1]} (failed: {measured.row['tokens/s']})")
        else:
            kept.append(measured)
    return kept, left_out


def training_prediction(
    measured: TrainingRow, h200: HardwareConfig, cal: PlanCalibrationConfig
) -> tuple[float, float]:
    """(predicted tokens/s, the efficiency this row alone implies)."""
    model, d = load_model(measured.shape), load_draft(measured.shape)
    bench = (
        d.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        d.intermediate_size,
        model.vocab_size,
    )
    if SHAPES[measured.shape] != bench:
        raise DataError(
            f"bench_train.SHAPES[{measured.shape!r}] = {SHAPES[measured.shape]} differs from "
            f"conf/draft/{measured.shape}.yaml and conf/model/{measured.shape}.yaml {bench}"
        )
    variant = VARIANTS[measured.implementation]
    trainer = TrainerConfig(
        ttt_steps=measured.ttt, lm_head_trainable=variant.trainable, compile=variant.compile
    )
    shape = HeadShape.of(model, d, trainer, min(measured.draft_vocab, model.vocab_size))
    hardware = dataclasses.replace(h200, tokens_per_device=measured.batch_tokens)
    doc = measured.doc_tokens  # every document of the benchmark has this length, one answer span each
    loss = 1.0 - measured.prompt_share
    efficiency = calibrated_efficiency(cal, trainer)
    seconds, flops, moved = device_seconds_per_token(
        shape,
        hardware,
        loss_fraction=loss,
        row_fraction=loss + (measured.ttt - 1) / doc,
        attention_context=attention_context(hardware, (doc + 1) / 2, cal.training_attention),
        efficiency=efficiency,
        bandwidth_efficiency=cal.training_bandwidth_efficiency,
    )
    memory = moved / (hardware.memory_bandwidth_gbs * 1e9 * cal.training_bandwidth_efficiency)
    compute = 1 / number(measured.row["tokens/s"]) - memory
    return 1 / seconds, flops / (hardware.bf16_tflops * 1e12 * compute)


def extraction_setup(table: BenchTable, row: dict[str, str]) -> tuple:
    """The model, the measured data's shape (bench_extract's own documents) and the shard bytes per token."""
    args = table.args()
    opts = {
        **EXTRACT_DEFAULTS,
        **{k.removeprefix("bench."): int(v) for k, v in args.items() if k.startswith("bench.")},
    }
    model = load_model(args.get("model", "smollm2_135m"))
    lengths = [s.num_tokens for s in make_samples(model.vocab_size, opts)]
    tokens = sum(lengths)
    if tokens != number(row["tokens"]):
        raise DataError(
            f"bench_extract now makes {tokens:,} tokens for `{table.command}`; the row measured {row['tokens']}"
        )
    data = DataSize(
        conversations=len(lengths),
        tokens=tokens,
        loss_fraction=0.5,
        mean_context=sum(n * (n + 1) / 2 for n in lengths) / tokens,
        generated_tokens=0.0,
        prefill_tokens=0.0,
        source=table.command,
    )
    return model, data, number(row["bytes/token on disk"])


def main(argv: list[str]) -> int:
    opts = {"append": 1, **{k: int(v) for k, v in (a.split("=", 1) for a in argv)}}
    tables = parse_benchmarks(BENCH_FILE)
    plan = default_plan()
    cal = plan.calibration
    h200 = load_hardware(MACHINE)
    results = []  # (what, machine, measured, predicted, role)
    notes = []  # (text, in step)

    measured_rows, left_out = training_rows(tables)
    for measured in measured_rows:
        predicted, implied = training_prediction(measured, h200, cal)
        key = (measured.shape, measured.ttt, measured.implementation)
        name = TRAINING_CALIBRATION.get(key)
        if name is not None:
            notes.append(
                calibration_note(name, getattr(cal, name), implied, f"{measured.implementation} row")
            )
        what = (
            f"training {key[0]} K={key[1]} {key[2]} (lm_head {measured.row['lm_head']}), "
            f"{measured.batch_tokens:,}-token micro-batches of {measured.doc_tokens:,}-token documents"
        )
        role = "calibration" if name else "held out"
        results.append((what, measured.machine, number(measured.row["tokens/s"]), predicted, role))
    missing = [
        key
        for key in TRAINING_CALIBRATION
        if key not in {(m.shape, m.ttt, m.implementation) for m in measured_rows}
    ]
    if missing:
        raise DataError(f"{BENCH_FILE} lacks the training calibration rows {missing} under '{SIDE_BY_SIDE}'")

    extraction = latest(tables, "Extraction throughput")
    on_tmpfs = [t for t in extraction if t.args().get("TMPDIR") == "/dev/shm"]
    on_disk = [t for t in extraction if "TMPDIR" not in t.args()]
    if not on_tmpfs or not on_disk:
        raise DataError(f"{BENCH_FILE} lacks an H200 extraction row on tmpfs and one on disk")
    calibration_table, held_table = on_tmpfs[-1], on_disk[-1]
    model, data, per_token = extraction_setup(calibration_table, calibration_table.rows[-1])
    row = calibration_table.rows[-1]
    bare, measured = number(row["bare forward tok/s"]), number(row["extraction tok/s"])
    flops = forward_flops_per_token(model, data.mean_context)
    implied_prefill = bare * flops / (h200.bf16_tflops * 1e12)
    implied_store = per_token / (1 / measured - 1 / bare) / 1e9
    notes.append(calibration_note("prefill_efficiency", cal.prefill_efficiency, implied_prefill, "tmpfs row"))
    notes.append(calibration_note("host_store_gbs", cal.host_store_gbs, implied_store, "tmpfs row"))
    model, data, per_token = extraction_setup(held_table, held_table.rows[-1])
    row = held_table.rows[-1]
    placement = place_target(model, h200, plan)
    estimate = estimate_extraction(
        model, h200, placement, data, plan, "bfloat16"
    )  # bench_extract writes bf16
    forward, _ = prefill_seconds_per_token(model, h200, placement.group or 1, data.mean_context, plan)
    what = f"extraction {model.name}, shards on disk ({h200.disk_write_gbs:g} GB/s, hardware config)"
    results.append(
        (
            "bare forward " + model.name,
            row["machine"],
            number(row["bare forward tok/s"]),
            1 / forward,
            "calibration, re-measured",
        )
    )
    results.append(
        (what, row["machine"], number(row["extraction tok/s"]), estimate.tokens_per_second, "held out")
    )

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
        f"bandwidth (assumed); {h200.name}'s datasheet: {h200.bf16_tflops:g} TFLOP/s, {h200.memory_bandwidth_gbs:g} GB/s.",
        "Not predicted: " + ("; ".join(left_out) if left_out else "none") + ".",
        "The bare forward is the one the tmpfs row calibrates, measured again in the held-out row's run.",
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
