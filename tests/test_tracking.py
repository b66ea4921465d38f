"""Run tracking: W&B offline unless logged in, WANDB_MODE respected, the composed config logged."""

from __future__ import annotations

from pathlib import Path

import pytest

from eaglet.config.plain import plain_config
from eaglet.train import tracking


def _tracked(cfg) -> tuple:
    """make_loggers' first arguments, as run_training passes them: the W&B settings and the whole config."""
    return cfg.wandb, plain_config(cfg)


def test_offline_unless_logged_in(compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setattr(tracking, "WandbLogger", lambda **kwargs: ("wandb", kwargs))
    loggers = tracking.make_loggers(*_tracked(compose()), tmp_path, job_type="train")
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    kind, kwargs = loggers[1]
    assert kind == "wandb" and kwargs["job_type"] == "train" and kwargs["group"] is None
    assert kwargs["config"]["model"]["name"] == "smollm2_135m"  # a plain, resolved dict


def test_logged_in_stays_online_and_disabled_means_csv_only(compose, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr(tracking, "WandbLogger", lambda **kwargs: "wandb")
    tracking.make_loggers(*_tracked(compose()), tmp_path, job_type="train")
    import os

    assert "WANDB_MODE" not in os.environ
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert len(tracking.make_loggers(*_tracked(compose()), tmp_path, job_type="train")) == 1


@pytest.mark.e2e
def test_an_offline_run_is_written_and_finished(
    compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    loggers = tracking.make_loggers(*_tracked(compose("wandb.tags=[test]")), tmp_path, job_type="train")
    loggers[1].log_metrics({"train/loss": 1.0}, step=0)
    tracking.finish_wandb(failed=False)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    import wandb

    assert wandb.run is None
