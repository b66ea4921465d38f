"""benchmarks/check_planner.py: which benchmark rows it reads, and how it reads them (the check itself runs in
tests/test_plan.py::test_check_planner_meets_its_goal)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import check_planner  # noqa: E402
from bench_extract import make_samples  # noqa: E402
from bench_extract import parse as parse_extract  # noqa: E402

from eaglet.errors import DataError  # noqa: E402
from eaglet.plan.benchmarks import BenchTable, parse_benchmarks  # noqa: E402
from eaglet.plan.configs import default_plan, load_hardware  # noqa: E402

OLD_COLUMNS = (
    "| date | machine | target | tokens | bare forward tok/s | extraction tok/s | bytes/token on disk |"
)
NEW_COLUMNS = (
    "| date | machine | target | tokens | shards in | bare forward tok/s | disk write MB/s (tok/s) "
    "| extraction tok/s | bytes/token on disk |"
)


def rule(header: str) -> str:
    return "|" + "---|" * (header.count("|") - 1)


def one_table(tmp_path: Path, text: str) -> BenchTable:
    path = tmp_path / "B.md"
    path.write_text(text)
    (table,) = parse_benchmarks(path)
    return table


def extraction_file(tmp_path: Path, tokens: int) -> Path:
    """Two older rows (tmpfs by the TMPDIR prefix, disk), then the new pipeline on tmpfs and on disk."""
    args = "model=smollm2_135m bench.tokens=300 bench.min_len=20 bench.max_len=100"
    old = f"| 2026-11-29 | GPU | t | {tokens:,} | 100 | 50 | 69.0 |"
    md = tmp_path / "B.md"
    md.write_text(
        "## NVIDIA H200 (stand-ins)\n\n"
        f"### Extraction throughput — `TMPDIR=/dev/shm python benchmarks/bench_extract.py {args}` (shards on tmpfs)\n\n"
        f"{OLD_COLUMNS}\n{rule(OLD_COLUMNS)}\n{old}\n\n"
        f"### Extraction throughput — `python benchmarks/bench_extract.py {args}` (background writers; on disk)\n\n"
        f"{OLD_COLUMNS}\n{rule(OLD_COLUMNS)}\n{old}\n\n"
        f"### Extraction throughput — `TMPDIR=/dev/shm python benchmarks/bench_extract.py {args}`\n\n"
        f"{NEW_COLUMNS}\n{rule(NEW_COLUMNS)}\n"
        f"| 2026-12-03 | GPU | t | {tokens:,} | /dev/shm (tmpfs) | 100 | 2,370 (72,316) | 80 | 69.0 |\n\n"
        f"### Extraction throughput — `python benchmarks/bench_extract.py {args} bench.out_dir=/root/shards`\n\n"
        f"{NEW_COLUMNS}\n{rule(NEW_COLUMNS)}\n"
        f"| 2026-12-03 | GPU | t | {tokens:,} | /root/shards (ext4) | 100 | 1,394 (42,550) | 64 | 69.0 |\n"
    )
    return md


def test_extraction_rows_of_the_new_pipeline(tmp_path: Path):
    opts, _ = parse_extract(["bench.tokens=300", "bench.min_len=20", "bench.max_len=100"])
    tokens = sum(s.num_tokens for s in make_samples(49152, opts))
    tables = parse_benchmarks(extraction_file(tmp_path, tokens))
    rows, left_out = check_planner.extraction_rows(tables)
    assert rows["tmpfs"].write_gbs == pytest.approx(2.37) and rows["disk"].write_gbs == pytest.approx(1.394)
    # The older rows: where their shards went from the TMPDIR prefix, left out as the previous pipeline.
    assert [text.split(",")[0] for text in left_out] == [
        "extraction on tmpfs of 2026-11-29",
        "extraction on disk of 2026-11-29",
    ]
    assert all("previous pipeline" in text for text in left_out)
    # bench.out_dir is a path, not a number: the row's documents are rebuilt with bench_extract's own options.
    model, data, per_token = rows["disk"].setup()
    assert (model.name, data.tokens, per_token) == ("smollm2_135m", tokens, 69.0)
    with pytest.raises(DataError, match="on tmpfs and on disk"):
        check_planner.extraction_rows([t for t in tables if "out_dir" not in t.command])


def test_data_stage_cells_are_read(tmp_path: Path):
    md_table = one_table(
        tmp_path,
        "## NVIDIA H200\n\n### Regeneration and extraction at scale — `python extract.py experiments=x`\n\n"
        "2026-12-03, one NVIDIA H200 (torch 2, transformers 5), embedded SmolLM2, bf16, greedy.\n\n"
        "| stage | work | seconds | rate |\n|---|---|---|---|\n"
        "| regeneration | 18,113 assistant turns, 5,587,522 new tokens (848 cut) | 142.5 (incl. ~40 s compiling "
        "the step) | 39,211 new tokens/s |\n"
        "| extraction | 15,325 sequences, 7,067,319 tokens, 109 shards | 37.8 | 186,965 tokens/s |\n",
    )
    stage = check_planner.DataStage.of(md_table)
    assert (stage.turns, stage.new_tokens, stage.sequences, stage.tokens) == (18113, 5587522, 15325, 7067319)
    assert (stage.seconds, stage.compile_seconds) == (142.5, 40.0)
    assert check_planner.ran_bits(md_table.text) == 16
    assert (
        check_planner._STAGE_MACHINE.match(md_table.text)["machine"]
        == "NVIDIA H200 (torch 2, transformers 5)"
    )
    with pytest.raises(DataError, match="no dtype"):
        check_planner.ran_bits("SmolLM2-135M (random)")


SCALE_TABLE = (
    "## NVIDIA H200\n\n### The scale recipe's data and training on one H200 — `python recipes/smollm2_scale.py "
    "rows=main`\n\n2026-12-04, NVIDIA H200 (torch 2.11.0+cu130), 16 CPU cores, from a bare machine.\n\n"
    "| stage | what | seconds | rate |\n|---|---|---|---|\n"
    "| answers, greedy | 200,000 conversations, 256-token cap | 346 | 110K new tokens/s (41 s of it before the first "
    "token: compile, graph capture) |\n"
    "| answers, both | 234,308 turns, 44,627,727 new tokens | 416.7 | 107K new tokens/s |\n"
    "| token store | 245,231 sequences, 69,540,276 tokens, **50,218,804 answer tokens**, 335.7 MiB | 12.4 | |\n"
    "| data stage | `extract.py experiments=smollm2_scale`, start to end | 850 | |\n"
)


def test_scale_answers_are_read_and_sized_from_the_token_store(tmp_path: Path):
    stage = check_planner.ScaleAnswers.of(one_table(tmp_path, SCALE_TABLE))
    assert (stage.turns, stage.new_tokens, stage.seconds, stage.compile_seconds) == (
        234308,
        44627727,
        416.7,
        41.0,
    )
    assert (stage.sequences, stage.tokens, stage.answer_tokens) == (245231, 69540276, 50218804)
    assert stage.data_args == ["experiments=smollm2_scale"]
    size = stage.size()
    # Each turn reads the store's mean prompt: (69,540,276 - 50,218,804) / 245,231 = 78.8 tokens.
    assert size.prefill_tokens == pytest.approx(234308 * 78.789, rel=1e-4)
    assert size.mean_context == pytest.approx((69540276 / 245231 + 1) / 2)
    assert size.generated_tokens == 44627727


def test_scale_answers_without_a_row_they_need_say_which(tmp_path: Path):
    table = one_table(tmp_path, SCALE_TABLE.replace("| token store |", "| tokens |"))
    with pytest.raises(DataError, match="lacks the row 'token store'"):
        check_planner.ScaleAnswers.of(table)


def test_decode_step_reads_its_greedy_compiled_row(tmp_path: Path):
    header = "| date | machine | shape | rows | context | sampling | compiled | ms/step | new tokens/s |"
    table = one_table(
        tmp_path,
        "## NVIDIA H200\n\n### Decode step of the generation engine — `python benchmarks/bench_decode_step.py`\n\n"
        f"{header}\n{rule(header)}\n"
        "| d | GPU | SmolLM2-135M (random, bf16) | 1024 | 100-1300 | greedy | True | 5.96 | 171,822 |\n"
        "| d | GPU | SmolLM2-135M (random, bf16) | 1024 | 100-1300 | 0.7/0.95 | True | 7.61 | 134,615 |\n",
    )
    cal = default_plan().calibration
    result, (note, in_step), left_out = check_planner.check_decode_step(
        [table], load_hardware("h200_x1"), cal
    )
    # 135M bf16 weights (270 MB) and 1,024 rows × 700.5 keys × 23,040 B (30 layers of 3 KV heads × 64, K and V,
    # bf16): 16.8 GB a step in 5.96 ms, 58.7% of the H200's 4,800 GB/s.
    implied = (0.135e9 * 2 + 1024 * 700.5 * 23040) / 5.96e-3 / 4800e9
    assert f"implies {implied:.3g}" in note
    assert result[2] == 171822 and result[4] == "calibration"
    assert left_out == [
        "decode step, sampling 0.7/0.95 (the planner's decode step is greedy: no sampling cost)"
    ]


HEAD_STEP_HEADER = "| date | machine | compiled | micro-batch tokens | tokens/s | peak GiB |"


def head_step_table(
    tmp_path: Path, rates: dict[tuple[str, int], float], machine: str = "NVIDIA H100 80GB HBM3"
) -> list[BenchTable]:
    command = (
        "python benchmarks/bench_train.py shapes=smollm2_135m ttt=5 draft_vocab=8192 lm_head_trainable=1 "
        "batch_tokens=<B> compile=<C> doc_tokens=512 docs=256 steps=40 warmup=8"
    )
    rows = "".join(f"| d | {machine} | {c} | {b:,} | {r:,.0f} | 3 |\n" for (c, b), r in rates.items())
    path = tmp_path / "B.md"
    path.write_text(
        f"## NVIDIA H200\n\n### {check_planner.HEAD_STEP} — `{command}`\n\n"
        f"{HEAD_STEP_HEADER}\n{rule(HEAD_STEP_HEADER)}\n{rows}"
    )
    return parse_benchmarks(path)


def test_head_step_rows_give_back_the_small_kernel_costs_they_were_made_with(tmp_path: Path):
    # Rows the planner itself predicts with known costs: the calibration must find those costs again.
    known = dataclasses.replace(
        default_plan().calibration, training_token_step_us=0.5, training_microbatch_step_ms=3.0
    )
    placeholder = {("yes", 16384): 1.0, ("yes", 32768): 1.0, ("no", 16384): 1.0}
    rows = check_planner.head_step_rows(head_step_table(tmp_path, placeholder))
    rates = {
        ("yes" if r.spec.compile else "no", r.spec.batch_tokens): 1
        / check_planner.predicted_seconds(r, known)[0]
        for r in rows
    }
    rows = check_planner.head_step_rows(head_step_table(tmp_path, rates))
    assert [(r.spec.ttt, r.spec.draft_vocab, r.spec.trainable, r.spec.doc_tokens) for r in rows] == [
        (5, 8192, True, 512)
    ] * 3
    assert rows[0].spec.loss_fraction == pytest.approx(1 - 204 / 512)
    assert rows[0].hardware.devices == 1 and rows[0].hardware.gpu == "H100"
    pair = [r for r in rows if r.spec.compile]
    # rates are rounded to whole tokens/s in the table
    found = check_planner.implied_small_kernels(pair, known)
    assert found.token_step_us == pytest.approx(0.5, rel=1e-3)
    assert found.microbatch_step_ms == pytest.approx(3.0, rel=1e-3)
    # and with no small-kernel costs at all, a pair whose rates do not depend on the micro-batch size
    none = dataclasses.replace(known, training_token_step_us=0.0, training_microbatch_step_ms=0.0)
    flat = {key: 1 / check_planner.predicted_seconds(rows[0], none)[0] for key in rates}
    rows = check_planner.head_step_rows(head_step_table(tmp_path, flat))
    found = check_planner.implied_small_kernels([r for r in rows if r.spec.compile], none)
    assert abs(found.microbatch_step_ms) < 1e-3 and abs(found.token_step_us) < 1e-3


def test_a_head_step_row_on_an_unknown_card_is_refused(tmp_path: Path):
    tables = head_step_table(tmp_path, {("yes", 16384): 1.0}, machine="NVIDIA A100")
    with pytest.raises(DataError, match="name one of \\['H100', 'H200'\\]"):
        check_planner.head_step_rows(tables)
    (row,) = check_planner.head_step_rows(
        head_step_table(tmp_path, {("yes", 16384): 1.0}, machine="H200 SXM")
    )
    assert row.hardware.name == "h200_x1"


def test_without_the_head_step_table_the_check_says_so(tmp_path: Path):
    (tmp_path / "B.md").write_text("## NVIDIA H200\n")
    with pytest.raises(DataError, match="small-kernel calibration rows"):
        check_planner.head_step_rows(parse_benchmarks(tmp_path / "B.md"))
