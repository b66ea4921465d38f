"""benchmarks/bench_online.py: a tiny run trains the same batches from shards and online and records one row."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_online  # noqa: E402


@pytest.mark.parametrize("target_compiled", [False, True])
def test_tiny_run_records_one_row(
    tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch, target_compiled: bool
) -> None:
    bench_file = tmp_path / "BENCH.md"
    monkeypatch.setattr(bench_online, "BENCH_FILE", bench_file)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    runs, real_train = [], bench_online.train

    def counted_train(*args, **kwargs):
        runs.append(kwargs.get("overlap", False))
        return real_train(*args, **kwargs)

    monkeypatch.setattr(bench_online, "train", counted_train)
    bench_online.main(
        ["model=tiny_llama", f"paths.cache_dir={model_cache}", "draft.vocab_size=128", "bench.batch_tokens=512",
         "bench.steps=2", "bench.warmup=1", "bench.min_len=32", "bench.max_len=256", "bench.repeats=2",
         f"trainer.online_compile={str(target_compiled).lower()}"]
    )  # fmt: skip
    assert runs == [False, False, True] * 2  # offline, online and overlapped, taking turns twice
    text = bench_file.read_text()
    assert "bench_online.py model=tiny_llama" in text
    header, _, row = [line for line in text.splitlines() if line.startswith("|")]
    cells = {
        name.strip(): value.strip()
        for name, value in zip(header.strip("|").split(" | "), row.strip("|").split(" | "), strict=True)
    }
    offline, online, overlapped = (
        float(cells[k].replace(",", ""))
        for k in ("offline tok/s", "online tok/s", "online, overlapped tok/s")
    )
    eager, compiled = cells["target forward tok/s: eager, compiled"].split(", ")
    assert cells["steps"] == "2 x 2"
    assert offline > 0 and online > 0 and overlapped > 0 and float(eager.replace(",", "")) > 0
    assert cells["compiled: head, target"] == ("no, yes" if target_compiled else "no, no")
    assert (float(compiled.replace(",", "")) > 0) if target_compiled else compiled == "—"
    assert cells["online / offline"] == f"{online / offline:.2f}x"
    assert cells["overlapped / offline"] == f"{overlapped / offline:.2f}x"
    shards, tokens = (float(x.replace(",", "")) for x in cells["disk B/token: shards, tokens"].split(", "))
    assert shards > 4 * 64 * 2 and 5 <= tokens < 6  # (n_aux + 1) x H x bf16 against 5 bytes and the headers
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith("bench-online-")
    ]  # its folders are removed
