"""Fault injection into training at tiny sizes: kill -9 at many points, and full disks.

The guarantees:
- a run killed anywhere, and resumed each time with ckpt_path=last, ends in its own folder with the best
  checkpoint and the exported head (bitwise) of the run never killed;
- a write that finds the disk full (a checkpoint, the exported head) ends in one message naming the folder and
  what to do, and leaves nothing half-written under a final name: the previous last.ckpt, or head, is kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_export import AUX, _config, _head
from test_train import (  # noqa: F401  (shards: a fixture)
    ended_as_asked,
    shards,
    start_train,
    train_overrides,
    train_process,
    val_curve,
)
from volumes import files_under, small_volume

import eaglet.train.run
from eaglet.errors import DiskFullError
from eaglet.formats.writer import export_eagle
from eaglet.run_dir import RunDir
from eaglet.train.checkpoints import CheckpointFiles
from eaglet.train.run import run_training

# 8 steps, last.ckpt after each, validation after every second: the best is step 6's, step 8's only ties it.
SCENARIO = (
    "trainer.max_steps=8",
    "trainer.global_batch_tokens=512",
    "trainer.val_every_n_steps=2",
    "trainer.checkpoint_every_n_steps=1",
    "trainer.lr=3e-2",
    "draft.vocab_size=512",
)
# Where one run is killed, in turn (see test_train.KILLABLE_TRAIN); each resume starts from the last.ckpt
# that the kill before left.
KILLS = (
    "on_after_backward@3",  # inside step 4: gradients computed, not applied
    "on_validation_start@4",  # after step 3's checkpoint, before the next validation
    "on_validation_end@6",  # the validation that finds the best head done, its checkpoint not written yet
    "save@2",  # best-step6.ckpt written, last.ckpt not renamed into place yet
    "final@0",  # training done, validating the selected checkpoint, nothing exported yet
)


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


def best_name(run: RunDir) -> str:
    return Path(json.loads(run.report_file.read_text())["best_checkpoint"]).name


@pytest.mark.faults
def test_training_killed_anywhere_resumes_to_the_same_head(
    shards: Path,  # noqa: F811
    tmp_path: Path,
    model_cache: Path,
) -> None:
    uninterrupted = start_train(
        shards, tmp_path / "whole", model_cache, *SCENARIO
    )  # alongside: half the wait
    out = tmp_path / "killed"
    train_process(shards, out, model_cache, *SCENARIO, kill_at=KILLS[0])
    for kill_at in KILLS[1:]:
        train_process(shards, out, model_cache, *SCENARIO, "ckpt_path=last", kill_at=kill_at)
    train_process(shards, out, model_cache, *SCENARIO, "ckpt_path=last")
    ended_as_asked(uninterrupted)
    whole = RunDir.newest(tmp_path / "whole", key="eval.run")
    assert best_name(whole) == "best-step6.ckpt"

    run = RunDir.newest(out, key="eval.run")
    assert [p.name for p in (out / "train").iterdir()] == [run.path.name]
    assert best_name(run) == best_name(whole)
    for name in ("model.safetensors", "config.json"):
        assert (run.draft_dir / name).read_bytes() == (whole.draft_dir / name).read_bytes(), name
    # No second version of a file, no temporary file of a killed write.
    assert files_under(run.checkpoints_dir).keys() == files_under(whole.checkpoints_dir).keys()
    for name in (best_name(whole), RunDir.LAST_CHECKPOINT):
        got, want = state_dict(run.checkpoints_dir / name), state_dict(whole.checkpoints_dir / name)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), name
    assert val_curve(run) == val_curve(whole)


def fill(volume: Path, leave: int) -> Path:
    """Take all but `leave` bytes of the volume's free space."""
    filler = volume / "filler"
    size = shutil.disk_usage(volume).free - leave
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return filler


@pytest.mark.faults
def test_full_disk_at_a_checkpoint_keeps_the_previous_last_ckpt(
    compose,
    shards: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with small_volume(tmp_path / "volume", 128 << 20) as volume:
        run = RunDir(volume / "train" / "run")  # where ckpt_path=last looks
        saved: list[str] = []
        save = CheckpointFiles.save_checkpoint

        def save_then_fill(self, checkpoint, path, storage_options=None) -> None:
            save(self, checkpoint, path, storage_options)
            saved.append(Path(path).name)
            if len(saved) == 2:  # last.ckpt of step 1, best-step2.ckpt; next: last.ckpt of step 2
                fill(volume, leave=1 << 20)

        monkeypatch.setattr(CheckpointFiles, "save_checkpoint", save_then_fill)
        with pytest.raises(DiskFullError) as failed:
            run_training(
                compose(*train_overrides(shards, volume, *SCENARIO, "trainer.max_steps=4")), run.path
            )
        message = str(failed.value)
        assert f"disk of {run.checkpoints_dir} while saving last.ckpt" in message
        assert "train.py command with ckpt_path=last added" in message
        assert saved == ["last.ckpt", "best-step2.ckpt"]
        assert files_under(run.checkpoints_dir).keys() == {"last.ckpt", "best-step2.ckpt"}
        assert torch.load(run.last_checkpoint, weights_only=True)["global_step"] == 1

        # What the message says to do: free space, then resume; the run continues in its folder.
        monkeypatch.undo()
        (volume / "filler").unlink()
        resume = compose(*train_overrides(shards, volume, *SCENARIO, "trainer.max_steps=4", "ckpt_path=last"))
        summary = run_training(resume, volume / "train" / "next")
        assert summary.run_dir == str(run.path) and summary.steps == 4 and run.has_head()


@pytest.mark.faults
def test_full_disk_at_the_export_leaves_no_head_and_says_how_to_finish(
    compose,
    shards: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with small_volume(tmp_path / "volume", 128 << 20) as volume:
        run = RunDir(volume / "train" / "run")
        export = eaglet.train.run.export_eagle

        def fill_then_export(*args, **kwargs) -> Path:
            fill(volume, leave=1 << 20)  # the head is about 6 MiB
            return export(*args, **kwargs)

        monkeypatch.setattr(eaglet.train.run, "export_eagle", fill_then_export)
        overrides = train_overrides(shards, volume, *SCENARIO, "trainer.max_steps=2")
        with pytest.raises(DiskFullError) as failed:
            run_training(compose(*overrides), run.path)
        message = str(failed.value)
        assert f"disk of {run.draft_dir} while exporting the head" in message
        assert "train.py command with ckpt_path=last added" in message
        assert files_under(run.draft_dir) == {}

        monkeypatch.undo()
        (volume / "filler").unlink()
        summary = run_training(compose(*overrides, "ckpt_path=last"), volume / "train" / "next")
        assert summary.run_dir == str(run.path) and run.has_head()


@pytest.mark.faults
def test_full_disk_keeps_the_previous_head(tmp_path: Path) -> None:
    cfg = _config()
    with small_volume(tmp_path / "volume", 16 << 20) as volume:
        out = volume / "draft"
        export_eagle(_head(cfg, seed=0), cfg, out, aux_layer_ids=AUX)
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        fill(volume, leave=64 << 10)
        with pytest.raises(DiskFullError, match=re.escape(f"disk of {out} while writing the head")):
            export_eagle(_head(cfg, seed=1), cfg, out, aux_layer_ids=AUX, overwrite=True)
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
