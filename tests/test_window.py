"""Bounded disk for shard-backed runs (extract.max_disk_gb, trainer.features=window): the schedule of rounds, the
config's refusals, extraction under the bound beside a consumer, and window training on a tiny random Llama
(each sequence read max_epochs times, a shard deleted only once a checkpoint covers it)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import eaglet.train.window
from eaglet.config.window import shard_gb
from eaglet.errors import ConfigError, DataError
from eaglet.extract.stage import run_extraction
from eaglet.shards import ShardReader, read_manifest, shard_name
from eaglet.shards.window import (
    StreamPlan,
    folder_bytes,
    read_retired,
    read_stream_plan,
    retire,
)
from eaglet.train.datamodule import PackedShardDataset
from eaglet.train.run import run_training
from eaglet.train.window_schedule import WindowSchedule
from eaglet.train.window_setup import check_room

# A 12.6 MB target head (bf16) and ~265 KB shards: the bound below holds the head and five of the eight.
BUDGET_GB = 0.0144
SHARDS = 8


def data_overrides(out: Path, *extra: str) -> list[str]:
    return [
        "model=tiny_llama",
        "model.dtype=bfloat16",
        "dataset=oasst_en100",
        "dataset.max_records_per_file=16",
        "extract.regenerate.enabled=false",
        f"extract.output_dir={out}",
        "extract.max_length=256",
        "extract.shard_tokens=512",  # 8 shards
        "draft.vocab_size=256",
        f"extract.max_disk_gb={BUDGET_GB}",
        *extra,
    ]


def train_overrides(out: Path, runs: Path, *extra: str) -> list[str]:
    return [
        *data_overrides(out),
        f"paths.output_dir={runs}",
        "hardware.tokens_per_device=512",
        "trainer.global_batch_tokens=512",
        "trainer.max_epochs=2",
        "trainer.val_every_n_steps=8",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.val_fraction=0.1",
        "trainer.features=window",
        "trainer.window_timeout_s=30",
        *extra,
    ]


def files_bytes(folder: Path) -> int:
    """Everything in the folder on disk, temporaries of writes in progress included."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    """A window folder extracted to the end under a bound that holds it all (nobody retires anything)."""
    from conftest import compose_config

    out = tmp_path_factory.mktemp("window") / "whole"
    run_extraction(compose_config(model_cache, *data_overrides(out, "extract.max_disk_gb=1")))
    return out


# ---- the schedule --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "epochs", "validation"), [(1, 1, True), (2, 2, False), (5, 2, True), (4, 1, True)]
)
def test_every_training_sequence_is_read_max_epochs_times_inside_its_window(
    window: int, epochs: int, validation: bool
) -> None:
    shards = 9
    schedule = WindowSchedule(shards, window=window, epochs=epochs, validation=validation, seed=3)
    ids = {s: np.arange(40 * s, 40 * s + 40 - s) for s in range(shards)}
    reads: Counter[int] = Counter()
    for r in range(schedule.rounds):
        in_round = schedule.round_shards(r)
        for s in range(shards):
            read = schedule.read_in_round(r, s, len(ids[s]))
            assert not read.any() or s in in_round, (r, s)
            reads.update(ids[s][read].tolist())
        assert any(schedule.read_in_round(r, s, len(ids[s])).any() for s in in_round), r  # never empty
        # A shard is done with once the rounds after it no longer read it.
        for s in schedule.done_with(r + 1):
            assert all(s not in schedule.round_shards(later) for later in range(r + 1, schedule.rounds))
    trained = [i for s in range(schedule.first, shards) for i in ids[s]]
    assert sorted(reads) == trained and set(reads.values()) == {epochs}
    assert schedule.done_with(schedule.rounds) == list(range(schedule.first, shards))
    assert 0 not in reads or not validation


def test_one_planned_shard_and_validation_leave_nothing_to_train() -> None:
    with pytest.raises(DataError, match="trainer.val_fraction=0"):
        WindowSchedule(1, window=1, epochs=1, validation=True, seed=0)


# ---- the config --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["trainer.features=window", "extract.max_disk_gb=null"], "set extract.max_disk_gb"),
        (["extract.max_disk_gb=0.0001"], "extract.max_disk_gb=0.0001 holds fewer than two shards"),
        (
            ["trainer.features=window", "extract.max_disk_gb=0.0009"],
            "fewer than the 4 shards window training",
        ),
        (["extract.features=tokens"], "leave extract.max_disk_gb=null"),
        (["trainer.features=window", "trainer.window_shards=1"], "trainer.window_shards=1 is less than"),
        (["trainer.features=window", "trainer.max_steps=3"], "set trainer.max_steps=-1"),
        (["trainer.features=window", "trainer.num_workers=1"], "set trainer.num_workers=0"),
        (["extract.max_disk_gb=-1"], "extract.max_disk_gb must be > 0"),
    ],
)
def test_bad_combinations_fail_at_composition_naming_the_key(compose, tmp_path: Path, extra, match) -> None:
    with pytest.raises(ConfigError, match=match):
        compose(*train_overrides(tmp_path, tmp_path, "trainer.features=shards", *extra))


def test_the_config_counts_shards_as_the_writer_stores_them(compose, tmp_path: Path) -> None:
    from eaglet.shards import bytes_per_token

    cfg = compose(*data_overrides(tmp_path))
    assert shard_gb(cfg) == 512 * bytes_per_token(3, 64, 2) / 1e9


def test_a_bound_too_small_for_the_window_is_refused_before_training() -> None:
    plan = StreamPlan(
        10_000, shard_bytes=[1000] * 6, shard_tokens=[10] * 6, shard_sequences=[3] * 6, fixed_bytes=6000
    )
    check_room(plan, WindowSchedule(6, window=2, epochs=2, validation=True, seed=0))  # 6000 + 4 x 1000
    with pytest.raises(
        ConfigError, match=r"extract.max_disk_gb=1e-05 cannot hold window training.*trainer.window"
    ):
        check_room(plan, WindowSchedule(6, window=3, epochs=3, validation=True, seed=0))
    # A wider window than max_epochs spreads each shard over window_shards rounds: they must all get some.
    with pytest.raises(ConfigError, match="trainer.window_shards=4 .* holds only 3"):
        check_room(plan, WindowSchedule(6, window=4, epochs=1, validation=False, seed=0))


# ---- the folder's records -----------------------------------------------------------------------------------


def test_a_shard_is_recorded_retired_before_its_file_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for index in range(3):
        (tmp_path / shard_name(index)).write_bytes(b"x" * 10)
    real_unlink = Path.unlink

    def killed(self: Path, *args, **kwargs) -> None:
        raise KeyboardInterrupt("killed between the record and the deletion")

    monkeypatch.setattr(Path, "unlink", killed)
    with pytest.raises(KeyboardInterrupt):
        retire(tmp_path, [0, 1], run="run-a")
    assert read_retired(tmp_path) == [0, 1] and (tmp_path / shard_name(0)).exists()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert retire(tmp_path, [1, 2], run="run-a") == [2]  # the earlier ones' files go too
    assert read_retired(tmp_path) == [0, 1, 2] and folder_bytes(tmp_path) == len(
        (tmp_path / "retired.json").read_bytes()
    )


# ---- extraction under the bound --------------------------------------------------------------------------------


def test_extraction_stays_within_the_bound_while_a_consumer_frees_room(
    model_cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """Extraction in a thread; here a stand-in for training, slower than extraction, retires the oldest recorded
    training shard every 0.2 s while the folder's bytes and its JSON records are read every few ms."""
    from conftest import compose_config

    out = tmp_path / "out"
    cfg = compose_config(model_cache, *data_overrides(out, "extract.window_timeout_s=30"))
    failed: list[BaseException] = []

    def extract() -> None:
        try:
            run_extraction(cfg)
        except BaseException as e:  # noqa: BLE001  (reported by the test)
            failed.append(e)

    worker = threading.Thread(target=extract)
    worker.start()
    most, reads, last_retired = 0, 0, time.monotonic()
    while worker.is_alive():
        if out.is_dir():
            most = max(most, files_bytes(out))
            manifest = read_manifest(out) if (out / "manifest.json").exists() else None
            for name in ("window.json", "retired.json"):  # replaced whole: always parses
                if (out / name).exists():
                    json.loads((out / name).read_text())
                    reads += 1
            if manifest is not None and time.monotonic() - last_retired > 0.2:
                kept = [i for i in range(1, len(manifest.shards)) if i not in read_retired(out)]
                retire(out, kept[:1], run="stand-in")
                last_retired = time.monotonic()
        time.sleep(0.005)
    worker.join()
    assert not failed, failed
    plan, manifest = read_stream_plan(out), read_manifest(out)
    assert manifest.complete and len(manifest.shards) == plan.shards == SHARDS and reads > 0
    assert most <= BUDGET_GB * 1e9 < plan.fixed_bytes + sum(plan.shard_bytes)  # the bound was what held it
    assert "window: waiting for training to delete shards" in capfd.readouterr().out

    # A rerun (the same command) finds the retired shards done with: nothing is written again.
    summary = run_extraction(cfg)
    assert summary.resumed_shards == SHARDS and summary.sequences == manifest.totals["sequences"]
    retired = read_retired(out)
    assert sorted(p.name for p in out.glob("shard-*")) == [
        shard_name(i) for i in range(SHARDS) if i not in retired
    ]


