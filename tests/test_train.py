"""Training end to end on shards written by the real extraction (tiny random Llama target)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglet.config import REPO_ROOT, shared_data_dir
from eaglet.errors import ConfigError, DataError
from eaglet.extract.stage import run_extraction
from eaglet.run_dir import RunDir
from eaglet.train.run import resolve_ckpt_path, run_training

SHARED = shared_data_dir()
CONTRACT = {
    "embed_tokens.weight", "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}  # fmt: skip


# Processes whose weights a test compares bit for bit: one thread each, so no reduction is split differently
# from one run to the next (runs that share the cores may otherwise get MKL's dynamic thread count), and MKL's
# reproducible mode, whose results do not depend on how the buffers happen to be aligned.
REPRODUCIBLE_CPU = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_DYNAMIC": "FALSE",
    "MKL_CBWR": "AUTO,STRICT",
}


def data_overrides(shards: Path) -> list[str]:
    return [
        "model=tiny_llama",
        "dataset=oasst_en100",
        "dataset.max_records_per_file=30",
        "extract.regenerate.enabled=false",
        f"extract.output_dir={shards}",
        "extract.max_length=256",
        "draft.vocab_size=256",
    ]


def train_overrides(shards: Path, out: Path, *extra: str) -> list[str]:
    return [
        *data_overrides(shards),
        f"paths.output_dir={out}",
        "hardware.tokens_per_device=512",
        "trainer.global_batch_tokens=1024",
        "trainer.max_steps=6",
        "trainer.val_every_n_steps=3",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.val_fraction=0.2",
        *extra,
    ]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Path:
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    import eaglet.config

    out = tmp_path_factory.mktemp("shards")
    with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=[f"paths.cache_dir={model_cache}", *data_overrides(out)])
    GlobalHydra.instance().clear()
    run_extraction(cfg)
    return out


def test_fit_writes_checkpoints_metrics_report_and_export(compose, shards: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    summary = run_training(compose(*train_overrides(shards, tmp_path)), run_dir)
    assert summary.steps == 6
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert Path(summary.best_checkpoint).is_file()
    metrics = (run_dir / "metrics.csv").read_text()
    for key in (
        "train/loss",
        "train/loss_0",
        "train/loss_2",
        "val/tau_sim",
        "val/acc_0",
        "train/device/items_per_sec",
        "train/device/samples_per_sec",
    ):
        assert key in metrics
    assert 1.0 <= summary.tau_sim <= 4.0 and len(summary.step_accuracy) == 3
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 6
    tensors = load_file(run_dir / "draft" / "model.safetensors")
    assert set(tensors) == CONTRACT
    config = json.loads((run_dir / "draft" / "config.json").read_text())
    assert config["draft_vocab_size"] == 256 and config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    # The checkpoint holds primitives and tensors only.
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["ttt_steps"] == 3


def test_a_training_seed_trains_another_head_on_the_same_data(compose, shards: Path, tmp_path: Path) -> None:
    def head(name: str, *extra: str) -> dict[str, torch.Tensor]:
        overrides = train_overrides(
            shards, tmp_path / name, "trainer.max_steps=2", "trainer.val_every_n_steps=2", *extra
        )
        run_training(compose(*overrides), tmp_path / name / "run")
        return load_file(tmp_path / name / "run" / "draft" / "model.safetensors")

    default = head("default")
    reseeded, again = head("seed7", "trainer.seed=7"), head("again", "trainer.seed=7")
    assert all(torch.equal(reseeded[k], again[k]) for k in reseeded)  # a seed gives one head
    trained = [k for k in default if default[k].is_floating_point()]
    assert max(float((reseeded[k] - default[k]).abs().max()) for k in trained) > 1e-3


def test_a_run_of_epochs_trains_every_epoch_when_its_micro_batches_do_not_divide_into_steps(
    compose, shards: Path, tmp_path: Path
) -> None:
    from eaglet.train.datamodule import ShardDataModule
    from eaglet.train.hardware import plan_trainer

    overrides = [o for o in train_overrides(shards, tmp_path) if not o.startswith("trainer.max_steps")] + [
        "trainer.max_epochs=2"
    ]
    cfg = compose(*overrides)
    plan = plan_trainer(cfg.hardware, cfg.trainer)
    datamodule = ShardDataModule(
        shards, plan.tokens_per_device, cfg.trainer.val_fraction, seed=0, num_workers=0
    )
    datamodule.setup()
    micro_batches = datamodule.train_batches_per_rank(1)
    assert micro_batches >= 3
    # Two optimizer steps an epoch, the second on the one micro-batch left.
    accumulate = micro_batches - 1
    tokens = f"trainer.global_batch_tokens={plan.tokens_per_device * accumulate}"
    summary = run_training(compose(*overrides, tokens), tmp_path / "run")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert (report["epochs"], report["steps"], summary.steps) == (2, 4, 4)


def test_a_time_limit_ends_training_as_if_done(compose, shards: Path, tmp_path: Path) -> None:
    """trainer.max_time_s stops before max_steps, still with the last checkpoint, the report and the head."""
    run_dir = tmp_path / "run"
    summary = run_training(compose(*train_overrides(shards, tmp_path, "trainer.max_time_s=0.001")), run_dir)
    assert summary.steps < 6
    assert json.loads((run_dir / "report.json").read_text())["steps"] == summary.steps
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert set(load_file(run_dir / "draft" / "model.safetensors")) == CONTRACT


def val_rows(run_dir: Path) -> list[tuple[int, float]]:
    rows = csv.DictReader(open(run_dir / "metrics.csv"))
    return [(int(r["step"]), float(r["val/tau_sim"])) for r in rows if r["val/tau_sim"]]


def scripted_tau_sim(monkeypatch: pytest.MonkeyPatch, scores: list[float]) -> None:
    """val/tau_sim of each validation in turn from `scores` (a tiny random target's stays ~1.0 whatever is
    trained: the selection, not the learning, is what these tests check)."""
    left = iter(scores)
    monkeypatch.setattr(
        "eaglet.train.module.tau_sim", lambda correct, count: torch.tensor(next(left), dtype=torch.float64)
    )


# Validated after steps 3 and 6 (every 3), not after the last.
SEVEN_STEPS = ("trainer.max_steps=7", "trainer.lr=3e-2")


def test_the_steps_after_the_last_validation_are_weighed_before_export(
    compose, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state after step 7 is validated too, and exported: it scores better than steps 3 and 6."""
    scripted_tau_sim(monkeypatch, [1.1, 1.2, 1.3])
    run_dir = tmp_path / "run"
    summary = run_training(compose(*train_overrides(shards, tmp_path, *SEVEN_STEPS)), run_dir)
    # metrics.csv's steps: a validation during fit is logged at its step - 1, one after fit at the step count.
    assert val_rows(run_dir) == [(2, pytest.approx(1.1)), (5, pytest.approx(1.2)), (7, pytest.approx(1.3))]
    assert Path(summary.best_checkpoint).name == "last.ckpt" and summary.tau_sim == pytest.approx(1.3)
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    best = torch.load(run_dir / "checkpoints" / "best-step6.ckpt", weights_only=True)["state_dict"]
    exported = load_file(run_dir / "draft" / "model.safetensors")
    assert not torch.equal(state["head.fc.weight"], best["head.fc.weight"])  # step 7 changed the head
    assert torch.equal(exported["fc.weight"], state["head.fc.weight"].to(exported["fc.weight"].dtype))


