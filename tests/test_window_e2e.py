"""Window training end to end: `python extract.py extract.max_disk_gb=...` and `python train.py
trainer.features=window` run side by side on a tiny random Llama, the shard folder's bytes read every few ms;
the same with each killed (kill -9) and resumed; and the three ways to train (shards, online, window) on the
embedded SmolLM2 target at tiny sizes."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_window import BUDGET_GB, data_overrides, files_bytes, train_overrides

from eaglet.config import REPO_ROOT
from eaglet.shards import read_manifest, shard_name
from eaglet.shards.window import read_retired, read_stream_plan

EPOCHS = 2  # trainer.max_epochs of train_overrides: each training sequence read twice
TIMEOUT = 300


class Watched:
    """The processes of one scenario and the most bytes their shard folder ever held."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root, self.cache = root, cache
        self.shards = root / "shards"
        self.most = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self.shards.is_dir():
                self.most = max(self.most, files_bytes(self.shards))
            time.sleep(0.003)

    def extract(self, log: str) -> subprocess.Popen:
        cmd = [
            sys.executable, str(REPO_ROOT / "extract.py"), *data_overrides(self.shards),
            f"paths.cache_dir={self.cache}", f"paths.data_dir={self.root / 'data'}",
            f"hydra.run.dir={self.root / 'extract-run'}",
        ]  # fmt: skip
        return self._start(cmd, log)

    def train(self, log: str, *extra: str) -> subprocess.Popen:
        cmd = [
            sys.executable, str(REPO_ROOT / "train.py"),
            *train_overrides(self.shards, self.root / "outputs", "trainer.checkpoint_every_n_steps=3", *extra),
            f"paths.cache_dir={self.cache}", f"hydra.run.dir={self.root / 'outputs' / log}",
        ]  # fmt: skip
        return self._start(cmd, log)

    def _start(self, cmd: list[str], log: str) -> subprocess.Popen:
        out = open(self.root / f"{log}.log", "w")  # noqa: SIM115  (closed with the process)
        return subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()

    def finish(self, *procs: subprocess.Popen) -> None:
        try:
            for proc in procs:
                proc.wait(timeout=TIMEOUT)
        finally:
            self._stop.set()
            self._watcher.join()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert proc.poll() is None, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {TIMEOUT} s"
        time.sleep(0.02)


def recorded_shards(folder: Path) -> int:
    try:
        return len(read_manifest(folder).shards)
    except Exception:  # noqa: BLE001  (not written yet)
        return 0


def trained_tokens(metrics: Path) -> int:
    """Real tokens of every optimizer step of the run (one micro-batch each here); a resumed run's rows replace
    those of the steps it trained again."""
    rows = csv.DictReader(open(metrics))
    return round(sum(float(r["train/real_tokens"]) for r in rows if r.get("train/real_tokens")))


