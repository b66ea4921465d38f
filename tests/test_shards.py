"""Shard writing, the manifest and memory-mapped reading."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglet.errors import DataError
from eaglet.fsutil import atomic_write_json, sha256_file
from eaglet.shards import (
    MANIFEST_VERSION,
    Manifest,
    SequenceFeatures,
    ShardReader,
    bytes_per_token,
    dtype_name,
    read_manifest,
    shard_dir,
    shard_name,
    write_manifest,
    write_shard,
)
from eaglet.shards.format import all_finite
from eaglet.shards.streamed import write_safetensors
from eaglet.shards.tokens import TokenReader

N_AUX, H = 3, 16
GROUPS = ((5, 9, 1), (7,), (3, 12))  # sequence lengths of each shard


def make_sequence(sample_id: int, length: int, gen: torch.Generator) -> SequenceFeatures:
    return SequenceFeatures(
        sample_id=sample_id,
        input_ids=torch.randint(0, 1000, (length,), generator=gen),
        loss_mask=torch.rand(length, generator=gen) > 0.5,
        aux_hidden_states=torch.randn(length, N_AUX, H, generator=gen),
        last_hidden_state=torch.randn(length, H, generator=gen),
    )


def make_manifest(shards: list, dtype: torch.dtype, status: str = "complete", hidden: int = H) -> Manifest:
    return Manifest(
        version=MANIFEST_VERSION,
        status=status,
        target={"name": "tiny", "num_layers": 6, "hidden_size": hidden, "vocab_size": 1000},
        aux_layer_ids=[2, 3, 3][:N_AUX],
        last_layer_id=6,
        last_hidden_pre_norm=True,
        hidden_size=hidden,
        vocab_size=1000,
        dtype=dtype_name(dtype),
        inputs_fingerprint="abc",
        settings={"max_length": 64},
        shards=shards,
        totals={"sequences": sum(s.num_sequences for s in shards)},
        token_counts_file=None,
    )


def write_dataset(directory: Path, dtype: torch.dtype = torch.bfloat16, status: str = "complete") -> list:
    """Write GROUPS as shards with non-contiguous sample ids; return the sequences in global order."""
    gen = torch.Generator().manual_seed(0)
    sequences, infos = [], []
    for index, lengths in enumerate(GROUPS):
        group = [make_sequence(10 * (len(sequences) + k) + 3, n, gen) for k, n in enumerate(lengths)]
        infos.append(write_shard(directory, index, group, dtype))
        sequences += group
    write_manifest(directory, make_manifest(infos, dtype, status))
    return sequences


def mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file-backed mapping of this process."""
    regions = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            regions.append((start, end, parts[5]))
    return regions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    sequences = write_dataset(tmp_path, dtype)
    reader = ShardReader(tmp_path, verify=True)
    assert len(reader) == reader.num_sequences == len(sequences)
    assert reader.lengths.tolist() == [n for group in GROUPS for n in group]
    assert reader.sample_ids.tolist() == [s.sample_id for s in sequences]
    for i, seq in enumerate(sequences):
        got = reader.sequence(i)
        assert got["input_ids"].dtype == torch.int32 and got["loss_mask"].dtype == torch.uint8
        assert torch.equal(got["input_ids"], seq.input_ids.to(torch.int32))
        assert torch.equal(got["loss_mask"], seq.loss_mask.to(torch.uint8))
        assert got["aux_hidden_states"].dtype == dtype
        assert torch.equal(got["aux_hidden_states"], seq.aux_hidden_states.to(dtype))
        assert torch.equal(got["last_hidden_state"], seq.last_hidden_state.to(dtype))
    with pytest.raises(IndexError):
        reader.sequence(len(sequences))


