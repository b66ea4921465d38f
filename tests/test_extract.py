"""The extraction stage end to end on a tiny random Llama: shards, manifest, counts, resume, refusals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from volumes import small_volume

from eaglet.config import ASSETS_DIR, REPO_ROOT, shared_data_dir
from eaglet.errors import ConfigError, DataError
from eaglet.extract.stage import run_extraction
from eaglet.shards import ShardReader, load_token_counts, read_manifest
from eaglet.shards.layout import TARGET_HEAD_FILE
from eaglet.target_model import load_target

SHARED = shared_data_dir()


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def some_records(n: int = 12) -> list[dict]:
    rows = [json.loads(line) for line in (SHARED / "oasst_en100.jsonl").read_text().splitlines()[:n]]
    return rows


def overrides(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_llama",
        "dataset=jsonl",
        f"dataset.paths=[{data}]",
        "extract.regenerate.enabled=false",
        f"extract.output_dir={out}",
        "extract.max_length=256",
        "extract.shard_tokens=600",
        "extract.batch_tokens=512",
        *extra,
    ]


def test_shards_manifest_and_counts(compose, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records())
    cfg = compose(*overrides(data, tmp_path / "out"))
    summary = run_extraction(cfg)
    manifest = read_manifest(tmp_path / "out")
    assert manifest.complete and len(manifest.shards) > 2
    assert manifest.aux_layer_ids == [2, 3, 3] and manifest.last_layer_id == 6
    reader = ShardReader(tmp_path / "out", verify=True)
    assert len(reader) == summary.sequences == 12 - summary.skipped
    # bytes per token: (n_aux + 1) * H * 2 (bf16) + 4 (id) + 1 (mask), plus small per-shard metadata.
    per_token = summary.bytes_on_disk / summary.tokens
    assert 4 * 64 * 2 + 5 <= per_token < 4 * 64 * 2 + 5 + 8
    counts = load_token_counts(tmp_path / "out")
    masked = np.concatenate(
        [
            reader.sequence(i)["input_ids"].numpy()[reader.sequence(i)["loss_mask"].numpy() == 1]
            for i in range(len(reader))
        ]
    )
    assert int(counts.sum()) == masked.size == summary.masked_tokens
    assert int(counts[int(masked[0])]) == int((masked == masked[0]).sum())


def test_features_rebuild_the_targets_own_logits(compose, tmp_path: Path, model_cache: Path) -> None:
    """lm_head(final_norm(last_hidden_state)) from the shard equals the target's logits (norm applied once)."""
    data = write_jsonl(tmp_path / "d.jsonl", some_records(3))
    cfg = compose(*overrides(data, tmp_path / "out", "extract.dtype=float32"))
    run_extraction(cfg)
    reader = ShardReader(tmp_path / "out")
    head = load_file(tmp_path / "out" / TARGET_HEAD_FILE)
    target = load_target(cfg.model, device="cpu", cache_dir=model_cache)
    seq = reader.sequence(0)
    ids = seq["input_ids"].long()[None]
    with torch.no_grad():
        logits = target.model(ids).logits[0]
    last = seq["last_hidden_state"].float()
    normed = (
        last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + cfg.model.rms_norm_eps) * head["norm.weight"]
    )
    torch.testing.assert_close(normed @ head["lm_head.weight"].T, logits, atol=1e-4, rtol=1e-4)
    hidden = target.model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(seq["aux_hidden_states"][:, 0], hidden[2][0], atol=1e-5, rtol=1e-5)


def test_rerun_is_a_no_op_and_other_inputs_are_refused(compose, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(4))
    out = tmp_path / "out"
    run_extraction(compose(*overrides(data, out)))
    before = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    again = run_extraction(compose(*overrides(data, out)))
    assert again.resumed_shards == again.shards
    assert before == {p.name: p.read_bytes() for p in out.glob("shard-*")}
    with pytest.raises(ConfigError, match="extract.overwrite=true"):
        run_extraction(compose(*overrides(data, out, "extract.max_length=128")))
    replaced = run_extraction(
        compose(*overrides(data, out, "extract.max_length=128", "extract.overwrite=true"))
    )
    assert replaced.resumed_shards == 0
    assert read_manifest(out).settings["max_length"] == 128


def test_a_damaged_recorded_shard_is_written_again(compose, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(6))
    out = tmp_path / "out"
    run_extraction(compose(*overrides(data, out)))
    original = (out / "shard-00001.safetensors").read_bytes()
    (out / "shard-00001.safetensors").write_bytes(original[:100])
    summary = run_extraction(compose(*overrides(data, out)))
    assert summary.resumed_shards == summary.shards - 1
    assert (out / "shard-00001.safetensors").read_bytes() == original