def state_dict(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


def check_finished(w: Watched, run: Path) -> None:
    """What every scenario ends with: the bound held, every training shard read twice and deleted, the head."""
    plan = read_stream_plan(w.shards)
    assert w.most <= BUDGET_GB * 1e9 < plan.fixed_bytes + sum(plan.shard_bytes), w.most
    assert read_manifest(w.shards).complete
    assert read_retired(w.shards) == list(range(1, plan.shards))
    assert sorted(p.name for p in w.shards.glob("shard-*")) == [shard_name(0)]  # validation stays
    assert trained_tokens(run / "metrics.csv") == EPOCHS * sum(plan.shard_tokens[1:])
    assert (run / "draft" / "model.safetensors").is_file()
    assert json.loads((run / "report.json").read_text())["epochs"] == EPOCHS


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Watched:
    """Training started first (it waits for extraction), then extraction; neither interrupted."""
    w = Watched(tmp_path_factory.mktemp("side_by_side"), model_cache)
    train = w.train("train")
    try:  # extraction starts once training is waiting for it, however long training takes to start
        wait_until(lambda: "waiting for extraction to start" in w.log("train"), train, "wait for extraction")
    except BaseException:
        train.kill()
        w.finish(train)
        raise
    extract = w.extract("extract")
    w.finish(train, extract)
    assert extract.returncode == 0, w.log("extract")[-3000:]
    assert train.returncode == 0, w.log("train")[-3000:]
    return w


@pytest.mark.e2e
def test_extraction_and_training_side_by_side_stay_within_the_bound(side_by_side: Watched) -> None:
    w = side_by_side
    check_finished(w, w.root / "outputs" / "train")
    assert "window: waiting for training to delete shards it finished with" in w.log("extract")
    assert "window: waiting for extraction to start" in w.log("train")


@pytest.mark.faults
def test_extraction_and_training_killed_and_resumed_train_what_the_uninterrupted_run_did(
    side_by_side: Watched, tmp_path: Path, model_cache: Path
) -> None:
    w = Watched(tmp_path, model_cache)
    train = w.train("train")
    extract = w.extract("extract")
    try:
        wait_until(lambda: recorded_shards(w.shards) >= 3, extract, "third shard")
        extract.send_signal(signal.SIGKILL)
        extract.wait()
        extract = w.extract("extract-resumed")

        last = w.root / "outputs" / "train" / "checkpoints" / "last.ckpt"
        wait_until(last.exists, train, "checkpoint")
        time.sleep(0.5)  # metrics.csv gets the step's row just after its checkpoint
        train.send_signal(signal.SIGKILL)
        train.wait()
        saved = torch.load(last, weights_only=True)
        resumed = w.train("train-resumed", f"ckpt_path={last}")
    finally:
        w.finish(extract, train)
    w.finish(resumed)
    assert extract.returncode == 0, w.log("extract-resumed")[-3000:]
    assert resumed.returncode == 0, w.log("train-resumed")[-3000:]
    whole = side_by_side.root / "outputs" / "train" / "checkpoints" / "last.ckpt"
    expected = torch.load(whole, weights_only=True)
    assert 0 < saved["global_step"] < expected["global_step"], "the kill should land inside the run"

    run = w.root / "outputs" / "train"  # the resumed run went on in the folder of its checkpoint
    check_finished(w, run)
    got = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert got["global_step"] == expected["global_step"]
    for name, tensor in expected["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.e2e
def test_the_three_ways_to_train_on_the_embedded_target(compose, tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct (the embedded default) on four conversations: one extraction under a bound that
    holds it all, trained from its shards, online from its tokens, then in window mode (which deletes them)."""
    from eaglet.extract.stage import run_extraction
    from eaglet.train.run import run_training

    shards = tmp_path / "shards"
    data = [
        "dataset=oasst_en100",
        "dataset.max_records_per_file=4",
        "extract.regenerate.enabled=false",
        f"extract.output_dir={shards}",
        "extract.max_length=64",
        "extract.shard_tokens=128",
        "draft.vocab_size=32",
        "extract.max_disk_gb=1",
    ]
    train = [
        f"paths.output_dir={tmp_path}",
        "hardware.tokens_per_device=128",
        "trainer.global_batch_tokens=128",
        "trainer.val_every_n_steps=50",  # validated once, at the end: checkpoints of this head weigh 100 MB
        "trainer.checkpoint_every_n_steps=50",
        "trainer.val_fraction=0.2",
        "trainer.max_epochs=1",
        "trainer.embed_dtype=bfloat16",
    ]
    run_extraction(compose(*data))
    planned = read_stream_plan(shards).shards
    for mode, extra in (
        ("shards", ["trainer.max_steps=1"]),
        ("online", ["trainer.max_steps=1"]),
        ("window", []),
    ):
        summary = run_training(compose(*data, *train, f"trainer.features={mode}", *extra), tmp_path / mode)
        assert summary.steps >= 1 and 1.0 <= summary.tau_sim, mode
        assert (tmp_path / mode / "draft" / "model.safetensors").is_file(), mode
    assert read_retired(shards) == list(range(1, planned))
