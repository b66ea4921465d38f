"""benchmarks/bench_extract.py: a tiny run times the bare forward, the real extraction loop and the disk, and
records where the shards went."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_extract  # noqa: E402


@pytest.mark.parametrize("warmup_batches", [0, 2])
def test_tiny_run_records_one_row(
    tmp_path: Path,
    model_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    warmup_batches: int,
) -> None:
    bench_file = tmp_path / "BENCH.md"
    monkeypatch.setattr(bench_extract, "BENCH_FILE", bench_file)
    out = tmp_path / "shards"
    extracted, real_write_shards = [], bench_extract.write_shards

    def counted(target, samples, *args, **kwargs):
        extracted.append(sum(s.num_tokens for s in samples))
        return real_write_shards(target, samples, *args, **kwargs)

    monkeypatch.setattr(bench_extract, "write_shards", counted)
    bench_extract.main(
        ["model=tiny_llama", f"paths.cache_dir={model_cache}", "bench.tokens=600", "bench.batch_tokens=256",
         "bench.shard_tokens=300", "bench.min_len=20", "bench.max_len=200", "bench.repeats=1",
         f"bench.disk_bytes={1 << 20}", f"bench.burst_bytes={1 << 16}", f"bench.out_dir={out}", f"bench.warmup_batches={warmup_batches}"]
    )  # fmt: skip
    # With a warm-up, one untimed extraction of the first batches' samples comes before the timed one of all.
    assert len(extracted) == 1 + bool(warmup_batches) and extracted[-1] >= 600
    if warmup_batches:
        assert 0 < extracted[0] <= warmup_batches * 256 < extracted[-1]
    header, rule, row = [line for line in bench_file.read_text().splitlines() if line.startswith("|")]
    cells = dict(zip(header.strip("|").split(" | "), row.strip("|").split(" | "), strict=True))
    cells = {name.strip(): value.strip() for name, value in cells.items()}
    assert cells["shards in"] == f"{out} ({bench_extract.filesystem(out)})"
    assert cells["shard tokens"] == "300" and cells["batch tokens"] == "256"
    bare, extract, bound = (float(cells[k].replace(",", "")) for k in ("bare forward tok/s", "extraction tok/s",
                                                                       "min(bare, disk) tok/s"))  # fmt: skip
    assert bare > 0 and extract > 0 and 0 < bound <= bare
    # The row's rates are rounded to whole tokens/s, its ratio (to 0.1%) is of the unrounded ones.
    low, high = 100 * (extract - 0.5) / (bound + 0.5), 100 * (extract + 0.5) / (bound - 0.5)
    assert low - 0.05 <= float(cells["extraction / min"].rstrip("%")) <= high + 0.05
    assert float(cells["bytes/token on disk"].replace(",", "")) > 4 * 64 * 2  # (n_aux + 1) x H x bf16
    assert out.is_dir() and not any(
        out.iterdir()
    )  # the shards and the disk probe are removed, the folder kept
    assert cells["extraction warm-up batches"] == str(warmup_batches)
    assert row in capsys.readouterr().out


def test_without_record_nothing_is_appended(
    tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench_file = tmp_path / "BENCH.md"
    monkeypatch.setattr(bench_extract, "BENCH_FILE", bench_file)
    monkeypatch.setattr(bench_extract.tempfile, "tempdir", str(tmp_path))
    bench_extract.main(
        ["model=tiny_llama", f"paths.cache_dir={model_cache}", "bench.tokens=200", "bench.batch_tokens=256",
         "bench.min_len=20", "bench.max_len=100", "bench.repeats=1", f"bench.disk_bytes={1 << 16}",
         f"bench.burst_bytes={1 << 16}", "bench.record=0"]
    )  # fmt: skip
    assert not bench_file.exists()
    assert list(tmp_path.iterdir()) == []  # the default temporary folder is removed


def test_unknown_bench_options_are_refused() -> None:
    with pytest.raises(SystemExit, match="bench.token: unknown"):
        bench_extract.parse(["bench.token=5"])
    opts, overrides = bench_extract.parse(["bench.out_dir=/dev/shm/x", "bench.batch_tokens=64", "model=m"])
    assert opts["out_dir"] == "/dev/shm/x" and opts["shard_tokens"] == 64 and overrides == ["model=m"]


def test_filesystem_of_a_path() -> None:
    assert bench_extract.filesystem(Path("/proc/self")) in {"proc", "?"}


def test_the_disk_probe_writes_shard_sized_files_from_threads_and_removes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = bench_extract.os.fsync

    def recorded(fd: int) -> None:
        synced.append(bench_extract.os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(bench_extract.os, "fsync", recorded)
    rate = bench_extract.disk_write_rate(tmp_path, 10_000, 3_000, 2)
    assert rate > 0 and sorted(synced) == [1_000, 3_000, 3_000, 3_000]  # every byte, each file fsynced whole
    assert list(tmp_path.iterdir()) == []
    synced.clear()
    bench_extract.disk_write_rate(tmp_path, 5_000)  # the single-file probe
    assert synced == [5_000] and list(tmp_path.iterdir()) == []