def test_a_same_size_damaged_shard_is_found_by_its_checksum_and_written_again(
    compose, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(6))
    out = tmp_path / "out"
    first = run_extraction(compose(*overrides(data, out)))
    shard = out / "shard-00001.safetensors"
    original = shard.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x10
    shard.write_bytes(bytes(damaged))
    again = run_extraction(compose(*overrides(data, out)))
    assert shard.read_bytes() == original
    assert again.resumed_shards == first.shards - 1
    ShardReader(out, verify=True)


def test_disk_check_counts_the_target_head(compose, tmp_path: Path) -> None:
    """The shards of two conversations fit in 1 MiB; the target head (24 MiB) does not: refused before work."""
    data = write_jsonl(tmp_path / "d.jsonl", some_records(2))
    with small_volume(tmp_path / "vol", 1 << 20) as volume:
        with pytest.raises(ConfigError, match=r"not enough disk.*target head"):
            run_extraction(compose(*overrides(data, volume / "out")))
        assert not list((volume / "out").glob("*.safetensors"))


def test_extracted_files_get_the_mode_of_ordinary_files(compose, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(2))
    old = os.umask(0o022)
    try:
        run_extraction(compose(*overrides(data, tmp_path / "out")))
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "out").iterdir()}
    assert set(modes.values()) == {"0o644"}, modes


def test_disk_too_small_is_refused_before_work(
    compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(2))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 10))
    with pytest.raises(ConfigError, match="not enough disk"):
        run_extraction(compose(*overrides(data, tmp_path / "out")))
    assert not list((tmp_path / "out").glob("shard-*"))


def test_empty_and_assistant_less_data(compose, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        run_extraction(compose(*overrides(empty, tmp_path / "out")))
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "a", "conversations": [{"role": "user", "content": "hi"}]}]
    )
    with pytest.raises(DataError, match="assistant"):
        run_extraction(compose(*overrides(prompts, tmp_path / "out")))


def test_jsonl_dataset_without_files_says_what_to_pass(compose, tmp_path: Path) -> None:
    """Issue 22: it ended in omegaconf's MissingMandatoryValue traceback."""
    no_paths = [o for o in overrides(tmp_path / "unused.jsonl", tmp_path / "out") if "dataset.paths" not in o]
    with pytest.raises(ConfigError, match=r"dataset=jsonl .* dataset.paths=\[/data/a.jsonl,/data/b.jsonl\]"):
        run_extraction(compose(*no_paths))


def test_layer_id_out_of_range(compose, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(2))
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        run_extraction(compose(*overrides(data, tmp_path / "out", "model.aux_layer_ids=[2,3,9]")))


def extract_cmd(data: Path, out: Path, cache: Path) -> list[str]:
    return [
        sys.executable,
        str(REPO_ROOT / "extract.py"),
        *overrides(data, out, "extract.shard_tokens=300"),
        f"paths.cache_dir={cache}",
    ]


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "process ended"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