# ---- window training -----------------------------------------------------------------------------------------


def test_window_training_reads_each_sequence_max_epochs_times_and_deletes_only_checkpointed_shards(
    compose, whole: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    shutil.copytree(whole, out)
    cfg = compose(*train_overrides(out, tmp_path))
    trained: Counter[int] = Counter()
    lock = threading.Lock()
    get_item = PackedShardDataset.__getitem__

    def counted(self: PackedShardDataset, indices):
        if self.reader.shards[0].file != shard_name(0):  # not the validation shard
            with lock:
                trained.update(int(self.reader.sample_ids[i]) for i in indices)
        return get_item(self, indices)

    run = tmp_path / "run"
    real_retire = eaglet.train.window.retire
    covered: list[tuple[list[int], int]] = []

    def checked_retire(directory, shards, run_name):
        if not shards:
            return real_retire(directory, shards, run_name)
        # The checkpoint on disk must already cover the last round of every shard deleted.
        state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["WindowDataModule"]
        rounds = state["round"] + (state["batches_done"] == state["round_batches"])
        covered.append((list(shards), rounds))
        return real_retire(directory, shards, run_name)

    monkeypatch.setattr(PackedShardDataset, "__getitem__", counted)
    monkeypatch.setattr(eaglet.train.window, "retire", checked_retire)
    summary = run_training(cfg, run)

    schedule = WindowSchedule(SHARDS, window=2, epochs=2, validation=True, seed=0)
    for shards, rounds in covered:
        assert set(shards) <= set(schedule.done_with(rounds)), (shards, rounds)
    everything = ShardReader(whole)
    training = [int(i) for i in everything.sample_ids[everything.shards[0].num_sequences :]]
    assert sorted(trained) == sorted(training) and set(trained.values()) == {2}
    assert read_retired(out) == list(range(1, SHARDS))
    assert sorted(p.name for p in out.glob("shard-*")) == [shard_name(0)]  # validation stays
    assert summary.epochs == 2 and summary.steps > 0 and (run / "draft" / "model.safetensors").is_file()

    # Training from shards refuses the folder now: what it needs is gone, and it says why.
    with pytest.raises(DataError, match="window training deleted shards"):
        run_training(
            compose(*train_overrides(out, tmp_path, "trainer.features=shards")), tmp_path / "offline"
        )


def test_training_stops_after_the_timeout_naming_the_folder_and_the_extraction(
    compose, whole: Path, tmp_path: Path
) -> None:
    """Extraction died after four shards: training waits trainer.window_timeout_s for the fifth, then says what
    to do."""
    out = tmp_path / "out"
    shutil.copytree(whole, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"], manifest["status"] = manifest["shards"][:4], "in_progress"
    (out / "manifest.json").write_text(json.dumps(manifest))
    cfg = compose(*train_overrides(out, tmp_path, "trainer.window_timeout_s=0.5"))
    with pytest.raises(
        DataError, match=rf"{out}: waited 0.5 s for shard 4 from extraction.*python extract.py"
    ):
        run_training(cfg, tmp_path / "run")
    # Rounds 1 and 2 were trained and checkpointed; round 3's last micro-batch waits with Lightning, which
    # takes the next one (of round 4, shard 4) before it trains it.
    assert read_retired(out) == [1]


def test_sweeps_refuse_window_training(compose, tmp_path: Path) -> None:
    from eaglet.sweeps.trial import check_sweep_settings

    with pytest.raises(ConfigError, match="not with trainer.features=window"):
        check_sweep_settings(compose(*train_overrides(tmp_path, tmp_path)))
