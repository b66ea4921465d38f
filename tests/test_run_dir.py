"""RunDir: a training run folder's layout, the newest run, and the settings it was trained with."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from eaglet.errors import ConfigError, DataError
from eaglet.run_dir import RunDir, resolve_ckpt_path


def _run(output_dir: Path, name: str, age: float, *, head: bool = True) -> RunDir:
    run = RunDir(output_dir / "train" / name)
    run.path.mkdir(parents=True)
    run.report_file.write_text("{}")
    os.utime(run.report_file, (time.time() - age, time.time() - age))
    if head:
        run.draft_dir.mkdir()
        (run.draft_dir / "config.json").write_text("{}")
    return run


def test_layout(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.draft_dir == tmp_path / "draft"
    assert run.last_checkpoint == tmp_path / "checkpoints" / "last.ckpt"
    assert (run.report_file.name, run.results_file.name) == ("report.json", "eval.json")
    assert run.settings_file == tmp_path / ".hydra" / "config.yaml"
    assert run.export_dir("speculators") == tmp_path / "export-speculators"


def test_newest_run_with_a_report(tmp_path: Path) -> None:
    _run(tmp_path, "a", age=0)
    older = _run(tmp_path, "b", age=10)
    assert RunDir.resolve(None, tmp_path, key="eval.run").path.name == "a"
    assert RunDir.resolve("last", tmp_path, key="eval.run") == RunDir.newest(tmp_path, key="eval.run")
    assert RunDir.resolve(str(older.path), tmp_path, key="eval.run") == older
    with pytest.raises(ConfigError, match="no finished training run"):
        RunDir.newest(tmp_path / "empty", key="eval.run")


def test_a_named_run_needs_its_head(tmp_path: Path) -> None:
    headless = _run(tmp_path, "a", age=0, head=False)
    assert not headless.has_head()
    with pytest.raises(DataError, match=r"no finished head \(no draft/config.json, nor config.json \+ model"):
        RunDir.resolve(str(headless.path), tmp_path, key="export.run")


def test_a_head_folder_is_a_run_whose_head_is_the_folder(tmp_path: Path) -> None:
    head = tmp_path / "export"
    head.mkdir()
    (head / "config.json").write_text("{}")
    assert not RunDir(head).has_head()  # weights missing: not a head
    (head / "model.safetensors").write_bytes(b"")
    assert RunDir(head).draft_dir == head and RunDir(head).has_head()
    assert RunDir.resolve(str(head), tmp_path, key="eval.run").results_file == head / "eval.json"
    run = _run(tmp_path, "a", age=0)  # a run keeps its draft/ even beside files of these names
    (run.path / "config.json").write_text("{}")
    (run.path / "model.safetensors").write_bytes(b"")
    assert run.draft_dir == run.path / "draft"


def test_settings_read_back(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.settings() is None
    run.settings_file.parent.mkdir()
    run.settings_file.write_text("trainer: {ttt_steps: 5}\nmodel: {name: tiny}\n")
    settings = run.settings()
    assert settings is not None and settings.trainer.ttt_steps == 5 and settings.model.name == "tiny"


def test_ckpt_path_last_is_the_newest_runs_last_checkpoint(tmp_path: Path) -> None:
    assert resolve_ckpt_path(None, tmp_path) is None
    with pytest.raises(ConfigError, match="ckpt_path=last: no earlier run"):
        resolve_ckpt_path("last", tmp_path)
    for name, age in (("a", 0), ("b", 10)):
        ckpt = RunDir(tmp_path / "train" / name).last_checkpoint
        ckpt.parent.mkdir(parents=True)
        ckpt.write_bytes(b"x")
        os.utime(ckpt, (time.time() - age, time.time() - age))
    assert resolve_ckpt_path("last", tmp_path) == str(RunDir(tmp_path / "train" / "a").last_checkpoint)
