"""benchmarks/bench_loader.py: a tiny run measures every loader setting and records its table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_loader  # noqa: E402


def test_tiny_run_records_a_row_per_setting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bench_file = tmp_path / "BENCH.md"
    bench_loader.main(
        ["--shape", "tiny", "--docs", "12", "--doc-tokens", "128", "--batch-tokens", "512", "--warmup", "1",
         "--loaders", "threads=0,threads=2,workers=1", "--recycle", "--train-tps", "1000", "--dir", str(tmp_path),
         "--bench-file", str(bench_file)]
    )  # fmt: skip
    rows = [line for line in bench_file.read_text().splitlines() if line.startswith("| tiny |")]
    names = [row.split(" | ")[2] for row in rows]
    assert names == ["threads=0", "threads=2", "workers=1", "threads=0 (recycled)", "threads=2 (recycled)"]
    for row in rows:
        first, gbs, later, ratio = row.strip("| ").split(" | ")[3:]
        assert float(first.replace(",", "")) > 0 and float(later.replace(",", "")) > 0 and ratio.endswith("x")
    assert not list(tmp_path.glob("bench-loader-*"))  # the shards are removed
    assert "| tiny |" in capsys.readouterr().out


def test_a_bad_loader_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="threads=N or workers=N"):
        bench_loader.parse_loader("thread=2")