def test_shard_info_and_bytes_per_token(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    sequences = [make_sequence(i, n, gen) for i, n in enumerate([200, 300, 17])]
    info = write_shard(tmp_path, 4, sequences, torch.bfloat16)
    path = tmp_path / shard_name(4)
    assert info.file == "shard-00004.safetensors" == path.name
    assert (info.num_sequences, info.num_tokens, info.first_sample) == (3, 517, 0)
    assert info.num_masked == sum(int(s.loss_mask.sum()) for s in sequences)
    assert info.bytes == path.stat().st_size and info.sha256 == sha256_file(path)
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    per_token = (N_AUX + 1) * H * 2 + 5
    index_bytes = 8 * (len(sequences) + 1) + 8 * len(sequences)  # seq_offsets + sample_ids
    assert info.bytes == 8 + header_len + index_bytes + info.num_tokens * per_token
    assert header_len < 1024


def test_layout_of_a_shard_folder(tmp_path: Path) -> None:
    assert shard_dir(tmp_path, "tiny_llama", "jsonl") == tmp_path / "shards" / "tiny_llama" / "jsonl"
    assert shard_dir(tmp_path, "tiny_llama", "jsonl", output_dir=tmp_path / "mine") == tmp_path / "mine"
    assert bytes_per_token(N_AUX, H, 2) == (N_AUX + 1) * H * 2 + 5


def test_rewrite_is_byte_identical(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    sequences = [make_sequence(i, n, gen) for i, n in enumerate([4, 8, 2])]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_shard(tmp_path / "a", 0, sequences, torch.float16)
    b = write_shard(tmp_path / "b", 0, sequences, torch.float16)
    assert (tmp_path / "a" / a.file).read_bytes() == (tmp_path / "b" / b.file).read_bytes()
    assert a == b


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_reader_maps_lazily_and_returns_views(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    shard_paths = [str((tmp_path / shard_name(i)).resolve()) for i in range(len(GROUPS))]
    reader = ShardReader(tmp_path)
    assert not any(path in shard_paths for _, _, path in mapped_files())

    got = reader.sequence(1)  # second sequence of shard 0
    regions = [(start, end) for start, end, path in mapped_files() if path == shard_paths[0]]
    assert regions and not any(path in shard_paths[1:] for _, _, path in mapped_files())
    for name, tensor in got.items():
        ptr = tensor.data_ptr()
        assert any(start <= ptr < end for start, end in regions), f"{name} is not a view of the shard file"


@pytest.mark.parametrize("reader_class", [ShardReader, TokenReader])
def test_pickled_reader_reopens_its_maps(tmp_path: Path, reader_class: type) -> None:
    sequences = write_dataset(tmp_path)
    reader = reader_class(tmp_path)
    reader.sequence(0)
    clone = pickle.loads(pickle.dumps(reader))
    assert all(tensors is None for tensors in clone._maps)  # the maps stay in the process that opened them
    assert torch.equal(clone.sequence(5)["input_ids"], sequences[5].input_ids.to(torch.int32))


@pytest.mark.parametrize("reader_class", [ShardReader, TokenReader])
def test_released_reader_maps_again(tmp_path: Path, reader_class: type) -> None:
    sequences = write_dataset(tmp_path)
    reader = reader_class(tmp_path)
    reader.sequence(0)
    reader.release()
    assert all(tensors is None for tensors in reader._maps)
    assert torch.equal(reader.sequence(0)["loss_mask"], sequences[0].loss_mask.to(torch.uint8))


def test_verify_detects_a_flipped_byte(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    path = tmp_path / shard_name(1)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    ShardReader(tmp_path)  # size unchanged: only the checksum can tell
    with pytest.raises(DataError, match=r"shard-00001.*sha256.*re-run"):
        ShardReader(tmp_path, verify=True)


def test_truncated_and_missing_shards(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    path = tmp_path / shard_name(2)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"shard-00002.*bytes.*re-run"):
        ShardReader(tmp_path)
    path.unlink()
    with pytest.raises(DataError, match=r"shard-00002.*missing.*re-run"):
        ShardReader(tmp_path)


def test_missing_directory_manifest_and_incomplete_extraction(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist.*extract\.py"):
        ShardReader(tmp_path / "nope")
    with pytest.raises(DataError, match=r"manifest\.json not found.*extract\.py"):
        ShardReader(tmp_path)
    write_dataset(tmp_path, status="in_progress")
    with pytest.raises(DataError, match=r"incomplete.*3 shards.*extract\.py"):
        ShardReader(tmp_path)


def test_shard_disagreeing_with_manifest(tmp_path: Path) -> None:
    write_dataset(tmp_path, torch.bfloat16)
    manifest = read_manifest(tmp_path)
    write_manifest(tmp_path, dataclasses.replace(manifest, hidden_size=2 * H))
    with pytest.raises(DataError, match=r"shard-00000.*aux_hidden_states.*hidden_size=32"):
        ShardReader(tmp_path)
    write_manifest(tmp_path, dataclasses.replace(manifest, dtype="float16"))
    with pytest.raises(DataError, match=r"shard-00000.*BF16.*dtype=float16"):
        ShardReader(tmp_path)


def test_manifest_round_trip_and_errors(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    manifest = read_manifest(tmp_path)
    assert [s.file for s in manifest.shards] == [shard_name(i) for i in range(len(GROUPS))]
    text = (tmp_path / "manifest.json").read_text()
    assert text.endswith("}\n") and list(json.loads(text)) == sorted(json.loads(text))
    assert Manifest.from_json(json.loads(text), "m") == manifest

    bad = manifest.to_json() | {"version": 99}
    with pytest.raises(DataError, match=r"m\.json: manifest version 99"):
        Manifest.from_json(bad, "m.json")
    bad = {k: v for k, v in manifest.to_json().items() if k != "aux_layer_ids"}
    with pytest.raises(DataError, match=r"m\.json: missing keys \['aux_layer_ids'\]"):
        Manifest.from_json(bad, "m.json")
    (tmp_path / "manifest.json").write_text("{\n  oops\n")
    with pytest.raises(DataError, match=r"manifest\.json:2: invalid JSON"):
        read_manifest(tmp_path)


def test_non_finite_features_name_the_sample(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    good, bad = make_sequence(0, 4, gen), make_sequence(42, 5, gen)
    bad.aux_hidden_states[2, 1, 3] = float("nan")
    with pytest.raises(DataError, match=r"sample_id 42: aux_hidden_states contains NaN"):
        write_shard(tmp_path, 0, [good, bad], torch.bfloat16)
    bad = make_sequence(43, 5, gen)
    bad.last_hidden_state[0, 0] = float("inf")
    with pytest.raises(DataError, match=r"sample_id 43: last_hidden_state contains NaN or inf"):
        write_shard(tmp_path, 0, [good, bad], torch.float32)
    bad = make_sequence(44, 5, gen)
    bad.last_hidden_state[0, 0] = 1e6
    with pytest.raises(DataError, match=r"sample_id 44: last_hidden_state overflows torch.float16"):
        write_shard(tmp_path, 0, [good, bad], torch.float16)
    assert list(tmp_path.iterdir()) == []


def test_shape_errors_name_the_sample(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(4)
    good = make_sequence(0, 4, gen)
    bad = make_sequence(7, 5, gen)
    bad.loss_mask = bad.loss_mask[:4]
    with pytest.raises(DataError, match=r"sample_id 7: loss_mask has shape \[4\], expected \[5\]"):
        write_shard(tmp_path, 0, [good, bad], torch.bfloat16)
    bad = make_sequence(8, 5, gen)
    bad.aux_hidden_states = torch.randn(5, N_AUX, H + 1)
    with pytest.raises(DataError, match=r"sample_id 8: aux_hidden_states .* H=16"):
        write_shard(tmp_path, 0, [good, bad], torch.bfloat16)
    bad = make_sequence(9, 5, gen)
    bad.last_hidden_state = torch.randn(5, H - 1)
    with pytest.raises(DataError, match=r"sample_id 9: last_hidden_state has shape"):
        write_shard(tmp_path, 0, [good, bad], torch.bfloat16)


def test_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(5)
    old = tmp_path / "manifest.json"
    old.write_text("old\n")

    def crash(src: object, dst: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        write_shard(tmp_path, 0, [make_sequence(0, 3, gen)], torch.bfloat16)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_json(old, {"new": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert old.read_text() == "old\n"


def test_written_files_get_the_mode_of_ordinary_files(tmp_path: Path) -> None:
    """safetensors writes its files private (0600); every atomic write gets what open() gives: 0666 less the umask."""
    gen = torch.Generator().manual_seed(6)
    old = os.umask(0o027)
    try:
        write_shard(tmp_path, 0, [make_sequence(0, 3, gen)], torch.bfloat16)
        atomic_write_json(tmp_path / "manifest.json", {"a": 1})
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {shard_name(0): 0o640, "manifest.json": 0o640}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    info = torch.finfo(dtype)
    # The largest finite values, tiny and signed ones: all finite; then one inf, -inf or NaN anywhere.
    base = torch.randn(3, 1000, 7, generator=gen).to(dtype)
    base[0, 0, 0], base[0, 0, 1], base[0, 0, 2] = info.max, -info.max, info.tiny
    assert all_finite(base) and bool(torch.isfinite(base).all())
    for value in (float("inf"), float("-inf"), float("nan")):
        for _ in range(5):
            spoiled = base.clone()
            spoiled.view(-1)[int(torch.randint(spoiled.numel(), (1,), generator=gen))] = value
            assert not all_finite(spoiled), (dtype, value)
    assert all_finite(base[:, ::2])  # a strided view is checked as a copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_streamed_safetensors_reads_as_safetensors_own(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    tensors = {
        "b_features": torch.randn(70, 3, 9, generator=gen).to(dtype),
        "a_ids": torch.randint(0, 1 << 30, (70,), generator=gen, dtype=torch.int32),
        "mask": torch.randint(0, 2, (70,), generator=gen, dtype=torch.uint8),
        "offsets": torch.arange(5, dtype=torch.int64),
    }
    digest = write_safetensors(tmp_path / "s.safetensors", tensors, {"format": "pt"})
    assert digest == sha256_file(tmp_path / "s.safetensors")
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "s.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    loaded = load_file(tmp_path / "s.safetensors")
    assert loaded.keys() == tensors.keys()
    assert all(loaded[k].dtype == tensors[k].dtype and torch.equal(loaded[k], tensors[k]) for k in tensors)
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        write_safetensors(tmp_path / "t.safetensors", {"x": tensors["b_features"].transpose(0, 1)}, {})