@pytest.mark.e2e
def test_killed_runs_resume_to_byte_identical_shards(tmp_path: Path, model_cache: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(24))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference = tmp_path / "reference"
    subprocess.run(extract_cmd(data, reference, model_cache), check=True, env=env, capture_output=True)
    expected = {p.name: p.read_bytes() for p in reference.glob("shard-*")}
    assert len(expected) >= 6

    out = tmp_path / "killed"
    for kill_after in ("shard-00000.safetensors", "shard-00002.safetensors", "shard-00004.safetensors"):
        proc = subprocess.Popen(
            extract_cmd(data, out, model_cache), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        wait_for(out / kill_after, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not read_manifest(out).complete
    done = subprocess.run(extract_cmd(data, out, model_cache), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resumed" in done.stdout
    assert {p.name: p.read_bytes() for p in out.glob("shard-*")} == expected
    assert read_manifest(out).complete
    assert (out / "token_counts.safetensors").read_bytes() == (
        reference / "token_counts.safetensors"
    ).read_bytes()


@pytest.mark.e2e
def test_bad_input_ends_in_one_clear_line(tmp_path: Path, model_cache: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "conversations": [{"role": "user", "content": "hi"}]}\n{not json\n')
    proc = subprocess.run(extract_cmd(bad, tmp_path / "out", model_cache), capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"{bad}:2" in proc.stderr
    typo = subprocess.run(
        [*extract_cmd(bad, tmp_path / "out", model_cache), "extract.bach_tokens=4"],
        capture_output=True,
        text=True,
    )
    assert typo.returncode != 0 and "bach_tokens" in typo.stderr


def test_conversation_regeneration_leaves_empty_is_skipped_and_counted(compose, tmp_path: Path) -> None:
    # Its first prompt leaves no room for an answer within extract.max_length: regeneration keeps no turn.
    too_long = {"id": "long", "conversations": [{"role": "user", "content": "word " * 400},
                                                {"role": "assistant", "content": "ok"}]}  # fmt: skip
    data = write_jsonl(tmp_path / "d.jsonl", [*some_records(2), too_long])
    regen = [
        "extract.regenerate.enabled=true",
        "extract.regenerate.max_new_tokens=4",
        f"paths.data_dir={tmp_path}",
    ]
    summary = run_extraction(compose(*overrides(data, tmp_path / "out", *regen)))
    assert summary.sequences == 2 and summary.skipped == 1


def test_conversations_without_assistant_are_skipped_and_counted(compose, tmp_path: Path) -> None:
    prompt_only = {"id": "p", "conversations": [{"role": "user", "content": "no answer here"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [*some_records(2), prompt_only])
    summary = run_extraction(compose(*overrides(data, tmp_path / "out")))
    assert summary.sequences == 2 and summary.skipped == 1
    with pytest.raises(DataError, match="d.jsonl:3"):
        run_extraction(compose(*overrides(data, tmp_path / "strict", "extract.strict=true")))


def test_answers_of_another_model_are_not_imported(compose, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(2))
    shipped = ASSETS_DIR / "smollm2_135m_shared_all.jsonl.gz"
    regen = ["extract.regenerate.enabled=true", f"extract.regenerate.import_from={shipped}"]
    with pytest.raises(ConfigError, match="does not start with the target's name 'tiny_llama'"):
        run_extraction(compose(*overrides(data, tmp_path / "out", *regen)))


def test_sampled_answers_are_extra_sequences_with_their_own_ids(compose, tmp_path: Path) -> None:
    """samples_per_prompt=3: the greedy answers (the same file as with 1) plus two sampled copies per
    conversation, ids <id>#s1 and <id>#s2, each different from the greedy answer and reproducible."""
    data = write_jsonl(tmp_path / "d.jsonl", some_records(3))
    regen = [
        "extract.regenerate.enabled=true",
        "extract.regenerate.max_new_tokens=6",
        f"paths.data_dir={tmp_path}",
    ]
    one = run_extraction(compose(*overrides(data, tmp_path / "one", *regen)))
    greedy_files = sorted((tmp_path / "regenerated").iterdir())
    sampled = [*regen, "extract.regenerate.samples_per_prompt=3", "extract.regenerate.sample_temperature=1.5"]
    three = run_extraction(compose(*overrides(data, tmp_path / "three", *sampled)))
    files = sorted((tmp_path / "regenerated").iterdir())
    assert len(files) == 2 and greedy_files[0] in files  # the greedy file reused, one file for the samples
    assert three.sequences == 3 * one.sequences
    records = [
        json.loads(line) for line in next(f for f in files if f not in greedy_files).read_text().splitlines()
    ]
    ids = sorted(r["id"] for r in records)
    source_ids = sorted(r["id"] for r in some_records(3))
    assert ids == sorted(f"{i}#s{k}" for i in source_ids for k in (1, 2))
    greedy = {json.loads(line)["id"]: json.loads(line) for line in greedy_files[0].read_text().splitlines()}
    answers = {r["id"]: r["conversations"][1]["content"] for r in records}
    assert any(answers[f"{i}#s1"] != greedy[i]["conversations"][1]["content"] for i in source_ids)
    assert any(answers[f"{i}#s1"] != answers[f"{i}#s2"] for i in source_ids)
    # Run again in a fresh folder: every answer comes back from the files, identical.
    again = run_extraction(compose(*overrides(data, tmp_path / "again", *sampled)))
    assert again.regenerate.resumed == 3 * 3 and again.tokens == three.tokens


def test_sampled_answers_for_the_first_conversations_only(compose, tmp_path: Path) -> None:
    """sampled_conversations=1: every conversation answered greedily, only the first one sampled too."""
    data = write_jsonl(tmp_path / "d.jsonl", some_records(3))
    regen = ["extract.regenerate.enabled=true", "extract.regenerate.max_new_tokens=6", f"paths.data_dir={tmp_path}",
             "extract.regenerate.samples_per_prompt=2", "extract.regenerate.sampled_conversations=1"]  # fmt: skip
    summary = run_extraction(compose(*overrides(data, tmp_path / "out", *regen)))
    assert summary.sequences == 3 + 1
    sampled = [f for f in (tmp_path / "regenerated").iterdir() if "#s1" in f.read_text()]
    assert [json.loads(line)["id"] for line in sampled[0].read_text().splitlines()] == [
        f"{some_records(3)[0]['id']}#s1"
    ]


def test_sampled_answers_need_a_temperature(compose, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", some_records(2))
    bad = ["extract.regenerate.enabled=true", "extract.regenerate.samples_per_prompt=2",
           "extract.regenerate.sample_temperature=0"]  # fmt: skip
    with pytest.raises(ConfigError, match="extract.regenerate.sample_temperature"):
        run_extraction(compose(*overrides(data, tmp_path / "out", *bad)))