def test_a_final_state_no_better_than_the_best_leaves_the_best_exported(
    compose, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run with step 7 scoring no better (a tie included): the best validation's head, re-validated."""
    scripted_tau_sim(monkeypatch, [1.1, 1.3, 1.3, 1.3])
    run_dir = tmp_path / "run"
    summary = run_training(compose(*train_overrides(shards, tmp_path, *SEVEN_STEPS)), run_dir)
    assert [step for step, _ in val_rows(run_dir)] == [2, 5, 7, 7]  # the final state, then the selected head
    assert Path(summary.best_checkpoint).name == "best-step6.ckpt"
    best = torch.load(run_dir / "checkpoints" / "best-step6.ckpt", weights_only=True)["state_dict"]
    exported = load_file(run_dir / "draft" / "model.safetensors")
    assert torch.equal(exported["fc.weight"], best["head.fc.weight"].to(exported["fc.weight"].dtype))


def test_a_run_validated_at_its_last_step_is_not_validated_again_before_selection(
    compose, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six steps, validated after 3 and 6: the selected head's re-validation is the only one after fit."""
    scripted_tau_sim(monkeypatch, [1.1, 1.2, 1.2])
    run_dir = tmp_path / "run"
    summary = run_training(compose(*train_overrides(shards, tmp_path, "trainer.lr=3e-2")), run_dir)
    assert [step for step, _ in val_rows(run_dir)] == [2, 5, 6]
    assert Path(summary.best_checkpoint).name == "best-step6.ckpt"


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        (["trainer.ttt_steps=0"], ConfigError, "ttt_steps"),
        (["draft.vocab_size=60000"], ConfigError, "draft_vocab_size"),
        (["draft.vocab_size=20000"], ConfigError, "distinct"),
        (["trainer.global_batch_tokens=1000"], ConfigError, "global_batch_tokens"),
        (["model.aux_layer_ids=[1,2,3]"], DataError, "aux_layer_ids"),
        (["model.hidden_size=32", "draft.hidden_size=32"], DataError, "hidden_size"),
        (["hardware=h200_x1"], ConfigError, "hardware=h200_x1 needs 1"),
        (["hardware.strategy=fsdp"], ConfigError, "fsdp needs GPUs"),
        (["hardware.strategy=deepspeed"], ConfigError, "strategy='deepspeed' is not one of"),
        (["ckpt_path=last", "paths.output_dir=/nonexistent"], ConfigError, "ckpt_path=last"),
    ],
)
def test_bad_settings_fail_before_training(
    compose, shards: Path, tmp_path: Path, extra, error, match
) -> None:
    # Settings wrong without any data fail at compose (check_config), as in train.py.
    with pytest.raises(error, match=match):
        run_training(compose(*train_overrides(shards, tmp_path), *extra), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_shards_say_to_extract(compose, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="extract.py"):
        run_training(compose(*train_overrides(tmp_path / "none", tmp_path)), tmp_path / "run")


class RunsCode:
    """Pickled as a call of os.system: what a malicious checkpoint holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize(
    ("content", "match"),
    [("runs code", "is not a plain-weights checkpoint: it names Python objects"), ("cut", "not a readable")],
)
def test_a_checkpoint_that_is_not_plain_weights_is_refused_before_training(
    compose, shards: Path, tmp_path: Path, content: str, match: str
) -> None:
    marker, bad = tmp_path / "code-ran", tmp_path / "bad.ckpt"
    torch.save({"state_dict": {}, "payload": RunsCode(marker)}, bad)
    if content == "cut":
        bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(DataError, match=match) as refused:
        run_training(compose(*train_overrides(shards, tmp_path), f"ckpt_path={bad}"), tmp_path / "run")
    assert str(bad) in str(refused.value) and "ckpt_path" in str(refused.value)
    assert not marker.exists()
    assert not (tmp_path / "run").exists()


def test_a_folder_no_run_got_anywhere_in_is_discarded(tmp_path: Path) -> None:
    def started(name: str, *extra: str) -> RunDir:
        run = RunDir(tmp_path / name)
        for path in (".hydra/config.yaml", "train.log", "hparams.yaml", *extra):
            (run.path / path).parent.mkdir(parents=True, exist_ok=True)
            (run.path / path).write_text("x\n")
        run.metrics_file.write_text("epoch,step\n")
        return run

    started("failed").discard_if_unused()
    assert not (tmp_path / "failed").exists()
    for kept in (started("checkpointed", "checkpoints/last.ckpt"), started("logged")):
        if kept.path.name == "logged":
            kept.metrics_file.write_text("epoch,step\n0,0\n")
        before = sorted(kept.path.rglob("*"))
        kept.discard_if_unused()
        assert sorted(kept.path.rglob("*")) == before
    foreign = started("foreign", "notes.txt")
    foreign.discard_if_unused()
    assert [p.name for p in foreign.path.iterdir()] == ["notes.txt"]


def test_resolve_last_checkpoint(tmp_path: Path) -> None:
    for name, age in (("a", 10), ("b", 0)):
        ckpt = tmp_path / "train" / name / "checkpoints" / "last.ckpt"
        ckpt.parent.mkdir(parents=True)
        ckpt.write_bytes(b"x")
        os.utime(ckpt, (time.time() - age, time.time() - age))
    assert resolve_ckpt_path("last", tmp_path).endswith("b/checkpoints/last.ckpt")
    with pytest.raises(ConfigError, match="no such checkpoint"):
        resolve_ckpt_path(str(tmp_path / "missing.ckpt"), tmp_path)


def train_cmd(shards: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO_ROOT / "train.py"), *train_overrides(shards, out, "trainer.max_steps=10", *extra),
        f"paths.cache_dir={cache}", f"hydra.run.dir={out}/run",
    ]  # fmt: skip


@pytest.mark.e2e
def test_killed_training_resumes_to_the_same_weights(shards: Path, tmp_path: Path, model_cache: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **REPRODUCIBLE_CPU}
    whole = tmp_path / "whole"
    subprocess.run(train_cmd(shards, whole, model_cache), check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        train_cmd(shards, killed, model_cache), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    last = killed / "run" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not last.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            "training ended before its first checkpoint"
        )
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved_step = torch.load(last, weights_only=True)["global_step"]
    assert 0 < saved_step < 10

    resumed = tmp_path / "resumed"
    subprocess.run(
        train_cmd(shards, resumed, model_cache, f"ckpt_path={last}"), check=True, env=env, capture_output=True
    )
    assert not (resumed / "run").exists()  # the resumed run continued in the folder of its checkpoint
    expected = torch.load(whole / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(last, weights_only=True)
    assert got["global_step"] == expected["global_step"] == 10
    for name, tensor in expected["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.e2e
def test_a_run_that_fails_before_training_leaves_no_folder(
    shards: Path, tmp_path: Path, model_cache: Path
) -> None:
    evil = tmp_path / "evil.ckpt"
    torch.save({"payload": RunsCode(tmp_path / "code-ran")}, evil)
    for extra in ("trainer.ttt_steps=0", f"extract.output_dir={tmp_path / 'none'}", f"ckpt_path={evil}"):
        cmd = [
            sys.executable,
            TRAIN_PY,
            *train_overrides(shards, tmp_path, extra),
            f"paths.cache_dir={model_cache}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert list((tmp_path / "train").iterdir()) == [], extra
    assert not (tmp_path / "code-ran").exists()


# A tiny stand-in for the embedded default's 24 steps at lr 3e-2: its best validation (step 8) comes before the
# last checkpoints, and no later one beats it.
RESUME_SCENARIO = (
    "trainer.max_steps=12",
    "trainer.global_batch_tokens=512",
    "trainer.val_every_n_steps=2",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.lr=3e-2",
    "draft.vocab_size=1024",
)
TRAIN_PY = str(REPO_ROOT / "train.py")
# train.py in a process that kills itself with SIGKILL (no cleanup, as kill -9) where EAGLET_KILL_AT says:
# <Lightning callback hook>@<n> once n optimizer steps are done ("on_validation_start@4": after step 4, before
# its validation), final@0 in the validation of the selected checkpoint after training, or save@<n> just
# before this process's n-th checkpoint file would replace its final name.
KILLABLE_TRAIN = f"""
import os, runpy, signal, sys
import lightning.pytorch as pl

point, n = os.environ["EAGLET_KILL_AT"].split("@")
n = int(n)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(pl.Callback):
    pass


if point == "save":
    replace, saves = os.replace, []

    def replace_or_die(src, dst):
        if str(dst).endswith(".ckpt"):
            saves.append(dst)
            if len(saves) == n:
                die()
        replace(src, dst)

    os.replace = replace_or_die
elif point == "final":
    KillAt.on_validation_start = lambda self, trainer, module: trainer.state.fn == "validate" and die()
else:

    def hook(self, trainer, *args):
        if trainer.global_step == n and trainer.state.fn == "fit":
            die()

    setattr(KillAt, point, hook)
init = pl.Trainer.__init__


def init_with_kill(self, *args, callbacks=(), **kwargs):
    init(self, *args, callbacks=[*callbacks, KillAt()], **kwargs)


pl.Trainer.__init__ = init_with_kill
sys.argv = [{TRAIN_PY!r}, *sys.argv[1:]]
runpy.run_path({TRAIN_PY!r}, run_name="__main__")
"""


def start_train(
    shards: Path, out: Path, cache: Path, *extra: str, kill_at: str | None = None
) -> subprocess.Popen:
    """train.py with train_overrides + `extra`, its runs in out/train/<time>; killed at `kill_at` when given."""
    program = ["-c", KILLABLE_TRAIN] if kill_at else [TRAIN_PY]
    cmd = [sys.executable, *program, *train_overrides(shards, out, *extra), f"paths.cache_dir={cache}"]
    env = {**os.environ, "EAGLET_KILL_AT": kill_at or "", **REPRODUCIBLE_CPU}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def ended_as_asked(proc: subprocess.Popen, kill_at: str | None = None) -> None:
    """Wait for a start_train process: killed where asked, else successful."""
    _, stderr = proc.communicate()
    want = -signal.SIGKILL if kill_at else 0
    assert proc.returncode == want, f"killed at {kill_at}: rc {proc.returncode}\n{stderr[-3000:]}"


def train_process(shards: Path, out: Path, cache: Path, *extra: str, kill_at: str | None = None) -> None:
    ended_as_asked(start_train(shards, out, cache, *extra, kill_at=kill_at), kill_at)


def val_curve(run: RunDir) -> dict[int, str]:
    return {
        int(r["step"]): r["val/tau_sim"] for r in csv.DictReader(open(run.metrics_file)) if r["val/tau_sim"]
    }


@pytest.mark.e2e
def test_resumed_run_continues_in_its_folder_and_selects_the_same_head(
    shards: Path, tmp_path: Path, model_cache: Path
) -> None:
    train_process(shards, tmp_path / "whole", model_cache, *RESUME_SCENARIO)
    whole = RunDir.newest(tmp_path / "whole", key="eval.run")
    best = Path(json.loads(whole.report_file.read_text())["best_checkpoint"]).name
    assert best == "best-step8.ckpt", "the scenario needs its best validation before the kill after step 10"

    out = tmp_path / "killed"
    # Killed once after step 10 and its last.ckpt, as in the issue (step 20 of 24 there).
    train_process(shards, out, model_cache, *RESUME_SCENARIO, kill_at="on_train_batch_start@10")
    train_process(shards, out, model_cache, *RESUME_SCENARIO, "ckpt_path=last")
    resumed = RunDir.newest(out, key="eval.run")
    assert Path(json.loads(resumed.report_file.read_text())["best_checkpoint"]).name == best
    assert (resumed.draft_dir / "model.safetensors").read_bytes() == (
        whole.draft_dir / "model.safetensors"
    ).read_bytes()
    # One folder: checkpoints, metrics, report and head all continued where the killed run had them.
    assert [p.name for p in (out / "train").iterdir()] == [resumed.path.name]
    assert sorted(p.name for p in resumed.checkpoints_dir.iterdir()) == [best, "last.ckpt"]
    assert val_curve(resumed) == val_curve(whole)


@pytest.mark.e2e
def test_two_process_ddp_equals_one_process(shards: Path, tmp_path: Path, model_cache: Path) -> None:
    """hardware=cpu hardware.devices=2 (DDP over gloo) = one process with the same global batch."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    runs = {}
    for devices in (1, 2):
        out = tmp_path / f"devices{devices}"
        cmd = train_cmd(
            shards, out, model_cache, "trainer.max_steps=4", "trainer.lr=1e-2", f"hardware.devices={devices}"
        )
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[devices] = out / "run"
    two = runs[2]
    # Rank 0 alone writes: one metrics file, one report, one W&B run, one set of checkpoints.
    assert len(list(two.rglob("metrics.csv"))) == 1 and len(list(two.rglob("report.json"))) == 1
    assert len(list((two / "wandb").glob("offline-run-*"))) == 1
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == sorted(
        p.name for p in (runs[1] / "checkpoints").iterdir()
    )
    # The global-batch loss of every step is the same number on one process and on two.
    curves = {d: global_loss_curve(run / "metrics.csv") for d, run in runs.items()}
    assert len(curves[1]) == 4 and curves[1].keys() == curves[2].keys()
    for step, loss in curves[1].items():
        assert curves[2][step] == pytest.approx(loss, rel=1e-5), step
    one = torch.load(runs[1] / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    ddp = torch.load(two / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for name, tensor in one.items():
        torch.testing.assert_close(ddp[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def global_loss_curve(metrics_csv: Path) -> dict[int, float]:
    rows = csv.DictReader(open(metrics_csv))
    return {int(r["step"]): float(r["train/loss_global"]) for r in rows if r.get("train/loss_global")}


def test_bf16_mixed_precision_clips_gradients_of_the_fused_optimizer(
    compose, shards: Path, tmp_path: Path, monkeypatch
) -> None:
    # Lightning refuses to clip for a fused optimizer under mixed precision; without a loss scaler eaglet clips.
    clipped = []
    original = torch.nn.utils.clip_grad_norm_

    def spy(parameters, max_norm, *args, **kwargs):
        norm = original(parameters, max_norm, *args, **kwargs)
        clipped.append((float(norm), max_norm))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    overrides = train_overrides(shards, tmp_path, "hardware.precision=bf16-mixed", "trainer.grad_clip=0.001")
    summary = run_training(compose(*overrides), tmp_path / "run")
    assert summary.steps > 0 and len(clipped) == summary.steps
    assert all(max_norm == 0.001 and norm > 0.001 for norm, max_norm in clipped)
